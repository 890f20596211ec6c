"""Push a LoRA adapter to the store straight from memory (a training loop), with no files.

    from peft import get_peft_model_state_dict
    from lorastream.core.push import push_state_dict

    manifest = push_state_dict(
        "store:50051", "support-bot", get_peft_model_state_dict(model),
        model.peft_config["default"], token=operate_token, force=True,
    )

The tensors are serialised with safetensors and the config as PEFT's ``save_pretrained`` writes
it (``json.dumps(config.to_dict(), indent=2, sort_keys=True)`` with ``inference_mode`` true), so
the bytes, and hence the content id, equal those of ``model.save_pretrained(dir)`` preloaded from
``dir`` (for a config with a ``task_type``; without one PEFT also records the base model class).

Keys must be in PEFT's saved form,
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (A ``[r, in]``, B
``[out, r]``): ``get_peft_model_state_dict`` returns exactly that. A raw
``model.state_dict()`` carries the adapter name (``lora_A.default.weight``) and the base weights;
filter it through ``get_peft_model_state_dict`` first. peft itself is not needed here: any config
object with ``to_dict()``, or a plain dict, is accepted.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.adapter_tokenizer import tokenizer_files
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import StoreClient
from lorastream.core.tls import ClientTLS


class HasToDict(Protocol):
    """A ``peft.LoraConfig`` or anything shaped like it."""

    def to_dict(self) -> dict[str, Any]: ...


def _json_default(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} in the LoRA config is not JSON serialisable")


def adapter_config_bytes(lora_config: HasToDict | Mapping[str, Any]) -> bytes:
    """``adapter_config.json`` as PEFT's ``save_pretrained`` writes it for this config."""
    config = dict(lora_config.to_dict() if hasattr(lora_config, "to_dict") else lora_config)
    for key, value in config.items():  # as PEFT does: top-level sets become lists
        if isinstance(value, set):
            config[key] = list(value)
    config["inference_mode"] = True
    return json.dumps(config, indent=2, sort_keys=True, default=_json_default).encode()


def adapter_weights_bytes(state_dict: Mapping[str, torch.Tensor]) -> bytes:
    """``adapter_model.safetensors`` for these tensors, as PEFT saves them (contiguous, CPU,
    shared storage cloned apart, ``format: pt`` metadata)."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[str, int]] = set()
    for key, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state dict entry {key!r} is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().to("cpu").contiguous()
        storage = (str(t.device), t.untyped_storage().data_ptr())
        if storage in storages:  # safetensors refuses aliased tensors
            t = t.clone()
        storages.add(storage)
        tensors[key] = t
    return save(tensors, metadata={"format": "pt"})


def push_state_dict(
    store: str | StoreClient,
    name: str,
    state_dict: Mapping[str, torch.Tensor],
    lora_config: HasToDict | Mapping[str, Any],
    *,
    pin: bool = False,
    force: bool = False,
    token: str | None = None,
    tls: ClientTLS | None = None,
    tokenizer_dir: Path | None = None,
) -> AdapterManifest:
    """Stage ``state_dict`` + ``lora_config`` in the store as ``name`` and return its manifest.

    ``store`` is ``HOST:PORT`` (a client is opened with ``token``/``tls`` and closed) or an open
    :class:`StoreClient`. The store validates the adapter like any other (InvalidAdapter names
    what is wrong) and stages it under ``push://<name>``; pushing new weights under the same name
    replaces them (workers key by content id, so none serves the old weights afterwards); a name
    staged from another source needs ``force``. The serialised adapter is held in memory once.
    ``tokenizer_dir``: where ``tokenizer.save_pretrained`` wrote the adapter's own tokenizer (one
    with added tokens); its files are pushed with the adapter, in its content id.
    """
    files: list[tuple[str, bytes | Path]] = [
        (CONFIG_FILE, adapter_config_bytes(lora_config)),
        (WEIGHTS_FILE, adapter_weights_bytes(state_dict)),
    ]
    if tokenizer_dir is not None:
        present = [p.name for p in tokenizer_dir.iterdir() if p.is_file()]
        files += [(name, tokenizer_dir / name) for name in tokenizer_files(present)]
    if isinstance(store, StoreClient):
        return store.push(files, name, pin=pin, force=force)
    with StoreClient(store, token, tls=tls) as client:
        return client.push(files, name, pin=pin, force=force)
