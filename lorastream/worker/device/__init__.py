"""Step mechanics below the engine: the device layer (the only CUDA-vs-CPU switch), the step gate
that gives copies their turns on the CPU, compute-thread binding, thread priorities and the
preallocated staging buffers of each step."""
