# SPDX-License-Identifier: BSD-3-Clause
"""Registers everything of torch.ops.gnext.* beyond the compiled CUDA kernels, in order: the fake kernels
(_ops), the CPU kernels (_cpu), autograd (_autograd), then the layout tag, which must come after every
registration (torch.library's registrations rebuild the overload objects, their tags with them)."""
from . import _ops  # noqa: F401  (first: the fake kernels)
from . import _cpu  # noqa: F401,I001
from . import _autograd  # noqa: F401,I001
from ._library import ops  # noqa: F401

_ops.mark_flexible_layout()
