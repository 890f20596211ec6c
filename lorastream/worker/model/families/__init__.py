"""The model families the worker serves, each a small difference from Llama (see llama.py);
the mixture-of-experts ones (Qwen3-MoE, Mixtral, Qwen2-MoE) differ from their dense parent by
the routed block of ``model/moe.py``.

A family turns a checkpoint's ``config.json`` into :class:`ModelConfig` fields; everything else
(decoder, weights, KV cache, LoRA slots, adapter checks) reads only the resulting config.
"""

from __future__ import annotations

from typing import Any

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model.families.gemma2 import Gemma2
from lorastream.worker.model.families.gemma3 import Gemma3Text
from lorastream.worker.model.families.llama import Llama
from lorastream.worker.model.families.mistral import Mistral
from lorastream.worker.model.families.mixtral import Mixtral
from lorastream.worker.model.families.phi3 import Phi3
from lorastream.worker.model.families.qwen2 import Qwen2
from lorastream.worker.model.families.qwen2_moe import Qwen2Moe
from lorastream.worker.model.families.qwen3 import Qwen3
from lorastream.worker.model.families.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, Llama] = {
    f.model_type: f for f in (
        Llama(), Mistral(), Qwen2(), Qwen3(), Gemma2(), Gemma3Text(), Phi3(),
        Qwen3Moe(), Mixtral(), Qwen2Moe(),
    )
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def family_of(raw: dict[str, Any], where: str = "config.json") -> Llama:
    """The family of a ``config.json``: by ``model_type``, else by ``architectures``."""
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[str(model_type)]
    architectures = raw.get("architectures") or []
    for family in FAMILIES.values():
        if set(architectures) & set(family.architectures):
            return family
    raise InvalidArgument(
        f"{where}: model_type {model_type!r} (architectures {architectures}) is not supported; "
        f"the worker serves these families: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
