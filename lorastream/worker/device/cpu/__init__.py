"""CPU-only tuning of the worker's step: the step gate that gives copies and fetches their turns
between steps, compute-thread binding, loader-thread priorities, the choice of the C++ CPU kernels
and the native libraries' environment. Nothing here runs on CUDA."""
