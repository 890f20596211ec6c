"""Session-wide test setup.

Triton reads ``TRITON_INTERPRET`` when it is first imported and when kernels are defined; some
libraries (transformers, torch) import Triton early, so the variable is set here, before any
test module is imported. These machines have no GPU: Triton kernels run in the interpreter.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
