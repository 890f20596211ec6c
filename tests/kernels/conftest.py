"""Kernel tests run the Triton kernels in the interpreter on the CPU.

`TRITON_INTERPRET` must be set before any `@triton.jit` function is defined. `kernels` defines
its Triton kernels lazily, on the first launch, so setting it here is early enough even when
another test imported `kernels` first.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
