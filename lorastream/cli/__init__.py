"""The ``lorastream`` command line."""
