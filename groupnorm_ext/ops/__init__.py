# SPDX-License-Identifier: BSD-3-Clause
"""One module per operator of torch.ops.gnext: its fake (meta) kernels, CPU kernels and autograd formulas,
registered on import (groupnorm_ext/_registry.py imports them in order). Shared pieces: _cpu.py (argument
checks, CPU GroupNorm math), _autograd.py (the autograd machinery), _library.py (the compiled module)."""
