"""PEFT's rank_pattern / alpha_pattern lookup (lorastream.core.module_patterns) agrees with
PEFT's own ``get_pattern_key`` on the names PEFT matches: modules, raw parameters, exact names,
regular expressions, the first key winning."""

from __future__ import annotations

import pytest
from peft.utils.other import get_pattern_key

from lorastream.core.module_patterns import module_name, parse_pattern, pattern_value

KEYS = {  # in the config's order: the first key that names a module wins
    "model.layers.1.self_attn.q_proj": 2,  # an exact name
    "q_proj": 4,
    r".*\.gate_up_proj": 16,  # what PEFT's all-linear writes on a MoE base
    "gate.weight": 6,  # a raw parameter
    "layers.[02].mlp.down_proj": 12,
}


@pytest.mark.parametrize(
    ("tensor_key", "parameter", "name"),
    [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", None,
         "model.layers.0.self_attn.q_proj"),
        ("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight", None,
         "model.layers.1.self_attn.q_proj"),
        ("base_model.model.model.layers.1.self_attn.k_proj.lora_magnitude_vector", None,
         "model.layers.1.self_attn.k_proj"),
        ("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight", "gate_up_proj",
         "model.layers.0.mlp.experts.gate_up_proj"),
        ("base_model.model.model.layers.0.mlp.experts.lora_B.weight", "down_proj",
         "model.layers.0.mlp.experts.down_proj"),
        ("base_model.model.model.layers.3.mlp.gate.lora_A.weight", "weight",
         "model.layers.3.mlp.gate.weight"),
        ("base_model.model.model.layers.2.mlp.down_proj.lora_A.weight", None,
         "model.layers.2.mlp.down_proj"),
        ("base_model.model.model.layers.3.mlp.down_proj.lora_A.weight", None,
         "model.layers.3.mlp.down_proj"),
        ("base_model.model.model.layers.0.self_attn.xq_proj.lora_A.weight", None,
         "model.layers.0.self_attn.xq_proj"),
        ("base_model.model.lm_head.lora_B.weight", None, "lm_head"),
        ("base_model.model.model.embed_tokens.lora_embedding_A", None, "model.embed_tokens"),
    ],
)
def test_a_tensors_module_resolves_to_the_value_peft_gives_it(
    tensor_key: str, parameter: str | None, name: str
) -> None:
    assert module_name(tensor_key, parameter) == name
    pattern = parse_pattern(KEYS, "rank_pattern", integer=True)
    expected = KEYS.get(get_pattern_key(list(KEYS), name), 8)
    assert pattern_value(pattern, name, 8) == expected


@pytest.mark.parametrize(
    ("value", "integer", "message"),
    [
        ([["q_proj", 4]], True, "must be a JSON object"),
        ({"q_proj": 0}, True, "a rank must be a positive integer"),
        ({"q_proj": True}, True, "a rank must be a positive integer"),
        ({"q_proj": float("inf")}, False, "an alpha must be a finite number"),
        ({"q_proj[": 4}, True, "is not a regular expression"),
    ],
)
def test_a_malformed_pattern_is_refused_saying_what_is_wrong(
    value: object, integer: bool, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pattern(value, "rank_pattern" if integer else "alpha_pattern", integer)
