"""Write streamed adapter tensors back out as a PEFT LoRA directory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.manifest import AdapterManifest
from lorastream.core.module_patterns import pattern_dict

_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def peft_config(manifest: AdapterManifest) -> dict[str, object]:
    """The adapter_config.json PEFT needs to load these tensors."""
    config: dict[str, object] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": manifest.base_model or None,
        "r": manifest.default_rank or manifest.rank,
        "lora_alpha": manifest.alpha,
        "use_rslora": manifest.use_rslora,
        "target_modules": list(manifest.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "trainable_token_indices": list(manifest.token_indices) or None,
        "rank_pattern": dict(pattern_dict(manifest.rank_pattern, integer=True)),
        "alpha_pattern": dict(pattern_dict(manifest.alpha_pattern, integer=False)),
    }
    if manifest.alora_invocation_tokens:
        config["alora_invocation_tokens"] = list(manifest.alora_invocation_tokens)
    return config


def write_peft_dir(
    manifest: AdapterManifest, buffers: Sequence[bytes | bytearray | memoryview], out_dir: Path
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        info.name: torch.frombuffer(bytearray(buf), dtype=_TORCH_DTYPES[info.dtype]).reshape(
            info.shape
        )
        for info, buf in zip(manifest.tensors, buffers, strict=True)
    }
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(peft_config(manifest), indent=2) + "\n")
    return out_dir
