"""The request lifecycle and the step loop: intake, sequences, scheduling, step inputs, sampling,
detokenizing, and the engine that wires them together."""
