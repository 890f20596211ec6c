"""Paged attention against a dense reference: decode rows and prefill chunks (with and without a
cached past), GQA, sliding windows smaller and larger than the context, Gemma 2 soft-capping.

The reference is plain attention over each sequence's whole K/V in float64 with HF's masks
(key ``j`` visible from query ``p`` iff ``j <= p`` and ``p - j < window``). Cache blocks that lie
wholly before a sequence's window are filled with NaN, so a windowed layer that gathered one of
them would return NaN: the test proves that only the window is read.

Every case runs on both decode paths: torch's (gathered blocks, SDPA) and the native C++ kernel
(``lorastream/kernels/cpu/attention.py``, fp32 on the CPU), which must build here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from lorastream.kernels.cpu import attention as cpu_attention
from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.worker.model.attention import paged_attention, window_blocks, write_kv
from lorastream.worker.model.forward_batch import ForwardBatch, PrefillSpan
from lorastream.worker.model.kv_cache import BLOCK_SIZE
from tests.support.sync_free import no_device_reads

HEAD_DIM = 8


@dataclass(frozen=True)
class Seq:
    context: int  # cache length after this step
    new: int  # tokens fed this step (1 for a decode row)


# Decode rows at block boundaries (16, 17, 32, 33) and short ones; prefills as a whole prompt, as
# a chunk after an unaligned past, after a block-aligned past, and a short tail.
DECODES = [Seq(1, 1), Seq(16, 1), Seq(17, 1), Seq(33, 1), Seq(50, 1), Seq(64, 1)]
PREFILLS = [Seq(20, 20), Seq(40, 27), Seq(48, 16), Seq(34, 3), Seq(5, 5), Seq(18, 18)]


def dense_reference(
    q: torch.Tensor,  # [n, H, d] queries at positions context-n .. context-1
    k: torch.Tensor,  # [context, kvh, d]
    v: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:  # [n, H, d]
    n, heads, _ = q.shape
    context, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)  # [ctx, H, d]
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), k) * scale  # [H, n, ctx]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    p = torch.arange(context - n, context)[:, None]
    j = torch.arange(context)[None, :]
    visible = j <= p
    if window is not None:
        visible &= p - j < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), v)


def _first_needed_block(seq: Seq, window: int | None) -> int:
    """Blocks before this one hold no key any query of ``seq`` may see."""
    if window is None:
        return 0
    return max(0, seq.context - seq.new - window + 1) // BLOCK_SIZE


def run_case(
    decodes: list[Seq], prefills: list[Seq], heads: int, kv_heads: int,
    window: int | None, softcap: float | None, dtype: torch.dtype, seed: int = 0,
    native: bool = False, head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(paged attention, dense reference) of every row of one flat batch; the attention runs
    with device reads forbidden."""
    gen = torch.Generator().manual_seed(seed)
    seqs = decodes + prefills
    need = [-(-s.context // BLOCK_SIZE) for s in seqs]
    num_blocks = sum(need) + 3  # a few blocks no sequence owns
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-monotone tables
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    k_cache, v_cache = rand(*shape), rand(*shape)
    full_k = [rand(s.context, kv_heads, head_dim) for s in seqs]
    full_v = [rand(s.context, kv_heads, head_dim) for s in seqs]
    q_rows = [rand(s.new, heads, head_dim) * 2 for s in seqs]

    def slots(table: list[int], start: int, stop: int) -> list[int]:
        return [table[j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(start, stop)]

    # The past of every sequence is in the cache already; this step writes its new tokens.
    for seq, table, k, v in zip(seqs, tables, full_k, full_v, strict=True):
        past = seq.context - seq.new
        if past:
            write_kv(k_cache, v_cache, k[:past], v[:past], torch.tensor(slots(table, 0, past)))
    rows_q = torch.cat(q_rows)  # [T, H, d]
    k_new = torch.cat([k[s.context - s.new :] for s, k in zip(seqs, full_k, strict=True)])
    v_new = torch.cat([v[s.context - s.new :] for s, v in zip(seqs, full_v, strict=True)])
    slot_mapping = torch.tensor([
        x for s, t in zip(seqs, tables, strict=True) for x in slots(t, s.context - s.new, s.context)
    ])
    write_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
    # Poison what a windowed layer must not read: the blocks before each window, and the spare
    # blocks, one of which pads the decode tables (masked, but read, by a full-attention layer).
    spare = order[at:]
    poisoned = [] if window is None else spare.copy()
    for seq, table in zip(seqs, tables, strict=True):
        poisoned += table[: _first_needed_block(seq, window)]
    for block in poisoned:
        k_cache[block] = float("nan")
        v_cache[block] = float("nan")
    width = max((len(t) for t in tables[: len(decodes)]), default=0)
    spans, start = [], len(decodes)
    for seq, table in zip(prefills, tables[len(decodes) :], strict=True):
        spans.append(PrefillSpan(start, seq.new, seq.context, torch.tensor(table)))
        start += seq.new
    positions = torch.tensor([p for s in seqs for p in range(s.context - s.new, s.context)])
    batch = ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.long),
        positions=positions,
        seq_lens=positions + 1,
        slot_mapping=slot_mapping,
        num_decode=len(decodes),
        decode_block_tables=torch.tensor(
            [t + [spare[0]] * (width - len(t)) for t in tables[: len(decodes)]],
            dtype=torch.long,
        ).view(len(decodes), width),
        decode_context=torch.tensor([s.context for s in decodes], dtype=torch.long),
        prefills=tuple(spans),
    )
    scale = head_dim**-0.5
    with no_device_reads("in paged attention"):
        out = paged_attention(
            rows_q, k_cache, v_cache, k_new, v_new, batch, scale, window=window, softcap=softcap,
            native=native,
        )
    expected = torch.cat([
        dense_reference(q, k, v, scale, window, softcap)
        for q, k, v in zip(q_rows, full_k, full_v, strict=True)
    ])
    return out, expected


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# decode path, dtype: torch's in both dtypes, the native kernel in fp32 (all it runs)
PATHS = [(False, torch.float32), (False, torch.bfloat16), (True, torch.float32)]
PATH_IDS = ["fp32", "bf16", "native-fp32"]


@pytest.fixture(scope="module", autouse=True)
def native_kernel() -> None:
    """The native kernel builds here (a C++ compiler and ninja are part of `make install`)."""
    assert cpu_ops.load() is None, cpu_ops.load()


@pytest.mark.parametrize("native,dtype", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 20, 33, 4096])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_decode_rows_and_prefill_chunks_match_dense_attention(
    heads: int, kv_heads: int, window: int | None, softcap: float | None, dtype: torch.dtype,
    native: bool,
) -> None:
    out, expected = run_case(
        DECODES, PREFILLS, heads, kv_heads, window, softcap, dtype, native=native
    )
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.isfinite(out).all(), "a block outside the window was read"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize(
    "decodes,prefills", [(DECODES, []), ([], PREFILLS)], ids=["decode-only", "prefill-only"]
)
def test_a_batch_of_one_kind_of_row_matches_dense_attention(
    decodes: list[Seq], prefills: list[Seq], native: bool
) -> None:
    out, expected = run_case(decodes, prefills, 6, 2, 17, 3.0, torch.float32, seed=3,
                             native=native)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# The kernel's head sizes: 64 and 128 are compiled for, others take its general loop; the
