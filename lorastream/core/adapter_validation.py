"""Validation of a staged PEFT LoRA directory, without loading a single tensor into torch.

``adapter_config.json`` is parsed and refused when it asks for a LoRA variant lorastream does not
serve (biases, saved modules other than the vocabulary's, ...); DoRA
(``use_dora``), TrainableTokens (``trainable_token_indices``), LoRA on ``embed_tokens`` and
``lm_head`` and ``modules_to_save`` of those two are served (``_check_vocab``), and so is
activated LoRA (``alora_invocation_tokens``: a non-empty list of token ids, not with DoRA, as
PEFT allows), and so are per-module ranks and alphas (``rank_pattern``, ``alpha_pattern``:
``core/module_patterns.py``), each tensor checked against the rank its module resolves to.
``adapter_model.safetensors`` is checked from its header alone (8-byte little-endian length,
then JSON), with a size cap against header bombs:

    file = [u64 n][n bytes of JSON header][data]
    header = {"<key>": {"dtype": "F32", "shape": [r, in], "data_offsets": [begin, end]}, ...}

Offsets are relative to the start of data; together they must tile the data exactly (no holes, no
overlaps, nothing past the end), and every ``end - begin == prod(shape) * itemsize``. Keys must be
LoRA A/B weights of supported projections; each (layer, module) has both A ``[r, in]`` and B
``[out, r]`` with its module's ``r``, and with ``use_dora`` a magnitude vector ``[out]`` too
(without it, none). Then every tensor's raw bytes are hashed (sha256 and the fast
digest, in one read pass) in bounded chunks, so memory stays flat whatever the adapter's size.

The tensors are listed in **layer order** (:func:`layer_order`), which is the order the store
streams them in, so a receiver has layer 0 whole first, then layer 1, and so on. The file's own
order is lexicographic by key (safetensors sorts the names), which puts layer 10 before layer 2::

    file order:   layers.0.* layers.1.* layers.10.* layers.11.* layers.2.* ... layers.9.*
    layer order:  layers.0.* layers.1.* layers.2.* ... layers.9.* layers.10.* layers.11.*
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastream.core.adapter_format import (
    CONFIG_FILE,
    EXPERT_PROJECTIONS,
    FULL,
    FUSED_EXPERT_PARAMETERS,
    MAGNITUDE,
    ROUTER_PARAMETER,
    SUPPORTED_MODULES,
    TOKENS,
    VOCAB_MODULES,
    WEIGHTS_FILE,
    fused_depth,
    lora_parameter,
    parse_lora_key,
    parse_vocab_key,
    per_expert,
    short_module_name,
)
from lorastream.core.adapter_tokenizer import (
    TOKENIZER_FILES,
    file_sha256,
    tokenizer_files,
    tokenizer_vocab,
    vocab_refusal,
)
from lorastream.core.checksum import DEFAULT_TENSOR_DIGEST, TensorDigests
from lorastream.core.errors import InvalidAdapter
from lorastream.core.manifest import DTYPE_SIZES, AdapterFile, AdapterManifest, TensorInfo
from lorastream.core.module_patterns import (
    Pattern,
    module_name,
    parse_pattern,
    pattern_key,
    pattern_value,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_HEADER_BYTES = 16 << 20
_HASH_CHUNK = 1 << 20

# PEFT's LoraConfig defaults for fields an older config may omit.
_PEFT_DEFAULT_R = 8
_PEFT_DEFAULT_ALPHA = 8.0


@dataclass(frozen=True)
class StagedTensor:
    """A validated tensor and where its bytes start in the safetensors file (absolute offset)."""

    info: TensorInfo
    file_offset: int


@dataclass(frozen=True)
class ValidatedAdapter:
    """What validation learned about an adapter: the content half of an AdapterManifest."""

    base_model: str
    rank: int  # the largest module rank (rank_pattern), else r
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # short names present in the weights, sorted
    tensors: tuple[StagedTensor, ...]  # in layer order (layer_order), the stream's order
    use_dora: bool = False  # a magnitude vector per adapted module (DoRA)
    alora_invocation_tokens: tuple[int, ...] = ()  # activated LoRA; () for a plain LoRA
    token_indices: tuple[int, ...] = ()  # TrainableTokens' token ids, in its rows' order
    files: tuple[AdapterFile, ...] = ()  # its tokenizer's files (core/adapter_tokenizer.py)
    tokenizer_vocab: int = 0  # that tokenizer's highest id + 1; 0 without one
    rank_pattern: Pattern = ()  # core/module_patterns.py
    alpha_pattern: Pattern = ()
    default_rank: int = 0  # adapter_config.json's r when rank_pattern is set; 0: rank

    def manifest(
        self,
        *,
        adapter_id: str,
        name: str,
        source_uri: str,
        revision: str = "",
        created_at: float = 0.0,
        pinned: bool = False,
        last_used_at: float = 0.0,
    ) -> AdapterManifest:
        """The manifest of this content under a name: the one place a manifest is built from
        what validation learned (the store's staged adapters, the worker's local paths)."""
        return AdapterManifest(
            adapter_id=adapter_id,
            name=name,
            source_uri=source_uri,
            revision=revision,
            base_model=self.base_model,
            rank=self.rank,
            alpha=self.alpha,
            use_rslora=self.use_rslora,
            target_modules=self.target_modules,
            tensors=tuple(t.info for t in self.tensors),
            created_at=created_at,
            pinned=pinned,
            last_used_at=last_used_at,
            alora_invocation_tokens=self.alora_invocation_tokens,
            token_indices=self.token_indices,
            files=self.files,
            tokenizer_vocab=self.tokenizer_vocab,
            rank_pattern=self.rank_pattern,
            alpha_pattern=self.alpha_pattern,
            default_rank=self.default_rank,
        )


@dataclass(frozen=True)
class LoraConfigFields:
    """The fields of adapter_config.json lorastream uses."""

    base_model: str
    rank: int
    alpha: float
    use_rslora: bool
    use_dora: bool = False
    alora_invocation_tokens: tuple[int, ...] = ()
    token_indices: tuple[int, ...] = ()  # trainable_token_indices (of embed_tokens)
    rank_pattern: Pattern = ()  # core/module_patterns.py
    alpha_pattern: Pattern = ()

    def module_rank(self, name: str) -> int:
        """The rank of module ``name`` (its full name, ``module_patterns.module_name``)."""
        return int(pattern_value(self.rank_pattern, name, self.rank))

    def pattern_note(self, name: str) -> str:
        """Where module ``name``'s rank comes from, for messages."""
        key = pattern_key(self.rank_pattern, name)
        if key is None:
            return f"r={self.rank}"
        return f"rank_pattern[{key!r}]={self.module_rank(name)}"


