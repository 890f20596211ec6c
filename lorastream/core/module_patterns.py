"""PEFT's per-module ranks and alphas: ``rank_pattern`` and ``alpha_pattern``, resolved as PEFT
resolves them, once for the store's validation and the worker's placement.

``adapter_config.json`` may give some modules their own rank and alpha::

    "r": 8, "lora_alpha": 16,
    "rank_pattern":  {".*\\.gate_up_proj": 16},    # PEFT's "all-linear" on a MoE base
    "alpha_pattern": {".*\\.gate_up_proj": 32}

A key is a regular expression over a module's full name (``model.layers.0.self_attn.q_proj``)
or that exact name; the first key (in the file's order) with ``re.match(rf"(.*\\.)?({key})$",
name)`` gives the value, else ``r`` / ``lora_alpha`` (PEFT's ``get_pattern_key``). A LoRA on a
raw parameter (``target_parameters``) is named by the parameter:
``model.layers.0.mlp.experts.gate_up_proj``, ``model.layers.0.mlp.gate.weight``.

A module's scaling is ``alpha_m / r_m`` (``alpha_m / sqrt(r_m)`` with rsLoRA).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache

Pattern = tuple[tuple[str, float], ...]  # (key, value) in the config's order

_PEFT_PREFIX = "base_model.model."
# what follows a module's name in a tensor key
_SUFFIX = re.compile(
    r"\.(?:lora_(?:embedding_)?[AB](?:\.[^.]+)?(?:\.weight)?|lora_magnitude_vector(?:\.[^.]+)?)$"
)


def parse_pattern(value: object, field: str, integer: bool) -> Pattern:
    """A ``rank_pattern`` (``integer``: positive integers) or ``alpha_pattern`` (finite
    numbers) from ``adapter_config.json``, checked: a dict of regular expression -> value
    (None / {}: none). Raises ValueError saying what is wrong."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a JSON object of module pattern -> value, got "
                         f"{value!r}")
    pattern: list[tuple[str, float]] = []
    for key, v in value.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if integer and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{field}[{key!r}] is {v!r}; a rank must be a positive integer")
        if not integer and not (number and math.isfinite(v)):
            raise ValueError(f"{field}[{key!r}] is {v!r}; an alpha must be a finite number")
        try:
            re.compile(key)
        except re.error as err:
            raise ValueError(f"{field} key {key!r} is not a regular expression ({err})") from err
        pattern.append((key, float(v)))
    return tuple(pattern)


@lru_cache(maxsize=16384)
def _matches(key: str, name: str) -> bool:
    return re.match(rf"(.*\.)?({key})$", name) is not None


def pattern_key(pattern: Pattern, name: str) -> str | None:
    """The first key of ``pattern`` that names module ``name`` (PEFT's ``get_pattern_key``)."""
    for key, _ in pattern:
        if _matches(key, name):
            return key
    return None


def pattern_value(pattern: Pattern, name: str, default: float) -> float:
    """The value ``pattern`` gives module ``name``, else ``default``."""
    key = pattern_key(pattern, name)
    return default if key is None else dict(pattern)[key]


def module_name(tensor_key: str, parameter: str | None = None) -> str:
    """The full name a pattern matches for a tensor of an adapter: its module's name without
    PEFT's prefix and wrappers (``base_layer``), then ``.parameter`` for a LoRA on a raw
    parameter. Examples::

        base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
            -> model.layers.0.self_attn.q_proj
        base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight, "gate_up_proj"
            -> model.layers.0.mlp.experts.gate_up_proj
    """
    name = tensor_key.removeprefix(_PEFT_PREFIX)
    name = _SUFFIX.sub("", name)
    name = ".".join(p for p in name.split(".") if p != "base_layer")
    return f"{name}.{parameter}" if parameter else name


def scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's LoRA scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def pattern_dict(pattern: Sequence[tuple[str, float]], integer: bool) -> Mapping[str, float]:
    """``pattern`` as adapter_config.json writes it (ranks as integers)."""
    return {k: int(v) if integer else v for k, v in pattern}
