"""Tiny random checkpoints (Llama, and every other supported family) and PEFT adapters made by
the tests (no hub downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

# Small but structurally complete: GQA (4 heads, 2 KV heads), two layers, tied embeddings off.
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

# The invocation sequence of the tests' activated LoRAs (PEFT's alora_invocation_tokens).
ALORA_INVOCATION = [17, 44, 45]

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL_LINEAR = ATTENTION + MLP


def make_tiny_llama(out_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """Save a random LlamaForCausalLM (fp32 safetensors + config.json) to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(config).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] | str = "all-linear",
    use_rslora: bool = False,
    seed: int = 1,
    b_std: float = 0.05,
    use_dora: bool = False,
    alora_invocation_tokens: list[int] | None = None,
) -> Path:
    """Save a PEFT LoRA adapter for the checkpoint at ``base_dir`` with a random, non-zero B.

    PEFT initialises B to zero, which would make every adapter equal the base model and prove
    nothing, so B is re-drawn with ``b_std`` (and ``use_dora``'s magnitudes within 30%).
    ``alora_invocation_tokens``: an activated LoRA (PEFT's aLoRA) invoked by those tokens.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0,
        use_dora=use_dora, alora_invocation_tokens=alora_invocation_tokens,
        task_type="CAUSAL_LM" if alora_invocation_tokens else None,
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
            elif "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.3 * (2 * torch.rand_like(param) - 1))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def save_tiny_tokenizer(
    out_dir: Path, vocab_size: int = TINY_LLAMA["vocab_size"], newline: bool = False,
    chat_template: str | None = None,
) -> Path:
    """A character-level tokenizer of ``vocab_size`` ids for the tiny model, with a chat template.

    Ids 0-2 are <unk>, <s>, </s> (the Llama defaults, so eos is 2); then printable ASCII (and
    "\n" with ``newline``); the rest are filler tokens, so every id the model can emit decodes to
    something. ``chat_template`` replaces the default one.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    if newline:
        vocab["\n"] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n" if newline else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = chat_template or (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return out_dir


def make_tiny_checkpoint(out_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """A complete tiny HF checkpoint: weights, config.json and a tokenizer."""
    make_tiny_llama(out_dir, seed=seed, **overrides)
    vocab = int(overrides.get("vocab_size", TINY_LLAMA["vocab_size"]))
    return save_tiny_tokenizer(out_dir, vocab)


# -- other model families ----------------------------------------------------------------------
# Per family, a tiny config that switches on what the family changes: GQA (4 heads, 2 KV heads),
# a head_dim other than hidden / heads where the family allows it, a sliding window (6) shorter
# than the test prompts, soft-capping, biases, tied and untied embeddings.
WINDOW = 6
_FAMILY_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)
FAMILY_CONFIGS: dict[str, dict[str, object]] = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  tie_word_embeddings=True),
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "gemma2": dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                   attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                   tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                        layer_types=["sliding_attention", "full_attention"],
                        final_logit_softcapping=4.0, tie_word_embeddings=True),
    "phi3": dict(sliding_window=WINDOW, tie_word_embeddings=False),
}
# The PEFT target names of each family's attention and MLP projections.
FAMILY_TARGETS: dict[str, tuple[list[str], list[str]]] = {
    family: (ATTENTION, MLP) for family in FAMILY_CONFIGS
}
FAMILY_TARGETS["phi3"] = (["qkv_proj", "o_proj"], ["gate_up_proj", "down_proj"])

# Mixture-of-experts families: 4 experts, top-2, each with a sliding window in play and what the
# family routes differently (Qwen3-MoE: renormalised top-k and a dense layer; Qwen2-MoE: raw
# top-k probabilities and a shared expert; Mixtral: fp32 routing weights).
MOE_CONFIGS: dict[str, dict[str, object]] = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=32, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1],
                      use_sliding_window=True, sliding_window=WINDOW, tie_word_embeddings=False),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=WINDOW, tie_word_embeddings=False),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False,
                      use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
                      tie_word_embeddings=True),
}


