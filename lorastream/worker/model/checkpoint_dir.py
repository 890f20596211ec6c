"""Whether a directory holds a usable Hugging Face checkpoint of a supported family: config.json
naming a family of ``model/families/``, safetensors weights (pickles refused, never unpickled)
and a tokenizer.

Apart from ``checkpoint.py`` (which resolves ``--model`` to a directory) because the converters
of ``gguf_file.py`` check their output with it too, and ``checkpoint.py`` imports them.
"""

from __future__ import annotations

import json
from pathlib import Path

from lorastream.core.errors import InvalidArgument

CONFIG_FILE = "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_checkpoint_dir(path: Path) -> Path:
    """Return ``path`` resolved if it holds a usable HF checkpoint of a supported family, else
    InvalidArgument."""
    if not path.exists():
        raise InvalidArgument(f"{path}: no such directory; pass an HF checkpoint directory")
    if not path.is_dir():
        raise InvalidArgument(
            f"{path}: is a file; pass the checkpoint directory that holds it (or a .gguf file)")
    path = path.resolve()
    _check_config(path)
    _check_weights(path)
    _check_tokenizer(path)
    return path


def _check_config(path: Path) -> None:
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise InvalidArgument(
            f"{path}: no {CONFIG_FILE}; an HF checkpoint directory (as save_pretrained writes "
            "it) is needed"
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidArgument(f"{config_file}: not readable JSON ({err})") from err
    if not isinstance(config, dict):
        raise InvalidArgument(f"{config_file}: expected a JSON object")
    from lorastream.worker.model.families import family_of

    family_of(config, str(config_file))  # InvalidArgument listing the supported families


def _check_weights(path: Path) -> None:
    index_file = path / WEIGHTS_INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise InvalidArgument(f"{index_file}: malformed safetensors index ({err!r})") from err
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise InvalidArgument(
                f"{path}: {WEIGHTS_INDEX} lists shards that are missing: {', '.join(missing)}; "
                "download the complete checkpoint"
            )
        return
    if any(path.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise InvalidArgument(
            f"{path}: only pickle weights ({', '.join(pickles)}), which are refused because "
            "loading them can run arbitrary code; convert them to *.safetensors (e.g. "
            "model.save_pretrained(dir, safe_serialization=True) in a trusted environment)"
        )
    raise InvalidArgument(f"{path}: no *.safetensors weights; save the model with save_pretrained")


def _check_tokenizer(path: Path) -> None:
    if (path / "tokenizer.json").is_file():
        return
    if (path / "tokenizer.model").is_file() and (path / "tokenizer_config.json").is_file():
        return
    raise InvalidArgument(
        f"{path}: no tokenizer; the directory needs tokenizer.json, or tokenizer.model with "
        "tokenizer_config.json (tokenizer.save_pretrained(dir) writes them)"
    )
