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
