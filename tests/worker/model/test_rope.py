"""RotaryEmbedding and apply_rotary against transformers' own LlamaRotaryEmbedding (fp32, 1e-5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from lorastream.core.errors import InvalidArgument
from lorastream.worker.model.rope import (
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    apply_rotary,
    rope_settings_from_config,
)

ATOL = 1e-5


@dataclass(frozen=True)
class RopeCase:
    """One model's rope config and a flattened batch: (first position, token count) per sequence."""

    name: str
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    scaling: dict[str, Any] | None
    sequences: list[tuple[int, int]] = field(default_factory=list)


def _phi3_factors(n: int, low: float, high: float) -> list[float]:
    return [low + (high - low) * i / (n - 1) for i in range(n)]


CASES = [
    RopeCase("default", 64, 8192, 100000.0, None, [(0, 300), (5000, 1), (8000, 1)]),
    RopeCase(
        "linear",
        128,
        16384,
        10000.0,
        {"rope_type": "linear", "factor": 4.0},
        [(0, 100), (9000, 3), (16000, 1)],
    ),
    RopeCase(  # three sequences within the trained 2048, two past it (their own NTK base each)
        "dynamic",
        64,
        2048,
        10000.0,
        {"rope_type": "dynamic", "factor": 2.0},
        [(0, 200), (2040, 8), (2047, 1), (3000, 1), (4090, 6)],
    ),
    RopeCase(  # Llama 3.1
        "llama3",
        128,
        131072,
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        [(0, 64), (8191, 2), (30000, 1), (100000, 1)],
    ),
    RopeCase(
        "yarn",
        128,
        8192,
        10000.0,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
        [(0, 50), (2047, 3), (7000, 1)],
    ),
    RopeCase(  # DeepSeek-style attention factor from mscale / mscale_all_dim, untruncated ramp
        "yarn-mscale",
        64,
        16384,
        1000000.0,
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 2048,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "truncate": False,
        },
        [(0, 20), (12000, 1)],
    ),
    RopeCase(  # Phi-3-mini-128k shape: head_dim 96, factors per frequency, short and long sequences
        "longrope",
        96,
        131072,
        10000.0,
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 4096,
            "short_factor": _phi3_factors(48, 1.0, 1.2),
            "long_factor": _phi3_factors(48, 1.0, 40.0),
        },
        [(0, 100), (4090, 6), (4095, 2), (9000, 1), (60000, 1)],
    ),
    RopeCase(
        "longrope-attention-factor",
        64,
        16384,
        10000.0,
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 4096,
            "factor": 4.0,
            "attention_factor": 1.3,
            "short_factor": [1.0] * 32,
            "long_factor": _phi3_factors(32, 1.0, 8.0),
        },
        [(0, 10), (5000, 1)],
    ),
]


def ours(case: RopeCase) -> RotaryEmbedding:
    return RotaryEmbedding(
        case.head_dim, case.rope_theta, case.max_position_embeddings, case.scaling
    )


def hf_rotary(case: RopeCase) -> LlamaRotaryEmbedding:
    """A fresh transformers rotary module (dynamic RoPE keeps state between calls)."""
    rope_parameters = {"rope_type": "default", **(case.scaling or {})}
    rope_parameters["rope_theta"] = case.rope_theta
    config = LlamaConfig(
        hidden_size=case.head_dim * 4,
        num_attention_heads=4,
        head_dim=case.head_dim,
        max_position_embeddings=case.max_position_embeddings,
        rope_parameters=rope_parameters,
    )
    return LlamaRotaryEmbedding(config)


