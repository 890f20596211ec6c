"""Whether an adapter fits a base model, from the store's manifest alone (no tensor bytes).

A worker refuses, at load, an adapter trained for another base (docs/design.md rule 6,
``lorastream/worker/loading/adapter.py``). The gateway asks the same question earlier,
of every adapter in the store, to list in ``/v1/models`` only those the workers can serve (as
vLLM lists only what it loaded): the store is shared, and its cache
(``~/.cache/lorastream/store``) by every stack on the machine, so it may hold adapters of other
bases. Each worker publishes its :class:`BaseShape` with its adapters (``ListAdapters``).

For example the default model (SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64) has
``q_proj: (576, 576)``, ``k_proj: (576, 192)``; an adapter of a 64-wide test model has a
``q_proj.lora_A`` of ``[r, 64]``, not ``[r, 576]``: it does not fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lorastream.core.adapter_format import (
    MAGNITUDE,
    MOE_NOT_YET,
    parse_lora_key,
    targets_moe_experts,
)
from lorastream.core.manifest import AdapterManifest


def expected_shape(ab: str, rank: int, fan_in: int, fan_out: int) -> tuple[int, ...]:
    """The shape a tensor of kind ``ab`` must have on a projection ``fan_in -> fan_out``:
    lora_A ``[r, in]``, lora_B ``[out, r]``, DoRA's magnitude ``[out]``."""
    if ab == MAGNITUDE:
        return (fan_out,)
    return (rank, fan_in) if ab == "A" else (fan_out, rank)


def tensor_kind(ab: str) -> str:
    """``lora_A``, ``lora_B`` or ``lora_magnitude_vector``, for messages."""
    return "lora_magnitude_vector" if ab == MAGNITUDE else f"lora_{ab}"


@dataclass(frozen=True)
class BaseShape:
    """What an adapter must match to fit a base model: its decoder layers, and for each
    projection it can adapt, (in_features, out_features); an adapter's ``lora_A`` of a
    projection is ``[r, in_features]``, its ``lora_B`` ``[out_features, r]``, a DoRA
    magnitude ``[out_features]``."""

    num_layers: int
    modules: Mapping[str, tuple[int, int]] = field(hash=False)  # "q_proj" -> (in, out)

    @property
    def known(self) -> bool:
        """False for a worker that did not say (an older one): nothing can be judged."""
        return self.num_layers > 0 and bool(self.modules)


def misfit(manifest: AdapterManifest, base: BaseShape) -> str | None:
    """Why ``manifest`` does not fit ``base`` (the first tensor that does not), or None when
    every tensor names a layer ``base`` has and a projection of its sizes."""
    for info in manifest.tensors:
        if targets_moe_experts(info.name):
            return f"tensor {info.name}: {MOE_NOT_YET}"
        key = parse_lora_key(info.name)
        if key is None or key.module not in base.modules:
            module = key.module if key is not None else info.name
            return (f"tensor {info.name} targets {module}, which the base model does not adapt "
                    f"(it adapts {', '.join(base.modules)})")
        if key.layer >= base.num_layers:
            return (f"it adapts layer {key.layer}, but the base model has {base.num_layers} "
                    "layers")
        fan_in, fan_out = base.modules[key.module]
        expected = expected_shape(key.ab, manifest.rank, fan_in, fan_out)
        if tuple(info.shape) != expected:
            return (f"layer {key.layer} {key.module} {tensor_kind(key.ab)} is "
                    f"{list(info.shape)}, but the base model needs {list(expected)} "
                    f"({key.module} maps {fan_in} -> {fan_out} features)")
    return None