# Config fields that switch on a LoRA variant lorastream cannot serve:
# (key, "is it switched on?", what to tell the user).
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("bias", lambda v: v not in (None, "none"), "bias training is not supported; use bias='none'"),
    ("lora_bias", bool, "lora_bias=true is not supported"),
    ("layer_replication", bool, "layer_replication is not supported"),
    ("use_qalora", bool, "QA-LoRA (use_qalora=true) is not supported"),
)


def parse_adapter_config(raw: bytes, label: str) -> LoraConfigFields:
    """Parse and check ``adapter_config.json``; ``label`` names the adapter in error messages."""
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidAdapter(f"{label}: {CONFIG_FILE} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{label}: {CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise InvalidAdapter(
            f"{label}: peft_type is {peft_type!r}; lorastream serves only LoRA adapters "
            "(peft_type 'LORA')"
        )
    parameters = config.get("target_parameters") or []
    fused = [f"experts.{p}" for p in FUSED_EXPERT_PARAMETERS]
    # PEFT matches a target parameter by the end of its name, and its "all-linear" on a MoE
    # base writes the bare names: only a fused expert parameter is called gate_up_proj/down_proj
    allowed = (*fused, *FUSED_EXPERT_PARAMETERS, ROUTER_PARAMETER)
    raw_parameters = [str(t) for t in parameters if not _at_part(str(t), allowed)]
    if raw_parameters or not isinstance(parameters, list):
        raise InvalidAdapter(
            f"{label}: target_parameters (LoRA on raw parameters) is supported only on a "
            f"mixture-of-experts block's {', '.join(fused)} and router {ROUTER_PARAMETER}, not on "
            f"{', '.join(raw_parameters) or repr(parameters)} ({CONFIG_FILE})"
        )
    for key, switched_on, message in _UNSUPPORTED:
        if switched_on(config.get(key)):
            raise InvalidAdapter(f"{label}: {message} ({key}={config[key]!r} in {CONFIG_FILE})")
    rank = config.get("r", _PEFT_DEFAULT_R)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise InvalidAdapter(f"{label}: r must be a positive integer, got {rank!r}")
    alpha = config.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidAdapter(f"{label}: lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise InvalidAdapter(f"{label}: use_rslora must be true or false, got {use_rslora!r}")
    use_dora = config.get("use_dora") or False
    if not isinstance(use_dora, bool):
        raise InvalidAdapter(f"{label}: use_dora must be true or false, got {use_dora!r}")
    invocation = _invocation_tokens(config.get("alora_invocation_tokens"), use_dora, label)
    try:
        rank_pattern = parse_pattern(config.get("rank_pattern"), "rank_pattern", integer=True)
        alpha_pattern = parse_pattern(config.get("alpha_pattern"), "alpha_pattern", integer=False)
    except ValueError as err:
        raise InvalidAdapter(f"{label}: {err} ({CONFIG_FILE})") from err
    targets = config.get("target_modules")
    if isinstance(targets, list):
        short = {short_module_name(str(t)) for t in targets}
        unsupported = sorted(short - set(SUPPORTED_MODULES) - set(VOCAB_MODULES)
                             - {"w1", "w2", "w3"})
        if unsupported:
            raise InvalidAdapter(
                f"{label}: target_modules include {', '.join(unsupported)}; lorastream adapts "
                f"only {', '.join(SUPPORTED_MODULES + VOCAB_MODULES)}"
            )
    saved = config.get("modules_to_save") or []
    others = sorted({short_module_name(str(m)) for m in saved} - set(VOCAB_MODULES))
    if others or not isinstance(saved, list):
        raise InvalidAdapter(
            f"{label}: modules_to_save is supported only for {' and '.join(VOCAB_MODULES)}, not "
            f"{', '.join(others) or repr(saved)} ({CONFIG_FILE})"
        )
    base_model = config.get("base_model_name_or_path") or ""
    if not isinstance(base_model, str):
        raise InvalidAdapter(f"{label}: base_model_name_or_path must be a string or null")
    return LoraConfigFields(base_model, rank, float(alpha), use_rslora, use_dora, invocation,
                            _token_indices(config.get("trainable_token_indices"), label),
                            rank_pattern, alpha_pattern)


_MAX_TOKEN_ID = (1 << 31) - 1  # the wire carries token ids as int32


def _invocation_tokens(value: object, use_dora: bool, label: str) -> tuple[int, ...]:
    """An activated LoRA's ``alora_invocation_tokens``: () when unset (a plain LoRA), else a
    non-empty list of token ids. Whether they lie within the base model's vocabulary is checked
    where the base is known (the worker, ``loading/adapter.py``)."""
    if value is None:
        return ()
    where = f"{label}: alora_invocation_tokens (activated LoRA) in {CONFIG_FILE}"
    if not isinstance(value, list) or not value:
        raise InvalidAdapter(
            f"{where} must be a non-empty list of token ids (the tokenized invocation string), "
            f"got {value!r}"
        )
    bad = [t for t in value
           if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _MAX_TOKEN_ID]
    if bad:
        raise InvalidAdapter(f"{where} holds {bad[:5]!r}, which are not token ids (integers >= 0)")
    if use_dora:
        raise InvalidAdapter(
            f"{where} is set together with use_dora=true; PEFT serves no such combination "
            "(train either an activated LoRA or a DoRA adapter)"
        )
    return tuple(value)


def _token_indices(value: object, label: str) -> tuple[int, ...]:
    """``trainable_token_indices``: a list of token ids, or ``{"embed_tokens": [...]}``
    (PEFT's two spellings); new rows of other modules are refused."""
    if not value:
        return ()
    if isinstance(value, dict):
        others = sorted(str(k) for k in value if short_module_name(str(k)) != "embed_tokens")
        if others or len(value) != 1:
            raise InvalidAdapter(
                f"{label}: trainable_token_indices is supported only for embed_tokens, not "
                f"{', '.join(others)} ({CONFIG_FILE})"
            )
        value = next(iter(value.values()))
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ) or len(set(value)) != len(value):
        raise InvalidAdapter(
            f"{label}: trainable_token_indices must be distinct non-negative token ids, got "
            f"{value!r}"
        )
    return tuple(value)