def flattened(sequences: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] and seq_lens [T] of a continuous batch: prefill chunks and decode tokens."""
    positions = torch.cat([torch.arange(start, start + n) for start, n in sequences])
    seq_lens = torch.cat([torch.full((n,), start + n) for start, n in sequences])
    return positions, seq_lens


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cos_sin_match_transformers_per_sequence_of_a_flattened_batch(case: RopeCase) -> None:
    rope = ours(case)
    positions, seq_lens = flattened(case.sequences)

    cos, sin = rope.cos_sin(positions, seq_lens)

    assert cos.shape == sin.shape == (positions.shape[0], case.head_dim)
    assert cos.dtype == sin.dtype == torch.float32
    offset = 0
    for start, n in case.sequences:
        ids = torch.arange(start, start + n)[None]  # [1, n]: one sequence, as transformers sees it
        x = torch.zeros(1, n, case.head_dim)
        ref_cos, ref_sin = hf_rotary(case)(x, ids)  # [1, n, D]
        torch.testing.assert_close(cos[offset : offset + n], ref_cos[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(sin[offset : offset + n], ref_sin[0], atol=ATOL, rtol=0)
        offset += n


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_without_seq_lens_the_batch_is_one_sequence_as_in_transformers(case: RopeCase) -> None:
    rope = ours(case)
    positions, _ = flattened(case.sequences)

    cos, sin = rope.cos_sin(positions)

    x = torch.zeros(1, positions.shape[0], case.head_dim)
    ref_cos, ref_sin = hf_rotary(case)(x, positions[None])
    torch.testing.assert_close(cos, ref_cos[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(sin, ref_sin[0], atol=ATOL, rtol=0)


def test_static_table_grows_past_its_first_length_and_is_reused() -> None:
    rope = RotaryEmbedding(64, 10000.0, 2048, None)
    far, near = torch.tensor([0, 10, 9000]), torch.tensor([5, 8999])

    far_cos, _ = rope.cos_sin(far)
    table = rope._tables["short"][0]
    near_cos, _ = rope.cos_sin(near)

    assert table.shape[0] >= 9001
    assert rope._tables["short"][0] is table  # no rebuild for positions already covered
    hf = hf_rotary(RopeCase("default", 64, 2048, 10000.0, None))
    for positions, cos in ((far, far_cos), (near, near_cos)):
        ref_cos, _ = hf(torch.zeros(1, positions.shape[0], 64), positions[None])
        torch.testing.assert_close(cos, ref_cos[0], atol=ATOL, rtol=0)


def test_empty_batch_gives_empty_tables() -> None:
    cos, sin = RotaryEmbedding(64, 10000.0, 2048, None).cos_sin(torch.empty(0, dtype=torch.int64))
    assert cos.shape == sin.shape == (0, 64)


def test_table_dtype_follows_the_constructor() -> None:
    rope = RotaryEmbedding(64, 10000.0, 2048, None, dtype=torch.bfloat16)
    cos, sin = rope.cos_sin(torch.arange(4))
    assert cos.dtype == sin.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
def test_apply_rotary_matches_transformers(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    torch.manual_seed(0)
    num_heads, num_kv_heads = heads
    case = CASES[3]  # llama3 frequencies, head_dim 128
    rope = ours(case)
    positions, seq_lens = flattened([(0, 7), (300, 1), (9000, 2)])
    cos, sin = rope.cos_sin(positions, seq_lens)  # [T, D]
    q = torch.randn(positions.shape[0], num_heads, case.head_dim, dtype=dtype)  # [T, H, D]
    k = torch.randn(positions.shape[0], num_kv_heads, case.head_dim, dtype=dtype)  # [T, Hkv, D]

    q_out, k_out = apply_rotary(q, k, cos, sin)

    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim=1)
    assert q_out.dtype == k_out.dtype == dtype
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, ref_q, atol=0, rtol=0)
    torch.testing.assert_close(k_out, ref_k, atol=0, rtol=0)


def test_partial_rotary_rotates_the_leading_dims_and_passes_the_rest() -> None:
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0, 2048, None, partial_rotary_factor=0.5)
    positions = torch.arange(5)
    cos, sin = rope.cos_sin(positions)  # [T, 32]
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)

    q_out, k_out = apply_rotary(q, k, cos, sin)

    full = RotaryEmbedding(32, 10000.0, 2048, None)  # same frequencies on a 32-dim head
    ref_q, ref_k = apply_rotary(q[..., :32], k[..., :32], *full.cos_sin(positions))
    assert cos.shape == (5, 32)
    torch.testing.assert_close(q_out[..., :32], ref_q)
    torch.testing.assert_close(k_out[..., :32], ref_k)
    assert torch.equal(q_out[..., 32:], q[..., 32:]) and torch.equal(k_out[..., 32:], k[..., 32:])


LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    ("config_json", "theta", "scaling"),
    [
        ({}, 10000.0, None),
        ({"rope_theta": 100000.0}, 100000.0, None),
        ({"rope_theta": 10000.0, "rope_scaling": None}, 10000.0, None),
        (  # transformers 4.x shape (Llama 3.1's config.json)
            {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA31_SCALING}},
            500000.0,
            {"rope_type": "llama3", **LLAMA31_SCALING},
        ),
        (  # transformers 5.x shape: theta inside rope_parameters
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31_SCALING}},
            500000.0,
            {"rope_type": "llama3", **LLAMA31_SCALING},
        ),
        (  # 5.x shape of the converted SmolLM2 checkpoint
            {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}},
            100000.0,
            None,
        ),
        (  # legacy "type" key
            {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
            10000.0,
            {"rope_type": "linear", "factor": 2.0},
        ),
        (  # rope_type wins over type; rope_parameters' theta wins over the top-level one
            {
                "rope_theta": 1.0,
                "rope_parameters": {
                    "type": "x",
                    "rope_type": "dynamic",
                    "factor": 2.0,
                    "rope_theta": 20000.0,
                },
            },
            20000.0,
            {"rope_type": "dynamic", "factor": 2.0},
        ),
        (  # rope_scaling wins over rope_parameters, as in transformers
            {
                "rope_theta": 30000.0,
                "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                "rope_parameters": {"rope_type": "dynamic", "factor": 2.0},
            },
            30000.0,
            {"rope_type": "linear", "factor": 4.0},
        ),
    ],
    ids=[
        "nothing",
        "theta-only",
        "null-scaling",
        "4x-llama3",
        "5x-llama3",
        "5x-default",
        "legacy-type",
        "precedence",
        "scaling-over-parameters",
    ],
)
def test_rope_settings_read_both_config_shapes(
    config_json: dict[str, Any], theta: float, scaling: dict[str, Any] | None
) -> None:
    assert rope_settings_from_config(config_json) == (theta, scaling)


@pytest.mark.parametrize(
    "config_json",
    [
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA31_SCALING}},
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31_SCALING}},
        {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        {  # the top-level original length wins over the one in rope_scaling, as in transformers
            "original_max_position_embeddings": 4096,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 2048,
            },
        },
    ],
    ids=["4x-llama3", "5x-llama3", "legacy-linear", "4x-dynamic", "phi3-original-length"],
)
def test_both_config_shapes_give_transformers_tables(config_json: dict[str, Any]) -> None:
    config_json = {
        **config_json,
        "model_type": "llama",
        "hidden_size": 512,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048 if "dynamic" in str(config_json) else 131072,
    }
    positions = torch.tensor([0, 1, 1000, 2047, 2048, 3000, 20000])
    rope = RotaryEmbedding.from_config(config_json)

    cos, sin = rope.cos_sin(positions)

    hf = LlamaRotaryEmbedding(LlamaConfig.from_dict(config_json))
    ref_cos, ref_sin = hf(torch.zeros(1, 7, 128), positions[None])
    torch.testing.assert_close(cos, ref_cos[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(sin, ref_sin[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: rope_settings_from_config({"rope_scaling": {"rope_type": "su", "factor": 2.0}}),
        lambda: RotaryEmbedding(64, 10000.0, 2048, {"rope_type": "mrope"}),
    ],
    ids=["config", "constructor"],
)
def test_unknown_rope_type_names_the_supported_ones(build: Any) -> None:
    with pytest.raises(InvalidArgument) as err:
        build()
    assert all(name in str(err.value) for name in SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize(
    ("scaling", "missing"),
    [
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 32}, "long_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, "32"),
    ],
    ids=["linear-factor", "llama3-low", "longrope-long", "longrope-length"],
)
def test_incomplete_scaling_is_refused_with_the_missing_key(
    scaling: dict[str, Any], missing: str
) -> None:
    with pytest.raises(InvalidArgument, match=missing):
        RotaryEmbedding(64, 10000.0, 2048, scaling)