# families' query groups (Llama 1-8, Qwen 7, Gemma 3 270M 4).
@pytest.mark.parametrize("head_dim", [8, 64, 80, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1), (14, 2)],
                         ids=["mha", "gqa3", "mqa", "gqa7"])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 50.0), (33, 3.0)],
                         ids=["plain", "window", "softcap", "window-softcap"])
def test_native_decode_kernel_matches_dense_attention_across_head_shapes(
    head_dim: int, heads: int, kv_heads: int, window: int | None, softcap: float | None
) -> None:
    out, expected = run_case(DECODES, [], heads, kv_heads, window, softcap, torch.float32,
                             seed=head_dim, native=True, head_dim=head_dim)
    assert torch.isfinite(out).all(), "a position outside the window was read"
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_native_decode_kernel_refuses_a_score_row_too_narrow_for_a_context() -> None:
    """A width that cannot hold a row's visible positions is an error naming the row, never a
    write past the buffer."""
    q = torch.randn(2, 4, 64)
    cache = torch.randn(4, BLOCK_SIZE, 2, 64)
    tables = torch.tensor([[0, 1], [2, 3]])
    context = torch.tensor([5, 20])
    with pytest.raises(RuntimeError, match="row 1 needs 20 score columns, width is 16"):
        cpu_attention.decode_attention(q, cache, cache, tables, context, 0.125, BLOCK_SIZE)


@pytest.mark.parametrize("window,changes", [(20, True), (64, False)])
def test_the_window_changes_the_output_only_when_it_is_shorter_than_the_context(
    window: int, changes: bool
) -> None:
    windowed, _ = run_case(DECODES, PREFILLS, 6, 2, window, None, torch.float32, seed=5)
    full, _ = run_case(DECODES, PREFILLS, 6, 2, None, None, torch.float32, seed=5)
    assert torch.allclose(windowed, full, atol=1e-6) is not changes


def test_softcap_changes_the_output() -> None:  # the option is not silently ignored
    capped, _ = run_case(DECODES, PREFILLS, 6, 2, None, 1.0, torch.float32, seed=7)
    plain, _ = run_case(DECODES, PREFILLS, 6, 2, None, None, torch.float32, seed=7)
    assert not torch.allclose(capped, plain, atol=1e-3)


@pytest.mark.parametrize("window", [1, 2, 15, 16, 17, 31, 32, 33, 100])
def test_window_blocks_is_the_most_blocks_any_window_touches(window: int) -> None:
    most = max(
        (p // BLOCK_SIZE) - (max(0, p - window + 1) // BLOCK_SIZE) + 1 for p in range(4 * 128)
    )
    assert window_blocks(window) == most
    assert most == math.ceil((window - 1) / BLOCK_SIZE) + 1