@dataclass(frozen=True)
class _HeaderEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the start of data
    end: int


def read_safetensors_header(
    path: Path, max_header_bytes: int, label: str
) -> tuple[list[_HeaderEntry], int]:
    """Parse and check a safetensors header; returns entries in file order and the data start."""
    file_size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise InvalidAdapter(f"{label}: {WEIGHTS_FILE} is truncated ({file_size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > max_header_bytes:
            raise InvalidAdapter(
                f"{label}: {WEIGHTS_FILE} declares a {header_len}-byte header, above the "
                f"{max_header_bytes}-byte cap (corrupt file, or raise max_header_bytes)"
            )
        if 8 + header_len > file_size:
            raise InvalidAdapter(
                f"{label}: {WEIGHTS_FILE} is truncated: its header needs {header_len} bytes but "
                f"the file has {file_size - 8} after the length prefix"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidAdapter(f"{label}: {WEIGHTS_FILE} header is not valid JSON ({err})") from err
    if not isinstance(header, dict):
        raise InvalidAdapter(f"{label}: {WEIGHTS_FILE} header must be a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    entries = sorted(
        (_header_entry(key, value, label) for key, value in header.items()),
        key=lambda e: (e.begin, e.end),
    )
    _check_tiling(entries, file_size - data_start, label)
    return entries, data_start


def _header_entry(key: str, value: object, label: str) -> _HeaderEntry:
    where = f"{label}: tensor {key}"
    if not isinstance(value, dict):
        raise InvalidAdapter(f"{where}: header entry must be an object")
    dtype = value.get("dtype")
    if dtype not in DTYPE_SIZES:
        raise InvalidAdapter(
            f"{where} has dtype {dtype!r}; LoRA weights must be one of {', '.join(DTYPE_SIZES)}"
        )
    shape = value.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InvalidAdapter(f"{where}: shape {shape!r} is not a list of non-negative integers")
    offsets = value.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise InvalidAdapter(f"{where}: data_offsets {offsets!r} must be [begin, end], begin<=end")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise InvalidAdapter(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but "
            f"{dtype} {shape} needs {expected}"
        )
    return _HeaderEntry(key, dtype, tuple(shape), offsets[0], offsets[1])


def _check_tiling(entries: list[_HeaderEntry], data_bytes: int, label: str) -> None:
    """The tensors must cover the data exactly: contiguous, no overlap, nothing past the end."""
    cursor = 0
    for e in entries:
        if e.end > data_bytes:
            raise InvalidAdapter(
                f"{label}: {WEIGHTS_FILE} is corrupt or truncated: tensor {e.key} ends at data "
                f"offset {e.end}, past the {data_bytes} data bytes the file holds"
            )
        if e.begin != cursor:
            what = "overlaps the previous tensor" if e.begin < cursor else "leaves a hole before it"
            raise InvalidAdapter(
                f"{label}: {WEIGHTS_FILE} is corrupt: tensor {e.key} at data offset {e.begin} "
                f"{what} (expected {cursor})"
            )
        cursor = e.end
    if cursor != data_bytes:
        state = "truncated" if cursor > data_bytes else "followed by unindexed bytes"
        raise InvalidAdapter(
            f"{label}: {WEIGHTS_FILE} is {state}: the header indexes {cursor} data bytes, the "
            f"file holds {data_bytes}"
        )


def _check_vocab(
    entries: list[_HeaderEntry], config: LoraConfigFields, label: str, tokens: int = 0,
) -> tuple[tuple[str, ...], int]:
    """The vocabulary modules' tensors (``adapter_format``: parse_vocab_key): one kind per
    module (new rows, a LoRA pair, or the whole module, a LoRA's saved base layer beside its
    pair), each of its kind's shape with one vocabulary V and hidden size H across them all,
    every trainable token id below V, and the adapter's tokenizer (``tokens`` ids, 0: none)
    within V. Returns the modules with a LoRA pair (target names) and their largest rank."""
    token_indices = config.token_indices
    largest = 0
    kinds: dict[str, dict[str, _HeaderEntry]] = {}
    for e in entries:
        key = parse_vocab_key(e.key)
        if key is not None:
            kinds.setdefault(key.module, {})[key.kind] = e
    if bool(token_indices) != (TOKENS in kinds.get("embed_tokens", {})):
        raise InvalidAdapter(
            f"{label}: trainable_token_indices in {CONFIG_FILE} and a "
            "token_adapter.trainable_tokens_delta tensor of embed_tokens go together; this "
            "adapter has only one of them"
        )
    if TOKENS in kinds.get("lm_head", {}):
        raise InvalidAdapter(f"{label}: trainable tokens of lm_head are not supported (only of "
                             "embed_tokens, which a tied lm_head follows)")
    sizes: dict[str, tuple[int, str]] = {}  # "V" | "H" -> (size, the tensor that set it)

    def agree(what: str, size: int, key: str) -> None:
        seen = sizes.setdefault(what, (size, key))
        if seen[0] != size:
            raise InvalidAdapter(f"{label}: tensor {key} has {what} = {size} but {seen[1]} has "
                                 f"{seen[0]}: one vocabulary and hidden size throughout")

    lora_modules = []
    for module, found in sorted(kinds.items()):
        where = f"{label}: {module}"
        lora = {"A", "B"} & set(found)
        if lora and lora != {"A", "B"}:
            raise InvalidAdapter(f"{where} has lora_{''.join(lora)} without its pair")
        if set(found) not in ({TOKENS}, {"A", "B"}, {FULL}, {"A", "B", FULL}):
            raise InvalidAdapter(f"{where} has tensors of more than one kind "
                                 f"({', '.join(e.key for e in found.values())})")
        for kind, e in found.items():
            if len(e.shape) != 2:
                raise InvalidAdapter(f"{label}: tensor {e.key} is {list(e.shape)}, not 2-D")
            rows, cols = e.shape
            if kind == TOKENS:
                if rows != len(token_indices):
                    raise InvalidAdapter(
                        f"{label}: tensor {e.key} has {rows} rows but trainable_token_indices "
                        f"lists {len(token_indices)} tokens")
                agree("H", cols, e.key)
            elif kind == FULL:
                agree("V", rows, e.key)
                agree("H", cols, e.key)
            else:
                r, (v_or_h, size) = (rows, ("V" if module == "embed_tokens" else "H", cols)) \
                    if kind == "A" else (cols, ("H" if module == "embed_tokens" else "V", rows))
                name = module_name(e.key)
                if r != config.module_rank(name):
                    raise InvalidAdapter(f"{label}: tensor {e.key} has rank {r} but "
                                         f"{CONFIG_FILE} says {config.pattern_note(name)}")
                largest = max(largest, r)
                agree(v_or_h, size, e.key)
        if lora:
            lora_modules.append(module)
    vocab = sizes.get("V")
    if vocab is not None and tokens > vocab[0]:
        raise InvalidAdapter(f"{label}: " + vocab_refusal(tokens, vocab[0], vocab[1]))
    if vocab is not None and token_indices and max(token_indices) >= vocab[0]:
        raise InvalidAdapter(
            f"{label}: trainable token {max(token_indices)} is beyond the vocabulary of "
            f"{vocab[0]} ({vocab[1]}); new tokens beyond the base vocabulary are not supported")
    return tuple(lora_modules), largest


def _check_lora_pairs(
    entries: list[_HeaderEntry], config: LoraConfigFields, label: str
) -> tuple[tuple[str, ...], int]:
    """Every key a LoRA A/B (or, with ``use_dora``, magnitude) of a supported module, pairs
    complete, ranks those of their modules (``config.module_rank``), each magnitude ``[out]``
    of its B's ``out`` (vocabulary modules' keys are :func:`_check_vocab`'s). Returns the
    target names and the largest module rank."""
    use_dora = config.use_dora
    pairs: dict[tuple[int, str], dict[str, _HeaderEntry]] = {}
    vocab = False
    for e in entries:
        if parse_vocab_key(e.key) is not None:
            vocab = True
            continue
        key = parse_lora_key(e.key)
        if key is None or _short(key.module) not in SUPPORTED_MODULES:
            module = key.module if key else e.key.split(".lora_")[0].rsplit(".", 1)[-1]
            raise InvalidAdapter(
                f"{label}: tensor {e.key} adapts {module!r}, which lorastream does not support; "
                f"only the decoder projections {', '.join(SUPPORTED_MODULES)} can be adapted"
            )
        slot = pairs.setdefault((key.layer, key.module), {})
        if key.ab in slot:
            raise InvalidAdapter(f"{label}: tensors {slot[key.ab].key} and {e.key} are duplicates")
        slot[key.ab] = e
    if not pairs and not vocab:
        raise InvalidAdapter(f"{label}: {WEIGHTS_FILE} holds no LoRA tensors")
    largest = 0
    for (layer, module), slot in sorted(pairs.items()):
        where = f"{label}: layer {layer} {module}"
        if not {"A", "B"} <= set(slot):
            missing = "B" if "A" in slot else "A"
            raise InvalidAdapter(f"{where} has no lora_{missing} weight")
        a, b = slot["A"], slot["B"]
        _check_magnitude(slot.get(MAGNITUDE), b, use_dora, where)
        if len(a.shape) != 2 or len(b.shape) != 2:
            raise InvalidAdapter(f"{where}: A {list(a.shape)} and B {list(b.shape)} must be 2-D")
        if a.shape[0] != b.shape[1]:
            raise InvalidAdapter(
                f"{where}: rank mismatch: lora_A is {list(a.shape)} ([r, in]) but lora_B is "
                f"{list(b.shape)} ([out, r])"
            )
        names = [module_name(a.key, p) for p in _parameters(module, layer, pairs)]
        ranks = [config.module_rank(n) for n in names]
        note = " or ".join(config.pattern_note(n) for n in names)
        if fused_depth(module) is not None:  # [E * r, in], [out, E * r]: every expert's r
            if all(a.shape[0] % r for r in ranks):
                raise InvalidAdapter(
                    f"{where}: lora_A is {list(a.shape)}, not [experts * r, in] with "
                    f"{note} from {CONFIG_FILE}"
                )
            largest = max(largest, *(r for r in ranks if a.shape[0] % r == 0))
        elif a.shape[0] != ranks[0]:
            raise InvalidAdapter(
                f"{where} has rank {a.shape[0]} but {CONFIG_FILE} says {note}"
            )
        else:
            largest = max(largest, a.shape[0])
    return tuple(sorted({_target_name(module) for _, module in pairs})), largest


def _parameters(module: str, layer: int, pairs: Mapping[tuple[int, str], object]
                ) -> list[str | None]:
    """The raw parameters a LoRA of ``module`` may adapt (``adapter_format.lora_parameter``;
    [None] for a module): a fused expert wrapper alone in its layer is either of
    FUSED_EXPERT_PARAMETERS, as only the base's sizes tell (the worker checks them)."""
    if fused_depth(module) is None:
        return [lora_parameter(module, {})]
    depths = sorted((fused_depth(m) or 0, m) for (at, m) in pairs
                    if at == layer and fused_depth(m) is not None)
    if len(depths) == len(FUSED_EXPERT_PARAMETERS):  # innermost: gate_up_proj
        named = {m: p for (_, m), p in zip(reversed(depths), FUSED_EXPERT_PARAMETERS,
                                           strict=True)}
        return [named[module]]
    return list(FUSED_EXPERT_PARAMETERS)


def _at_part(name: str, endings: tuple[str, ...]) -> bool:
    """``name`` is one of ``endings`` or ends with ``.`` + one (``mlp.gate.weight``, not
    ``shared_expert_gate.weight``)."""
    return any(name == end or name.endswith(f".{end}") for end in endings)


def _short(module: str) -> str:
    """The projection a (possibly expert) module is: ``experts.3.gate_proj`` -> gate_proj;
    a fused expert parameter (``experts``, ``experts.base_layer``) -> gate_proj."""
    one = per_expert(module)
    if one is not None:
        return one[1]
    if fused_depth(module) is not None:
        return EXPERT_PROJECTIONS[0]
    return module.rsplit(".", 1)[-1]


def _target_name(module: str) -> str:
    """What ``target_modules`` lists: per-expert modules once (``experts.gate_proj``)."""
    one = per_expert(module)
    return module if one is None else f"experts.{one[1]}"


def _check_magnitude(
    magnitude: _HeaderEntry | None, b: _HeaderEntry, use_dora: bool, where: str
) -> None:
    """With ``use_dora``, DoRA's magnitude vector is there and ``[out]`` (lora_B is
    ``[out, r]``); without it, there is none."""
    if not use_dora:
        if magnitude is not None:
            raise InvalidAdapter(
                f"{where} has a DoRA magnitude vector ({magnitude.key}) but {CONFIG_FILE} does "
                "not set use_dora=true"
            )
        return
    if magnitude is None:
        raise InvalidAdapter(
            f"{where} has no lora_magnitude_vector, which a DoRA adapter (use_dora=true) needs "
            "for every adapted module"
        )
    if len(b.shape) == 2 and magnitude.shape != b.shape[:1]:
        raise InvalidAdapter(
            f"{where}: lora_magnitude_vector is {list(magnitude.shape)}, but lora_B is "
            f"{list(b.shape)} ([out, r]): the magnitude must be [{b.shape[0]}] ([out])"
        )


def _digest_range(fd: int, start: int, length: int, fast: str, label: str) -> TensorDigests:
    """sha256 and the ``fast`` digest of a file range, in one read pass."""
    digests = TensorDigests(fast)
    done = 0
    while done < length:
        data = os.pread(fd, min(_HASH_CHUNK, length - done), start + done)
        if not data:
            raise InvalidAdapter(f"{label}: {WEIGHTS_FILE} shrank while it was being validated")
        digests.update(data)
        done += len(data)
    return digests


def layer_order(name: str) -> tuple[int, int, str]:
    """Sort key of a tensor in a manifest: the vocabulary modules' tensors first, then layer
    ascending, then the key; other tensors of no layer (``parse_lora_key`` gives None) last."""
    if parse_vocab_key(name) is not None:  # first: a prefill needs the embedding before layer 0
        return (0, -1, name)
    key = parse_lora_key(name)
    return (1, 0, name) if key is None else (0, key.layer, name)


STAGED_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # the order the content id hashes them in
ALL_FILES = STAGED_FILES + TOKENIZER_FILES  # and the adapter's tokenizer's, those present


def staged_files(directory: Path) -> tuple[str, ...]:
    """The files of ``directory`` an adapter is made of: STAGED_FILES and its tokenizer's."""
    present = {p.name for p in directory.iterdir() if p.is_file()}
    return STAGED_FILES + tokenizer_files(present)


def content_id(directory: Path) -> str:
    """The content address of a PEFT directory: sha256 over its :func:`staged_files` in order,
    each as ``name \\0 size \\0`` then its bytes. The store and the worker compute it alike."""
    digest = hashlib.sha256()
    for name in staged_files(directory):
        path = directory / name
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def validate_adapter_dir(
    directory: Path,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    label: str = "",
    tensor_digest: str = DEFAULT_TENSOR_DIGEST,
    hashed: Mapping[int, tuple[int, TensorDigests]] | None = None,
) -> ValidatedAdapter:
    """Validate a PEFT LoRA directory and checksum its tensors (sha256, plus ``tensor_digest``
    as each tensor's fast checksum unless that is sha256); raises InvalidAdapter.

    ``hashed`` (file offset -> (nbytes, digests), made with the same ``tensor_digest`` while the
    file was written) spares reading the tensors it covers again."""
    label = label or str(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise InvalidAdapter(f"{label}: {path.name} is missing; expected a PEFT LoRA directory")
    config = parse_adapter_config(config_path.read_bytes(), label)
    entries, data_start = read_safetensors_header(weights_path, max_header_bytes, label)
    targets, largest = _check_lora_pairs(entries, config, label)
    extra = staged_files(directory)[len(STAGED_FILES):]
    tokens = tokenizer_vocab(directory, label) if extra else 0
    vocab_targets, vocab_largest = _check_vocab(entries, config, label, tokens)
    targets = tuple(sorted(targets + vocab_targets))
    patterned = bool(config.rank_pattern or config.alpha_pattern)
    rank = max(largest, vocab_largest) if config.rank_pattern else config.rank
    rank = rank or config.rank
    files = tuple(AdapterFile(name, (directory / name).stat().st_size,
                              file_sha256(directory / name)) for name in extra)
    fd = os.open(weights_path, os.O_RDONLY)
    try:
        tensors = []
        for e in entries:
            known = (hashed or {}).get(data_start + e.begin)
            digests = (
                known[1] if known is not None and known[0] == e.end - e.begin
                else _digest_range(fd, data_start + e.begin, e.end - e.begin, tensor_digest, label)
            )
            info = TensorInfo(
                name=e.key, dtype=e.dtype, shape=e.shape, nbytes=e.end - e.begin,
                checksum=digests.sha256, fast_checksum=digests.fast_checksum,
            )
            tensors.append(StagedTensor(info, file_offset=data_start + e.begin))
    finally:
        os.close(fd)
    tensors.sort(key=lambda t: layer_order(t.info.name))  # read in file order, listed by layer
    log.debug("%s: %d tensors, rank %d, targets %s", label, len(tensors), rank, targets)
    return ValidatedAdapter(
        base_model=config.base_model,
        rank=rank,
        alpha=config.alpha,
        use_rslora=config.use_rslora,
        target_modules=targets,
        tensors=tuple(tensors),
        use_dora=config.use_dora,
        alora_invocation_tokens=config.alora_invocation_tokens,
        token_indices=config.token_indices,
        files=files,
        tokenizer_vocab=tokens,
        rank_pattern=config.rank_pattern,
        alpha_pattern=config.alpha_pattern,
        default_rank=config.rank if patterned else 0,
    )
