"""lorastream: serve thousands of LoRA adapters on one base model.

This package holds what the services share: domain types and errors, the one codec between
protobuf and those types, the generated protobuf modules, and the ``lorastream`` CLI.
"""

__version__ = "0.1.0"
