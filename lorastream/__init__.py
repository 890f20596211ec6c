"""lorastream: serve thousands of LoRA adapters on one base model.

The one import root. Subpackages, lowest layer first: ``core`` (domain types and errors, the
codec, adapter validation, clients) and the generated protobuf modules; ``kernels``; ``store`` and
``worker``; ``gateway``; ``stack``; ``bench`` and ``cli``. Imports point down that list.
"""

__version__ = "0.1.0"
