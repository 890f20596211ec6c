"""Check an adapter against this worker's base model before it can reach a slot
(docs/design.md rule 6).

The store already checked the adapter on its own (PEFT format, A/B pairs, ranks); here we check
it fits *this* base model and *this* worker: every tensor names a layer the model has and a
projection it adapts, with ``A [r, in]`` and ``B [out, r]`` of the model's sizes, and a rank
within ``--max-lora-rank``. Checksums were verified while the bytes landed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorastream.core.adapter_format import parse_lora_key
from lorastream.core.errors import InvalidAdapter
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.loading.host_buffer import HostAdapterBuffer
from lorastream.worker.model.config import ModelConfig


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter's tensors in host memory, mapped to (layer, module, A|B), ready for a slot."""

    adapter_id: str
    name: str
    rank: int
    scaling: float
    # (first layer, module, "A"|"B", block [n_layers, *shape]): zero-copy views of the host buffer
    blocks: tuple[tuple[int, str, str, torch.Tensor], ...]
    nbytes: int


def check_fits(manifest: AdapterManifest, config: ModelConfig, max_rank: int) -> None:
    """InvalidAdapter unless ``manifest`` fits the base model and the slot capacity.

    The adaptable modules and their sizes come from the base model's family (e.g. Phi-3 adapts
    the fused qkv_proj and gate_up_proj, not q_proj); a wrong target names the family and what
    it accepts.
    """
    label = f"adapter {manifest.name}"
    if manifest.rank > max_rank:
        raise InvalidAdapter(
            f"{label} has rank {manifest.rank}, above this worker's --max-lora-rank {max_rank}; "
            "start the worker with a larger --max-lora-rank"
        )
    shapes = config.module_shapes()
    base = config.describe()
    for info in manifest.tensors:
        key = parse_lora_key(info.name)
        if key is None or key.module not in shapes:
            module = key.module if key is not None else info.name
            raise InvalidAdapter(
                f"{label}: tensor {info.name} targets {module}, which {base} does not have; "
                f"its adaptable modules are {', '.join(shapes)} (train the adapter for this "
                "base model, with target_modules among them)"
            )
        if key.layer >= config.num_layers:
            raise InvalidAdapter(
                f"{label} was trained for a different base model: it adapts layer {key.layer}, "
                f"but {base} has {config.num_layers} layers"
            )
        fan_in, fan_out = shapes[key.module]
        expected = (manifest.rank, fan_in) if key.ab == "A" else (fan_out, manifest.rank)
        if tuple(info.shape) != expected:
            raise InvalidAdapter(
                f"{label} was trained for a different base model: layer {key.layer} "
                f"{key.module} lora_{key.ab} is {list(info.shape)}, but {base} needs "
                f"{list(expected)} ({key.module} maps {fan_in} -> {fan_out} features)"
            )


def adapter_weights(
    buffer: HostAdapterBuffer, config: ModelConfig, max_rank: int
) -> AdapterWeights:
    """Check the adapter in ``buffer`` and map it, in as few blocks as its layout allows, for
    :meth:`LoraSlots.write`."""
    manifest = buffer.manifest
    assert manifest is not None, "the buffer holds no adapter"
    check_fits(manifest, config, max_rank)
    blocks = tuple((layer, module, ab, block) for module, ab, layer, block in buffer.groups())
    return AdapterWeights(
        adapter_id=manifest.adapter_id,
        name=manifest.name,
        rank=manifest.rank,
        scaling=manifest.scaling,
        blocks=blocks,
        nbytes=manifest.total_bytes,
    )
