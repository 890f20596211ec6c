"""The decoder the GPU worker runs, for every supported model family: configs and families,
rotary embeddings, checkpoints, weights, attention over the paged KV cache, forward pass."""
