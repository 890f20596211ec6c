"""Tiny GGUF files for tests: a random-weight Llama whose tokenizer (and chat template) come from
the embedded SmolLM2 GGUF, written with gguf's own writer and quantizer."""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np

# the tiny model: hidden 64, 2 layers, 4 heads (2 kv heads) of 16, MLP 128; SmolLM2's vocabulary
TINY_GGUF = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
Q8_BLOCK = 32  # values per Q8_0 block


def write_tiny_llama_gguf(source: Path, out: Path, quant: str = "Q8_0", seed: int = 0) -> Path:
    """``out``: a GGUF file of a tiny random Llama, every matrix stored as ``quant`` (norms F32),
    with ``source``'s metadata (tokenizer, chat template) but the tiny model's dimensions.

    Each matrix row is scaled by its own random factor and so is each block of 32 values, so the
    Q8_0 blocks of a row carry different scales (as real files' do)."""
    import gguf

    h, layers, heads, kvh, inter = (TINY_GGUF[k] for k in
                                    ("hidden", "layers", "heads", "kv_heads", "intermediate"))
    head_dim = h // heads
    dims = {
        "llama.block_count": layers, "llama.embedding_length": h,
        "llama.feed_forward_length": inter, "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kvh, "llama.rope.dimension_count": head_dim,
    }
    qtype = gguf.GGMLQuantizationType[quant]
    reader = gguf.GGUFReader(source)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    writer = gguf.GGUFWriter(out, "llama")
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith(
                "GGUF."):
            continue  # the writer writes these itself; the file type was the source's (Q4_1)
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, dims.get(field.name, field.contents()), kind,
                             sub_type=sub)
    rng = np.random.default_rng(seed)

    def matrix(name: str, rows: int, cols: int) -> None:  # [rows, cols] as numpy (out, in)
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        w *= rng.uniform(0.3, 3.0, size=(rows, 1)).astype(np.float32)
        w *= np.repeat(rng.uniform(0.2, 1.0, size=(rows, cols // Q8_BLOCK)), Q8_BLOCK,
                       axis=1).astype(np.float32)
        if quant in ("F32", "F16"):
            writer.add_tensor(name, w.astype(np.float32 if quant == "F32" else np.float16))
            return
        data = gguf.quants.quantize(w, qtype)  # [rows, bytes per row] uint8
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))

    matrix("token_embd.weight", vocab, h)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", h, h)
        matrix(f"blk.{i}.attn_k.weight", kvh * head_dim, h)
        matrix(f"blk.{i}.attn_v.weight", kvh * head_dim, h)
        matrix(f"blk.{i}.attn_output.weight", h, h)
        matrix(f"blk.{i}.ffn_gate.weight", inter, h)
        matrix(f"blk.{i}.ffn_up.weight", inter, h)
        matrix(f"blk.{i}.ffn_down.weight", h, inter)
    norm("output_norm.weight")  # no output.weight: the lm_head is tied to token_embd
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@lru_cache(maxsize=4)
def _reader(path: Path) -> object:  # parsing the tokenizer's arrays takes seconds: once per file
    import gguf

    return gguf.GGUFReader(path)


def gguf_matrix(path: Path, name: str) -> np.ndarray:
    """The dequantized values of tensor ``name`` of ``path``, [rows, cols] fp32."""
    import gguf

    tensor = next(t for t in _reader(path).tensors if t.name == name)  # type: ignore[attr-defined]  # gguf's reader tensors are untyped
    return np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


class CopyConverter:
    """A GGUF converter that copies a tiny checkpoint instead of dequantizing, and records the
    GGUF bytes it was given (the embedded models' tests check what was assembled)."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.ggufs: list[bytes] = []

    def __call__(self, gguf: Path, out_dir: Path) -> None:
        self.ggufs.append(gguf.read_bytes())
        for path in self.source.iterdir():
            shutil.copy(path, out_dir)


def cache_entries(cache: Path) -> list[str]:
    """What a model cache holds besides its lock files."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


# GGUF architecture of each MoE family llama.cpp writes (Mixtral is a "llama" with experts).
MOE_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "qwen2_moe": "qwen2moe"}


