# SPDX-License-Identifier: BSD-3-Clause
# The compiled module (csrc/gnext.cpp). Importing it registers torch.ops.gnext.*.

def _set_aten_kernels(enable: bool | None, /) -> bool: ...
def _tuning() -> list[tuple[str, int, str]]: ...
def _set_tuning(knobs: dict[str, int] | None, /) -> None: ...
def _plan(
    shape: tuple[int, int, int, int],
    esize: int,
    channels_last: bool,
    act: int,
    residual: bool,
    device: tuple[int, int, int, int, int, int, int] | None,
    input_bias: bool = ...,
    /,
) -> str: ...
def _device() -> tuple[int, int, int, int, int, int, int]: ...
