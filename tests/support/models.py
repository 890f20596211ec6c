"""Tiny random Llama checkpoints and PEFT adapters made by the tests (no hub downloads)."""

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
) -> Path:
    """Save a PEFT LoRA adapter for the checkpoint at ``base_dir`` with a random, non-zero B.

    PEFT initialises B to zero, which would make every adapter equal the base model and prove
    nothing, so B is re-drawn with ``b_std``.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora, lora_dropout=0.0
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, b_std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def save_tiny_tokenizer(out_dir: Path, vocab_size: int = TINY_LLAMA["vocab_size"]) -> Path:
    """A character-level tokenizer of ``vocab_size`` ids for the tiny model, with a chat template.

    Ids 0-2 are <unk>, <s>, </s> (the Llama defaults, so eos is 2); then printable ASCII; the
    rest are filler tokens, so every id the model can emit decodes to something.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(out_dir)
    return out_dir


def make_tiny_checkpoint(out_dir: Path, seed: int = 0, **overrides: object) -> Path:
    """A complete tiny HF checkpoint: weights, config.json and a tokenizer."""
    make_tiny_llama(out_dir, seed=seed, **overrides)
    vocab = int(overrides.get("vocab_size", TINY_LLAMA["vocab_size"]))  # type: ignore[arg-type]
    return save_tiny_tokenizer(out_dir, vocab)
