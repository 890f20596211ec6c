"""Weighted mixes of adapters: what a request may name, and the ``model`` spelling of one.

A mix is a list of ``(adapter name, weight)``. It serves the adapter PEFT's
``add_weighted_adapter(names, weights, combination_type="cat")`` would build, whose delta is
``sum_i weight_i * scaling_i * B_i A_i x``; the worker computes that sum from each component's
own slot (``lora/backend.py``), never a merged copy.

The ``model`` spelling, for clients that can only set ``model``::

    mix:<name>=<weight>,<name>=<weight>,...      e.g.  mix:support=0.7,legal-v2=0.3

``:``, ``=`` and ``,`` are never part of an adapter name (``store/names.py``), so the spelling
cannot collide with one; ``name@<content-id prefix>`` works as a component's name.

Rules, the same at the gateway and the worker (a direct gRPC caller too): at least one
component, at most the worker's ``--max-mix-adapters``; finite weights; each name at most once
(a name twice is refused; two names of the same content are summed, which is exact). Kinds whose
delta is not a plain ``B A x`` cannot be mixed (:func:`unmixable`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lorastream.core.adapter_format import (
    MAGNITUDE,
    is_expert_module,
    parse_lora_key,
    parse_vocab_key,
)
from lorastream.core.errors import InvalidArgument
from lorastream.core.manifest import AdapterManifest

MIX_PREFIX = "mix:"
MixSpec = tuple[tuple[str, float], ...]  # (adapter name or content id, weight) per component


def parse_mix_model(model: str) -> MixSpec | None:
    """The components of a ``mix:`` model name; None for any other name. Raises
    InvalidArgument for a malformed one."""
    if not model.startswith(MIX_PREFIX):
        return None
    components: list[tuple[str, float]] = []
    for part in model[len(MIX_PREFIX):].split(","):
        name, eq, weight = part.strip().rpartition("=")
        if not eq or not name:
            raise InvalidArgument(
                f"model {model!r}: each mix component is <adapter>=<weight>, e.g. "
                "mix:support=0.7,legal=0.3"
            )
        try:
            value = float(weight)
        except ValueError:
            raise InvalidArgument(
                f"model {model!r}: the weight of {name!r} is {weight!r}, not a number"
            ) from None
        components.append((name.strip(), value))
    return check_mix(components)


def mix_model(components: MixSpec) -> str:
    """The ``mix:`` spelling of ``components`` (what responses name as their model)."""
    return MIX_PREFIX + ",".join(f"{name}={weight:g}" for name, weight in components)


def check_mix(components: Sequence[tuple[str, float]], limit: int | None = None) -> MixSpec:
    """``components`` as a mix, checked: non-empty, at most ``limit``, finite weights, each name
    once. Raises InvalidArgument saying what to fix."""
    mix = tuple((str(name), float(weight)) for name, weight in components)
    if not mix:
        raise InvalidArgument("a mix of adapters needs at least one component")
    if limit is not None and len(mix) > limit:
        raise InvalidArgument(
            f"the mix names {len(mix)} adapters; this server mixes at most {limit} "
            "(--max-mix-adapters)"
        )
    names = [name for name, _ in mix]
    for name, weight in mix:
        if not name:
            raise InvalidArgument("a mix component has an empty adapter name")
        if not math.isfinite(weight):
            raise InvalidArgument(f"the mix weight of {name!r} is {weight}; weights must be finite")
        if names.count(name) > 1:
            raise InvalidArgument(
                f"the mix names {name!r} more than once; name each adapter once with the sum "
                "of its weights"
            )
    return mix


def unmixable(manifest: AdapterManifest) -> str | None:
    """Why an adapter cannot be part of a mix (None: it can). A mix serves only plain LoRA
    deltas: DoRA rescales the whole projection by its own norm, vocabulary modules replace
    embedding rows, an activated LoRA starts at its own position, expert LoRA adapts a MoE
    base's routed experts; none of them is a term of PEFT's ``cat`` sum here. Per-module ranks
    and alphas (``rank_pattern`` / ``alpha_pattern``) are no reason: each module's scaling is
    folded into its B when placed (``lora/slots.py``), so a slot's delta is PEFT's for every
    module and a weighted sum of slots is exact. An adapter that
    ships its own tokenizer or generation config is refused too: a mix is encoded, decoded and
    stopped with the base model's, which would silently not be that adapter's."""
    if manifest.files:
        return "it ships its own tokenizer or generation config (a mix uses the base model's)"
    if manifest.alora_invocation_tokens:
        return "it is an activated LoRA (alora_invocation_tokens)"
    if manifest.token_indices:
        return "it has trainable token embeddings (vocabulary modules)"
    for info in manifest.tensors:
        if parse_vocab_key(info.name) is not None:
            return "it has vocabulary modules (embed_tokens / lm_head)"
        key = parse_lora_key(info.name)
        if key is None:
            continue
        if key.ab == MAGNITUDE:
            return "it is a DoRA adapter"
        if is_expert_module(key.module):
            return "it adapts a mixture-of-experts base's routed experts"
    return None