def make_tiny_family(family: str, out_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """Save a random ``family`` CausalLM with a tokenizer (a complete checkpoint) to ``out_dir``.

    Norm weights and biases are randomised too (HF initialises them to 1 / 0, or 0 for Gemma's
    ``1 + w``), so a norm or bias applied wrongly, or not at all, changes the output; so are a
    MoE model's router and shared-expert gate, so that tokens spread over the experts.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    family_config = {**FAMILY_CONFIGS, **MOE_CONFIGS}[family]
    config = AutoConfig.for_model(family, **{**_FAMILY_BASE, **family_config, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.normal_(0.0, 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return save_tiny_tokenizer(out_dir, int(config.vocab_size))


def make_family_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    targets: list[str] | str,
    use_rslora: bool = False,
    seed: int = 1,
    b_std: float = 0.2,
    use_dora: bool = False,
    alora_invocation_tokens: list[int] | None = None,
    alpha: float | None = None,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
) -> Path:
    """A PEFT LoRA adapter (random, non-zero B) for a checkpoint of any family (``alpha``:
    2 ``rank`` unless given; ``rank_pattern`` / ``alpha_pattern``: PEFT's per-module ones,
    which PEFT adds to, as its "all-linear" on a MoE base does). ``use_dora``:
    a DoRA adapter whose magnitudes are drawn too (PEFT sets them to ||W|| while B is still
    zero), within 30% of that, so that every part of DoRA shows in the output.
    ``alora_invocation_tokens``: an activated LoRA (PEFT's aLoRA), a causal-LM task as PEFT
    wants for it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=targets,
        use_rslora=use_rslora, lora_dropout=0.0, use_dora=use_dora,
        alora_invocation_tokens=alora_invocation_tokens,
        task_type="CAUSAL_LM" if alora_invocation_tokens else None,
        rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {},
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
            elif "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.3 * (2 * torch.rand_like(param) - 1))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def split_experts(checkpoint: Path, out_dir: Path) -> Path:
    """A copy of the MoE ``checkpoint`` with its fused experts (``mlp.experts.gate_up_proj``
    [E, 2 I, H], ``mlp.experts.down_proj`` [E, H, I]) stored one by one, as older checkpoints
    do: ``mlp.experts.{e}.{gate,up,down}_proj.weight``, or Mixtral's
    ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (with ``block_sparse_moe.gate``)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out_dir)
    mixtral = json.loads((checkpoint / "config.json").read_text())["model_type"] == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    state = load_file(str(checkpoint / "model.safetensors"))
    split: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        prefix, _, name = key.rpartition(".experts.")
        if mixtral and ".mlp." in key:
            prefix = prefix.replace(".mlp", ".block_sparse_moe")
            key = key.replace(".mlp.", ".block_sparse_moe.")
        if name == "gate_up_proj":
            inter = tensor.shape[1] // 2
            for e, expert in enumerate(tensor):  # [2 I, H]
                split[f"{prefix}.experts.{e}.{gate}.weight"] = expert[:inter].clone()
                split[f"{prefix}.experts.{e}.{up}.weight"] = expert[inter:].clone()
        elif name == "down_proj":
            for e, expert in enumerate(tensor):  # [H, I]
                split[f"{prefix}.experts.{e}.{down}.weight"] = expert.clone()
        else:
            split[key] = tensor
    save_file(split, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def make_expert_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    targets: list[str],
    parameters: list[str],
    use_rslora: bool = False,
    seed: int = 1,
    b_std: float = 0.2,
) -> Path:
    """A PEFT LoRA on a MoE checkpoint's fused experts (``target_parameters``, as transformers
    5 trains it) and on ``targets``, with random non-zero B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, target_parameters=parameters,
        use_rslora=use_rslora, lora_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def per_expert_adapter(adapter: Path, out_dir: Path, mixtral: bool) -> Path:
    """The fused-parameter ``adapter`` (both expert parameters targeted) rewritten in the older
    per-expert form, the same LoRA: ``mlp.experts.{e}.{gate,up,down}_proj.lora_{A,B}.weight``
    (Mixtral: ``block_sparse_moe.experts.{e}.{w1,w3,w2}``). PEFT's fused A ``[E r, in]`` holds
    expert e in rows ``e r ..``; its B ``[out, E r]`` in columns ``j E + e``; gate and up share
    the fused A and split the fused B's rows."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank = int(config["r"])
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    config["target_parameters"] = None
    config["target_modules"] = sorted({*config["target_modules"], gate, up, down})
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    state = load_file(str(adapter / "adapter_model.safetensors"))
    split: dict[str, torch.Tensor] = {}
    block = "block_sparse_moe" if mixtral else "mlp"
    for key, tensor in state.items():
        if ".mlp.experts." not in key:
            split[key] = tensor
            continue
        prefix = key.split(".mlp.experts.")[0]
        param = "gate_up" if ".experts.base_layer." in key else "down"
        ab = "A" if ".lora_A." in key else "B"
        experts = (tensor.shape[0] if ab == "A" else tensor.shape[1]) // rank
        for e in range(experts):
            # A [r, in] in rows e r .., B [out, r] in columns j E + e
            part = tensor[e * rank : (e + 1) * rank] if ab == "A" else tensor[:, e::experts]
            names = [gate, up] if param == "gate_up" else [down]
            for index, name in enumerate(names):
                piece = part
                if ab == "B" and param == "gate_up":
                    inter = part.shape[0] // 2
                    piece = part[index * inter : (index + 1) * inter]
                split[f"{prefix}.{block}.experts.{e}.{name}.lora_{ab}.weight"] = (
                    piece.contiguous().clone())
    save_file(split, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.copy(adapter / "adapter_config.json", out_dir / "fused_adapter_config.json")
    return out_dir


def make_vocab_adapter(
    base_dir: Path, out_dir: Path, *, rank: int, seed: int, std: float = 0.3,
    save_embedding_layers: bool = False, **lora: object,
) -> Path:
    """A PEFT adapter of the vocabulary modules (``lora``: LoraConfig's ``target_modules`` with
    ``embed_tokens`` / ``lm_head``, ``trainable_token_indices``, ``modules_to_save``), every
    trained part drawn at random so that it matters: LoRA's B (and the embedding LoRA's A, which
    PEFT sets to zero), the new token rows, the saved modules (the base's plus noise).
    ``save_embedding_layers``: PEFT also saves the base ``embed_tokens`` / ``lm_head`` beside a
    LoRA on them (its default when that LoRA is there)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, **lora)  # type: ignore[arg-type]  # LoraConfig's own keywords
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:
                param.normal_(0.0, std)
            elif "trainable_tokens_delta" in name:
                param.normal_(0.0, 1.0)
            elif "modules_to_save" in name:
                param.add_(torch.randn_like(param) * std)
    model.save_pretrained(out_dir, safe_serialization=True,
                          save_embedding_layers=save_embedding_layers)
    return out_dir


def save_adapter_tokenizer(base_dir: Path, out_dir: Path, tokens: dict[int, str]) -> Path:
    """Beside an adapter in ``out_dir``, the tokenizer it was trained with: the base model's
    (``base_dir``) with reserved ids renamed to new added tokens (``tokens``: id -> text, not
    special, so they decode to their text), as a tokenizer grown onto rows the base has."""
    import json
    import shutil

    doc = json.loads((base_dir / "tokenizer.json").read_text())
    names = {i: t for t, i in doc["model"]["vocab"].items()}
    for token_id, text in tokens.items():
        del doc["model"]["vocab"][names[token_id]]
        doc["model"]["vocab"][text] = token_id
        doc["added_tokens"].append({"id": token_id, "content": text, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": False})
    (out_dir / "tokenizer.json").write_text(json.dumps(doc))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (base_dir / name).exists():
            shutil.copy(base_dir / name, out_dir / name)
    return out_dir
