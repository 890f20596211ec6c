"""OpenAI-compatible HTTP gateway over the GPU workers (see docs/gateway.md)."""
