"""Session-wide test setup.

Triton reads ``TRITON_INTERPRET`` when it is first imported and when kernels are defined; some
libraries (transformers, torch) import Triton early, so the variable is set here, before any
test module is imported. These machines have no GPU: Triton kernels run in the interpreter.

Workers built or started by tests take their host budget's pages on demand: taken at start
(``--host-memory-prefault``, the default) the default 4 GiB would be resident per worker, and
the test process holds many. ``tests/worker/test_fetch_process.py`` turns it on where it checks it.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("LORASTREAM_WORKER_HOST_MEMORY_PREFAULT", "false")
