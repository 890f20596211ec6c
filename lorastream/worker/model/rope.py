"""Rotary position embeddings for a flattened batch, with the scaling schemes HF configs use.

Semantics (one token ``t`` of head dim ``D``, rotary dim ``d = int(D * partial_rotary_factor)``)::

    inv_freq[j] = scheme(rope_theta, j, seq_len[t])          # j < d / 2
    angle[j]    = positions[t] * inv_freq[j]
    cos[t]      = cat(cos(angle), cos(angle)) * attention_scaling   # [d]
    sin[t]      = cat(sin(angle), sin(angle)) * attention_scaling   # [d]
    q'          = q * cos + rotate_half(q) * sin                     # first d dims; the rest pass

Every scheme mirrors ``transformers/modeling_rope_utils.py`` (5.23) float32 op for op, so the
tables equal ``LlamaRotaryEmbedding``'s. Only 'dynamic' and 'longrope' depend on the sequence
length; transformers takes it from the whole batch (``max(position_ids) + 1``), here each token
uses its own sequence's length (``seq_lens``), which is what transformers does for one sequence.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from lorastream.core.errors import InvalidArgument
from lorastream.kernels.cpu.norm_rope import rotary

log = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_ORIGINAL_LENGTH_TYPES = ("llama3", "yarn", "longrope")  # read original_max_position_embeddings
_FIRST_TABLE_LEN = 4096  # static tables start this long (or max_position_embeddings) and double


def rope_settings_from_config(config_json: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``config.json`` -> ``(rope_theta, scaling)``; ``scaling`` is None for plain RoPE.

    Reads both shapes transformers accepts: 4.x ``rope_theta`` + ``rope_scaling`` and 5.x
    ``rope_parameters`` (which holds ``rope_theta`` itself). As in transformers, ``rope_scaling``
    wins over ``rope_parameters``, a ``rope_theta`` inside the dict wins over the top-level one,
    ``rope_type`` wins over the legacy ``type`` key, a top-level ``partial_rotary_factor`` is
    moved into the dict, and a top-level ``original_max_position_embeddings`` replaces the dict's
    (what transformers' rotary module ends up using). ``scaling`` always carries ``rope_type`` and
    never ``rope_theta``.
    """
    raw = config_json.get("rope_scaling") or config_json.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise InvalidArgument(
            f"config.json: rope_scaling/rope_parameters must be an object, got {type(raw).__name__}"
        )
    params = dict(raw)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = config_json.get("rope_theta", DEFAULT_ROPE_THETA)
    legacy_type = params.pop("type", "default")
    params.setdefault("rope_type", legacy_type)
    if "partial_rotary_factor" in config_json:
        params.setdefault("partial_rotary_factor", config_json["partial_rotary_factor"])
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise _unknown_type(params["rope_type"])
    top_level_original = config_json.get("original_max_position_embeddings")
    if params["rope_type"] in _ORIGINAL_LENGTH_TYPES and top_level_original is not None:
        params["original_max_position_embeddings"] = top_level_original  # Phi-3 style: it wins
    if params == {"rope_type": "default"}:
        return float(theta), None
    return float(theta), params


def _unknown_type(rope_type: object) -> InvalidArgument:
    return InvalidArgument(
        f"rope_type {rope_type!r} is not supported; supported rope types: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)} (fix rope_scaling/rope_parameters in config.json)"
    )


def _required(params: dict[str, Any], key: str) -> Any:
    value = params.get(key)
    if value is None:
        raise InvalidArgument(
            f"rope_type {params['rope_type']!r} needs {key!r} in rope_scaling/rope_parameters"
        )
    return value


