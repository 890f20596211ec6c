"""The C++ CPU ops (``csrc/*.cpp``, built and loaded by ``ops.py``) and their Python bindings:
decode attention over the paged cache, the LoRA delta of decode steps, RMSNorm and the rotary
embedding, int8's weight-only product, int8-dynamic's input rotation, the multiply-add peak."""
