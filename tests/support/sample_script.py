"""``scripts/train_sample_adapters.py`` imported as a module (a script, not a package), for the
tests that run it or build their prompts with its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_sample_adapters.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_sample_adapters", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module
