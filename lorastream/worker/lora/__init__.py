"""Batched multi-LoRA: device slot storage, per-step metadata and the delta backends."""
