"""The Llama model the GPU worker runs: rotary embeddings, checkpoints, weights, forward pass."""