class RotaryEmbedding:
    """cos/sin tables for one model; ``cos_sin`` picks the rows of a flattened batch.

    ``rope_scaling`` is the dict :func:`rope_settings_from_config` returns (``rope_type`` plus the
    scheme's keys), None for plain RoPE; a ``partial_rotary_factor`` in it wins over the argument.
    Every type honours ``partial_rotary_factor`` (transformers' Llama 'default' path ignores it;
    Llama checkpoints never set it).
    """

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        max_position_embeddings: int,
        rope_scaling: dict[str, Any] | None,
        partial_rotary_factor: float = 1.0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        params = dict(rope_scaling or {})
        params.setdefault("rope_type", params.pop("type", "default"))
        self.rope_type: str = params["rope_type"]
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise _unknown_type(self.rope_type)
        factor_override = params.get("partial_rotary_factor")
        self.partial_rotary_factor = float(factor_override or partial_rotary_factor)
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * self.partial_rotary_factor)  # d
        self.theta = float(params.get("rope_theta") or rope_theta)
        self.max_position_embeddings = max_position_embeddings
        # transformers defaults it to max_position_embeddings for llama3, yarn and longrope.
        self.original_max_position_embeddings = int(
            params.get("original_max_position_embeddings") or max_position_embeddings
        )
        self.params = params
        self.device = torch.device(device)
        self.dtype = dtype
        # The frequencies of sequences within the (original) trained length: [d / 2] float32.
        self.inv_freq, self.attention_scaling = self._init_inv_freq()
        self.long_inv_freq: torch.Tensor | None = None  # longrope past the original length
        if self.rope_type == "longrope":
            self.long_inv_freq = self._longrope_inv_freq(_required(params, "long_factor"))
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> cos, sin [N, d]

    @classmethod
    def from_config(
        cls,
        config_json: dict[str, Any],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> RotaryEmbedding:
        """Build from a checkpoint's ``config.json`` (either rope config shape)."""
        theta, scaling = rope_settings_from_config(config_json)
        heads = int(config_json["num_attention_heads"])
        head_dim = int(config_json.get("head_dim") or int(config_json["hidden_size"]) // heads)
        max_positions = int(config_json.get("max_position_embeddings", 2048))
        return cls(head_dim, theta, max_positions, scaling, device=device, dtype=dtype)

    # -- inverse frequencies, as transformers' ROPE_INIT_FUNCTIONS -------------------------------
    def _exponents(self) -> torch.Tensor:  # [d / 2] float32: 2j / d
        d = self.rotary_dim
        return torch.arange(0, d, 2, dtype=torch.int64, device=self.device).float() / d

    def _init_inv_freq(self) -> tuple[torch.Tensor, float]:
        p, rope_type = self.params, self.rope_type
        if rope_type == "default":
            return 1.0 / (self.theta ** self._exponents()), 1.0
        if rope_type == "linear":
            return 1.0 / (self.theta ** self._exponents()) / float(_required(p, "factor")), 1.0
        if rope_type == "dynamic":
            _required(p, "factor")
            return self._dynamic_inv_freq(self.max_position_embeddings), 1.0
        if rope_type == "llama3":
            return self._llama3_inv_freq(), 1.0
        if rope_type == "yarn":
            return self._yarn_inv_freq()
        return self._longrope_inv_freq(_required(p, "short_factor")), self._longrope_scaling()

    def _dynamic_inv_freq(self, seq_len: int | torch.Tensor) -> torch.Tensor:
        """NTK-aware frequencies for ``seq_len``: an int -> [d / 2]; [U] int64 -> [U, d / 2]."""
        factor, mpe, d = float(self.params["factor"]), self.max_position_embeddings, self.rotary_dim
        if isinstance(seq_len, torch.Tensor):
            seq_len = torch.clamp(seq_len, min=mpe)[:, None]  # [U, 1] int64
        else:
            seq_len = max(seq_len, mpe)
        base = self.theta * ((factor * seq_len / mpe) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** self._exponents())

    def _llama3_inv_freq(self) -> torch.Tensor:
        p = self.params
        inv_freq = 1.0 / (self.theta ** self._exponents())  # [d / 2]
        factor = float(_required(p, "factor"))
        low_freq_factor = float(_required(p, "low_freq_factor"))
        high_freq_factor = float(_required(p, "high_freq_factor"))
        old_context_len = self.original_max_position_embeddings
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        band = high_freq_factor - low_freq_factor
        smooth = (old_context_len / wavelen - low_freq_factor) / band
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)

    def _yarn_inv_freq(self) -> tuple[torch.Tensor, float]:
        p, d, base = self.params, self.rotary_dim, self.theta
        original = self.original_max_position_embeddings
        factor = p.get("factor")
        if factor is None:
            factor = self.max_position_embeddings / original
        factor = float(factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs = base ** self._exponents()  # [d / 2]
        inv_freq_extrapolation = 1.0 / pos_freqs
        inv_freq_interpolation = 1.0 / (factor * pos_freqs)
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp.to(self.device)  # [d / 2]
        inv_freq = (
            inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation
        )
        return inv_freq, float(attention_factor)

    def _longrope_inv_freq(self, ext_factors: list[float]) -> torch.Tensor:
        if len(ext_factors) != self.rotary_dim // 2:
            raise InvalidArgument(
                f"longrope short_factor/long_factor need {self.rotary_dim // 2} entries "
                f"(rotary dim / 2), got {len(ext_factors)}"
            )
        factors = torch.tensor(ext_factors, dtype=torch.float32, device=self.device)  # [d / 2]
        return 1.0 / (factors * self.theta ** self._exponents())

    def _longrope_scaling(self) -> float:
        original = self.original_max_position_embeddings
        factor = self.params.get("factor")
        if factor is None:
            factor = self.max_position_embeddings / original
        attention_factor = self.params.get("attention_factor")
        if attention_factor is None:
            if factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(factor) / math.log(original))
        return float(attention_factor)

    # -- tables -------------------------------------------------------------------------------
    def _cos_sin_of(
        self, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] int64, inv_freq [d / 2] or [N, d / 2] -> cos, sin [N, d] float32."""
        freqs = positions.float()[:, None] * inv_freq  # [N, d / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, d]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def _table(self, name: str, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``name`` ('short' or 'long') table with at least ``needed`` rows: [N, d] each."""
        cached = self._tables.get(name)
        if cached is not None and cached[0].shape[0] >= needed:
            return cached
        length = min(self.max_position_embeddings, _FIRST_TABLE_LEN)
        if cached is not None:
            length = cached[0].shape[0] * 2
        while length < needed:
            length *= 2
        inv_freq = self.long_inv_freq if name == "long" else self.inv_freq
        assert inv_freq is not None
        positions = torch.arange(length, dtype=torch.int64, device=self.device)
        cos, sin = self._cos_sin_of(positions, inv_freq)
        self._tables[name] = (cos.to(self.dtype), sin.to(self.dtype))
        log.debug("rope %s table grown to %d positions", name, length)
        return self._tables[name]

    def _lookup(
        self, name: str, positions: torch.Tensor, max_position: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if max_position is None:
            max_position = int(positions.max())  # a device read: callers in a step pass it
        cos, sin = self._table(name, max_position + 1)
        return cos.index_select(0, positions), sin.index_select(0, positions)  # [T, d]

    def cos_sin(
        self,
        positions: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
        *,
        max_position: int | None = None,
        longest: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, d] in ``dtype``, attention scaling included.

        ``seq_lens`` [T]: for each token, the length its sequence has after this forward (its
        largest position here + 1). Only 'dynamic' and 'longrope' read it; without it the whole
        batch counts as one sequence of length ``max(positions) + 1``, as in transformers.
        ``max_position`` (the largest position) and ``longest`` (the largest seq_len) are host
        integers the step builder knows; given, nothing here reads a device tensor.
        """
        if positions.numel() == 0:
            empty = torch.empty(0, self.rotary_dim, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        positions = positions.to(device=self.device, dtype=torch.int64)
        if self.rope_type not in ("dynamic", "longrope"):
            return self._lookup("short", positions, max_position)
        if seq_lens is None:
            seq_lens = (positions.max() + 1).expand(positions.shape[0])  # [T]
        seq_lens = seq_lens.to(device=self.device, dtype=torch.int64)
        if self.rope_type == "longrope":
            is_long = (seq_lens > self.original_max_position_embeddings)[:, None]  # [T, 1]
            short_cos, short_sin = self._lookup("short", positions, max_position)
            any_long = (
                longest > self.original_max_position_embeddings
                if longest is not None
                else bool(is_long.any())
            )
            if not any_long:
                return short_cos, short_sin
            long_cos, long_sin = self._lookup("long", positions, max_position)
            cos = torch.where(is_long, long_cos, short_cos)  # [T, d]
            return cos, torch.where(is_long, long_sin, short_sin)
        return self._dynamic_cos_sin(positions, seq_lens, max_position, longest)

    def _dynamic_cos_sin(
        self,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        max_position: int | None,
        longest: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """'dynamic': tokens of sequences past max_position_embeddings get their own base."""
        cos, sin = self._lookup("short", positions, max_position)  # [T, d]
        is_long = seq_lens > self.max_position_embeddings  # [T]
        any_long = (
            longest > self.max_position_embeddings if longest is not None else bool(is_long.any())
        )
        if not any_long:
            return cos, sin
        lengths, which = torch.unique(seq_lens[is_long], return_inverse=True)  # [U], [T']
        inv_freq = self._dynamic_inv_freq(lengths)[which]  # [T', d / 2]
        long_cos, long_sin = self._cos_sin_of(positions[is_long], inv_freq)  # [T', d]
        cos, sin = cos.clone(), sin.clone()
        cos[is_long] = long_cos.to(self.dtype)
        sin[is_long] = long_sin.to(self.dtype)
        return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., d] -> [..., d]
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by cos, sin [T, d] (d <= D), HF Llama's convention.

    ``q * cos + rotate_half(q) * sin`` on the first ``d`` dims; dims past ``d`` (partial rotary)
    pass through. cos/sin are cast to q's dtype first, as transformers does. ``native``: fp32
    q and k go through the C++ op (lorastream/kernels/cpu/norm_rope.py), bit for bit this.
    """
    if (native and q.dtype == torch.float32 and k.dtype == torch.float32
            and cos.dtype == torch.float32 and sin.dtype == torch.float32):
        return rotary(q, k, cos.contiguous(), sin.contiguous())
    d = cos.shape[-1]
    cos = cos.to(q.dtype)[:, None, :]  # [T, 1, d]
    sin = sin.to(q.dtype)[:, None, :]  # [T, 1, d]

    def rotate(x: torch.Tensor) -> torch.Tensor:  # [T, h, D]
        if d == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        x_rot, x_pass = x[..., :d], x[..., d:]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)

    return rotate(q), rotate(k)