def write_moe_gguf(checkpoint: Path, source: Path, out: Path, per_expert: bool = False) -> Path:
    """``out``: the HF MoE ``checkpoint`` (Qwen3-MoE, Mixtral or Qwen2-MoE, fp32) as llama.cpp
    writes it,
    F32 throughout, with ``source``'s tokenizer metadata (the checkpoint's vocabulary must be
    that size). Experts stacked (``blk.N.ffn_{gate,up,down}_exps``, ``[E, out, in]``), or with
    ``per_expert`` one tensor each (``blk.N.ffn_{gate,up,down}.E``, older Mixtral files). A
    "llama" file's q/k rows are permuted as llama.cpp's converter does."""
    import json

    import gguf
    import torch

    config = json.loads((checkpoint / "config.json").read_text())
    family = config["model_type"]
    arch = MOE_GGUF_ARCH[family]
    heads, kvh = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    experts = config.get("num_experts") or config["num_local_experts"]
    expert_width = config.get("moe_intermediate_size") or config["intermediate_size"]
    dims = {
        "block_count": config["num_hidden_layers"], "context_length":
        config["max_position_embeddings"], "embedding_length": config["hidden_size"],
        "feed_forward_length": config["intermediate_size"], "attention.head_count": heads,
        "attention.head_count_kv": kvh,
        "rope.freq_base": float(config.get("rope_theta")
                                or config["rope_parameters"]["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        "expert_count": experts, "expert_used_count": config["num_experts_per_tok"],
        "expert_feed_forward_length": expert_width, "rope.dimension_count": head_dim,

        "attention.key_length": head_dim, "attention.value_length": head_dim,
    }
    if config.get("shared_expert_intermediate_size"):
        dims["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, value in dims.items():
        kind = (gguf.GGUFValueType.FLOAT32 if isinstance(value, float)
                else gguf.GGUFValueType.UINT32)
        writer.add_key_value(f"{arch}.{key}", value, kind)
    from transformers import AutoModelForCausalLM

    # transformers' own (fused) names and layout, whichever layout the files on disk have
    state = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()

    def permuted(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's q/k permutation
        if arch != "llama":
            return w
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(
            1, 2).reshape(w.shape)

    def add(name: str, tensor: object) -> None:
        writer.add_tensor(name, np.ascontiguousarray(np.asarray(tensor, dtype=np.float32)))

    add("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        add(f"blk.{i}.attn_norm.weight", state[f"{layer}.input_layernorm.weight"].numpy())
        add(f"blk.{i}.ffn_norm.weight", state[f"{layer}.post_attention_layernorm.weight"].numpy())
        add(f"blk.{i}.attn_q.weight",
            permuted(state[f"{layer}.self_attn.q_proj.weight"].numpy(), heads))
        add(f"blk.{i}.attn_k.weight",
            permuted(state[f"{layer}.self_attn.k_proj.weight"].numpy(), kvh))
        add(f"blk.{i}.attn_v.weight", state[f"{layer}.self_attn.v_proj.weight"].numpy())
        add(f"blk.{i}.attn_output.weight", state[f"{layer}.self_attn.o_proj.weight"].numpy())
        for norm in ("q_norm", "k_norm"):
            if f"{layer}.self_attn.{norm}.weight" in state:
                add(f"blk.{i}.attn_{norm}.weight",
                    state[f"{layer}.self_attn.{norm}.weight"].numpy())
        for proj, short in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            if f"{layer}.self_attn.{proj}.bias" in state:  # Qwen2-MoE
                add(f"blk.{i}.attn_{short}.bias", state[f"{layer}.self_attn.{proj}.bias"].numpy())
        add(f"blk.{i}.ffn_gate_inp.weight", state[f"{layer}.mlp.gate.weight"].numpy())
        if f"{layer}.mlp.shared_expert_gate.weight" in state:  # Qwen2-MoE's shared expert
            for proj in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{proj}_shexp.weight",
                    state[f"{layer}.mlp.shared_expert.{proj}_proj.weight"].numpy())
            add(f"blk.{i}.ffn_gate_inp_shexp.weight",  # [H]: llama.cpp drops the leading 1
                state[f"{layer}.mlp.shared_expert_gate.weight"].numpy()[0])
        gate_up = state[f"{layer}.mlp.experts.gate_up_proj"].numpy()  # [E, 2 I, H]
        stacked = {"gate": gate_up[:, :expert_width], "up": gate_up[:, expert_width:],
                   "down": state[f"{layer}.mlp.experts.down_proj"].numpy()}  # down [E, H, I]
        for proj, weights in stacked.items():
            if per_expert:
                for e in range(experts):
                    add(f"blk.{i}.ffn_{proj}.{e}.weight", weights[e])
            else:
                add(f"blk.{i}.ffn_{proj}_exps.weight", weights)
    add("output_norm.weight", state["model.norm.weight"].numpy())
    if not config.get("tie_word_embeddings"):  # tied: llama.cpp writes no output.weight
        add("output.weight", state["lm_head.weight"].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
