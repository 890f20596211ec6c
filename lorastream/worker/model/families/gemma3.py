"""Gemma 3 (text) = Gemma 2 + a Gemma-style RMSNorm on each head of q and k, a RoPE of its own
for the sliding layers (``rope_local_base_freq``, or ``rope_parameters['sliding_attention']``),
one global layer in ``sliding_window_pattern`` (6), and no attention-logit soft-capping."""

from __future__ import annotations

from typing import Any

from lorastream.worker.model.families.gemma2 import Gemma2, optional_float
from lorastream.worker.model.rope import rope_settings_from_config

GLOBAL_THETA = 1_000_000.0  # Gemma3TextConfig.default_theta
LOCAL_THETA = 10_000.0


class Gemma3Text(Gemma2):
    model_type = "gemma3_text"
    architectures = ("Gemma3ForCausalLM",)
    differs = (
        "as Gemma 2, plus q/k RMSNorm and a separate RoPE base for sliding layers; one global "
        "layer in sliding_window_pattern; no attention soft-capping"
    )

    def read(self, raw: dict[str, Any]) -> dict[str, Any]:
        fields = super().read(raw)
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:  # transformers 5.x
            full = {"rope_theta": GLOBAL_THETA, **(params.get("full_attention") or {})}
            local = {"rope_theta": LOCAL_THETA, **(params.get("sliding_attention") or {})}
            theta, scaling = rope_settings_from_config({**raw, "rope_parameters": full})
            local_theta, local_scaling = rope_settings_from_config(
                {**raw, "rope_scaling": None, "rope_parameters": local}
            )
        else:  # 4.x: rope_theta and rope_scaling for global layers, rope_local_base_freq
            theta, scaling = rope_settings_from_config({"rope_theta": GLOBAL_THETA, **raw})
            local_theta = float(raw.get("rope_local_base_freq", LOCAL_THETA))
            local_scaling = None
        return {
            **fields,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "local_rope_theta": local_theta,
            "local_rope_scaling": local_scaling,
            "qk_norm": True,
            "attn_softcap": None,  # Gemma3Attention does not pass it to the attention
            "final_softcap": optional_float(raw.get("final_logit_softcapping")),
        }

    def pattern(self, raw: dict[str, Any]) -> int:
        return int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
