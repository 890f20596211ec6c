"""Step mechanics below the engine: the device layer (``device.py``, the only CUDA-vs-CPU switch:
buffers, the load stream, events), the preallocated staging buffers of each step, the quantized
products' kernel choice, and in ``cpu/`` the CPU-only tuning (step gate, thread binding, priorities,
native libraries' environment)."""
