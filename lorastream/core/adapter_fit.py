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
    TOKENS,
    VOCAB_MODULES,
    fused_depth,
    lora_parameter,
    parse_lora_key,
    parse_vocab_key,
    per_expert,
    resolve_fused_experts,
    vocab_shape,
)
from lorastream.core.adapter_tokenizer import vocab_refusal
from lorastream.core.manifest import AdapterManifest, TensorInfo


@dataclass(frozen=True)
class ExpertShape:
    """A mixture-of-experts base model's routed experts, as an expert LoRA must match them."""

    num_experts: int
    hidden: int  # H: gate/up read it, down writes it
    inter: int  # I: one expert's width
    layers: frozenset[int]  # the layers with routed experts (the others have a dense MLP)

    def projection(self, name: str) -> tuple[int, int]:
        """(in, out) of one expert's ``gate_proj``, ``up_proj``, ``down_proj`` or fused
        ``gate_up_proj``."""
        h, i = self.hidden, self.inter
        return {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
                "gate_up_proj": (h, 2 * i)}[name]


def expert_names(manifest: AdapterManifest, experts: ExpertShape) -> dict[str, str]:
    """Each fused expert module of ``manifest`` (``experts``, ``experts.base_layer``) ->
    ``experts.gate_up_proj`` | ``experts.down_proj`` (``resolve_fused_experts``)."""
    found: dict[str, dict[str, tuple[int, ...]]] = {}
    for info in manifest.tensors:
        key = parse_lora_key(info.name)
        if key is not None and fused_depth(key.module) is not None:
            found.setdefault(key.module, {})[key.ab] = tuple(info.shape)
    pairs = {m: (ab.get("A", ()), ab.get("B", ())) for m, ab in found.items()}
    return resolve_fused_experts(pairs, experts.hidden, experts.inter)


def expert_misfit(
    manifest: AdapterManifest, info: TensorInfo, module: str, layer: int, ab: str,
    experts: ExpertShape | None, names: dict[str, str],
) -> str | None:
    """Why the expert tensor ``info`` (of ``module`` in ``layer``) does not fit ``experts``."""
    if experts is None:
        return f"tensor {info.name} adapts mixture-of-experts experts, but the base model has none"
    if layer not in experts.layers:
        return (f"tensor {info.name} adapts the experts of layer {layer}, which has a dense MLP "
                f"in the base model (its expert layers are {sorted(experts.layers)})")
    count = experts.num_experts
    one = per_expert(module)
    r = manifest.module_rank(info.name, None if one else lora_parameter(module, names))
    if one is not None:
        expert, name = one
        if expert >= count:
            return (f"tensor {info.name} adapts expert {expert}, but the base model has {count} "
                    f"experts per layer")
        fan_in, fan_out = experts.projection(name)
        expected = (r, fan_in) if ab == "A" else (fan_out, r)
        what = f"layer {layer} expert {expert} {name}"
    else:
        name = names[module].split(".")[-1]
        fan_in, fan_out = experts.projection(name)
        expected = (count * r, fan_in) if ab == "A" else (fan_out, count * r)
        what = f"layer {layer} experts.{name}"
        rows = info.shape[0 if ab == "A" else -1] if info.shape else 0
        if tuple(info.shape) != expected and rows % r == 0 and rows != count * r:
            return (f"{what} lora_{ab} is {list(info.shape)}: {rows // r} experts of rank {r}, "
                    f"but the base model has {count} experts per layer")
    if tuple(info.shape) != expected:
        return (f"{what} lora_{ab} is {list(info.shape)}, but the base model needs "
                f"{list(expected)} (rank {r}; {name} maps {fan_in} -> {fan_out} features per "
                "expert)")
    return None


def vocab_misfit(manifest: AdapterManifest, vocab: int, hidden: int) -> str | None:
    """Why the vocabulary tensors of ``manifest`` (``adapter_format``: parse_vocab_key) do not
    fit a base of ``vocab`` token ids and ``hidden`` features: another vocabulary (an adapter
    trained with a resized embedding) is refused, new token ids must lie within ``vocab``."""
    if manifest.tokenizer_vocab > vocab:
        return vocab_refusal(manifest.tokenizer_vocab, vocab, "the base model")
    tokens = manifest.token_indices
    if tokens and max(tokens) >= vocab:
        return (f"its trainable token {max(tokens)} is beyond the base model's vocabulary of "
                f"{vocab} (an adapter whose tokenizer grew the vocabulary is not supported; "
                "train new tokens on ids the base model has)")
    for info in manifest.tensors:
        key = parse_vocab_key(info.name)
        if key is None:
            continue
        rank = manifest.module_rank(info.name)
        expected = vocab_shape(key.module, key.kind, rank, vocab, hidden, len(tokens))
        if tuple(info.shape) != expected:
            what = "rows" if key.kind == TOKENS else "shape"
            return (f"tensor {info.name} is {list(info.shape)}, but the base model needs "
                    f"{list(expected)} (vocabulary {vocab}, hidden size {hidden}: a mismatched "
                    f"vocabulary is not supported; {what} must match the base)")
    return None


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
    # a MoE base's routed experts; None: a dense base, or a worker that did not say (an expert
    # LoRA is then judged by the worker when it loads)
    experts: ExpertShape | None = None

    @property
    def known(self) -> bool:
        """False for a worker that did not say (an older one): nothing can be judged."""
        return self.num_layers > 0 and bool(self.modules)


def misfit(manifest: AdapterManifest, base: BaseShape) -> str | None:
    """Why ``manifest`` does not fit ``base`` (the first tensor that does not), or None when
    every tensor names a layer ``base`` has and a projection of its sizes."""
    names = expert_names(manifest, base.experts) if base.experts is not None else {}
    if manifest.tokenizer_vocab or any(parse_vocab_key(t.name) for t in manifest.tensors):
        if not all(m in base.modules for m in VOCAB_MODULES):
            return "it adapts embed_tokens or lm_head, which this worker does not serve"
        vocab, hidden = base.modules["embed_tokens"]
        reason = vocab_misfit(manifest, vocab, hidden)
        if reason is not None:
            return reason
    for info in manifest.tensors:
        if parse_vocab_key(info.name) is not None:
            continue
        key = parse_lora_key(info.name)
        if key is not None and (per_expert(key.module) or fused_depth(key.module) is not None):
            if base.experts is None:
                continue  # not judged here (see BaseShape.experts)
            reason = expert_misfit(manifest, info, key.module, key.layer, key.ab, base.experts,
                                   names)
            if reason is not None:
                return reason
            continue
        if key is None or key.module not in base.modules:
            module = key.module if key is not None else info.name
            return (f"tensor {info.name} targets {module}, which the base model does not adapt "
                    f"(it adapts {', '.join(base.modules)})")
        if key.layer >= base.num_layers:
            return (f"it adapts layer {key.layer}, but the base model has {base.num_layers} "
                    "layers")
        fan_in, fan_out = base.modules[key.module]
        rank = manifest.module_rank(info.name, lora_parameter(key.module, names))
        expected = expected_shape(key.ab, rank, fan_in, fan_out)
        if tuple(info.shape) != expected:
            return (f"layer {key.layer} {key.module} {tensor_kind(key.ab)} is "
                    f"{list(info.shape)}, but the base model needs {list(expected)} "
                    f"({key.module} maps {fan_in} -> {fan_out} features)")
    return None
