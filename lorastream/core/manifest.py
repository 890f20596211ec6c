"""Plain types describing a staged adapter, shared by the store, the worker and the CLI.

An adapter has a human ``name`` and a content ``adapter_id`` (sha256 over its staged files), so two
names with the same files share one copy and re-registering a name with new weights gets a new id.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lorastream.core.module_patterns import Pattern, module_name, pattern_value, scaling

# safetensors dtype string -> bytes per element. Only floating dtypes are valid LoRA weights.
DTYPE_SIZES: dict[str, int] = {"F32": 4, "F16": 2, "BF16": 2}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of an adapter, in the raw little-endian row-major layout of safetensors."""

    name: str  # PEFT key, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    dtype: str  # safetensors dtype: "F32" | "F16" | "BF16"
    shape: tuple[int, ...]
    nbytes: int
    checksum: str  # sha256 hex of the tensor's raw bytes
    # "<algorithm>:<hex>" (xxh3-128 or blake3) computed by the store at staging and checked by
    # receivers instead of sha256; "" in manifests staged before it existed (core/checksum.py)
    fast_checksum: str = ""


@dataclass(frozen=True)
class AdapterFile:
    """A file the store keeps with an adapter beside its weights (its tokenizer's:
    ``core/adapter_tokenizer.py``), part of the content id."""

    name: str  # e.g. "tokenizer.json"
    nbytes: int
    checksum: str  # sha256 hex of the file


@dataclass(frozen=True)
class AdapterManifest:
    """Everything a receiver needs to know before the first tensor byte arrives."""

    adapter_id: str  # sha256 hex over the staged files (content address)
    name: str
    source_uri: str
    revision: str  # resolved revision: S3 ETag/version, Hub commit sha, or "" for local files
    base_model: str  # base_model_name_or_path from adapter_config.json ("" when null)
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # short module names present, sorted: ("k_proj", "q_proj", ...)
    tensors: tuple[TensorInfo, ...]
    created_at: float = 0.0  # unix seconds when staged
    pinned: bool = False
    last_used_at: float = 0.0
    # activated LoRA: PEFT's alora_invocation_tokens; () for a plain LoRA (the worker starts
    # the delta at their last occurrence in the prompt: worker/engine/activation.py)
    alora_invocation_tokens: tuple[int, ...] = ()
    # TrainableTokens: token ids whose embedding rows the adapter replaces, in its rows' order
    token_indices: tuple[int, ...] = ()
    # the adapter's own tokenizer files (() : it uses the base model's) and that tokenizer's
    # highest token id + 1 (0 without one)
    files: tuple[AdapterFile, ...] = ()
    tokenizer_vocab: int = 0
    # PEFT's rank_pattern / alpha_pattern (core/module_patterns.py): modules of their own rank
    # and alpha. With them ``rank`` is the largest module rank (what a slot must hold) and
    # ``default_rank`` adapter_config.json's ``r``, the rank of every other module (0: rank)
    rank_pattern: Pattern = ()
    alpha_pattern: Pattern = ()
    default_rank: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def scaling(self) -> float:
        """The adapter's one scaling, its modules' without a pattern: alpha / r, or
        alpha / sqrt(r) with rsLoRA (as PEFT computes it)."""
        return scaling(self.alpha, self.default_rank or self.rank, self.use_rslora)

    def module_rank(self, tensor_key: str, parameter: str | None = None) -> int:
        """The rank of the module a tensor adapts (``module_patterns.module_name``)."""
        if not self.rank_pattern:
            return self.rank
        name = module_name(tensor_key, parameter)
        return int(pattern_value(self.rank_pattern, name, self.default_rank or self.rank))

    def module_scaling(self, tensor_key: str, parameter: str | None = None) -> float:
        """The scaling of the module a tensor adapts: its alpha over its rank."""
        if not self.rank_pattern and not self.alpha_pattern:
            return self.scaling
        alpha = pattern_value(self.alpha_pattern, module_name(tensor_key, parameter), self.alpha)
        return scaling(alpha, self.module_rank(tensor_key, parameter), self.use_rslora)

    def replace(self, **changes: Any) -> AdapterManifest:
        return dataclasses.replace(self, **changes)


def manifest_json(m: AdapterManifest, *, tensors: bool = False) -> dict[str, Any]:
    """An adapter as JSON: the one shape of the gateway's HTTP API and ``lorastream adapters``
    (docs/gateway.md, docs/store-api.md). ``tensors`` is the tensor count; with ``tensors=True`` the
    tensors themselves follow under ``tensor_list`` (``lorastream adapters describe``)."""
    doc: dict[str, Any] = {
        "name": m.name,
        "adapter_id": m.adapter_id,
        "source": m.source_uri,
        "revision": m.revision,
        "base_model": m.base_model,
        "rank": m.rank,
        "alpha": m.alpha,
        "use_rslora": m.use_rslora,
        "target_modules": list(m.target_modules),
        "bytes": m.total_bytes,
        "tensors": len(m.tensors),
        "pinned": m.pinned,
        "created": int(m.created_at),
        "last_used": int(m.last_used_at),
    }
    if m.alora_invocation_tokens:
        doc["alora_invocation_tokens"] = list(m.alora_invocation_tokens)
    if tensors:
        doc["tensor_list"] = [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes,
             "checksum": t.checksum, "fast_checksum": t.fast_checksum}
            for t in m.tensors
        ]
    return doc


@dataclass
class PreloadProgress:
    """One progress event of a preload."""

    phase: str  # "resolving" | "downloading" | "validating" | "staging" | "done"
    bytes_done: int = 0
    bytes_total: int = 0
    message: str = ""
    manifest: AdapterManifest | None = field(default=None)


@dataclass(frozen=True)
class TensorChunk:
    """A slice of one tensor's raw bytes, as streamed by the store."""

    tensor_index: int
    offset: int  # byte offset inside the tensor
    data: bytes | memoryview
    crc32c: int  # CRC-32C (Castagnoli) of data
