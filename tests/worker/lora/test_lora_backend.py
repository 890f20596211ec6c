"""The torch LoRA backend against the fp32 SGMV reference, over the popularities that matter;
with ``native`` (``--cpu-kernels``) its slot-major steps whose rows are the layout run the C++
``lora_rows`` (lorastream/kernels/cpu/lora.py), held to the same reference and to the bmm path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lorastream.kernels.cpu import ops as cpu_ops
from lorastream.kernels.reference import sgmv_expand_ref, sgmv_shrink_ref
from lorastream.kernels.workloads import segment_lengths
from lorastream.worker.lora.backend import LoraStep, TorchLoraBackend
from lorastream.worker.lora.slots import LoraSlots, SlotInfo
from lorastream.worker.model.config import ModelConfig

RANKS = [4, 8, 16, 64, 8, 4, 16, 8]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def native_kernels() -> None:
    """The C++ CPU ops build here (a C++ compiler and ninja are part of `make install`)."""
    assert cpu_ops.load() is None, cpu_ops.load()


def _config(hidden: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=hidden // 2, rms_norm_eps=1e-5,
        max_position_embeddings=64, tie_word_embeddings=False, rope_theta=1e4,
    )


def _slots(config: ModelConfig, seed: int) -> LoraSlots:
    gen = torch.Generator().manual_seed(seed)
    slots = LoraSlots(config, len(RANKS), 64, torch.float32, torch.device("cpu"))
    for s, rank in enumerate(RANKS):
        for module in ("q_proj", "down_proj"):
            a, b = slots.a[module][0, s, :rank], slots.b[module][0, s, :, :rank]
            a.copy_(0.1 * torch.randn(a.shape, generator=gen))  # [r, in]
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))  # [out, r]
        slots.table[s] = SlotInfo(f"id{s}", rank, 0.5 + s, frozenset({"q_proj", "down_proj"}))
    return slots


def _token_slots(popularity: str, tokens: int, base_rows: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths = segment_lengths(tokens, popularity)[: len(RANKS)]
    slot_ids = torch.randperm(len(RANKS), generator=gen)[: len(lengths)].tolist()
    rows = [s for s, n in zip(slot_ids, lengths, strict=True) for _ in range(n)] + [-1] * base_rows
    return [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]


@pytest.mark.parametrize("hidden", [64, 50], ids=["aligned", "unaligned"])
@pytest.mark.parametrize(
    ("popularity", "tokens", "base_rows", "layout"),
    [
        ("distinct", 8, 0, "slot-major"),
        ("distinct", 5, 3, "slot-major"),
        ("uniform", 16, 2, "slot-major"),
        ("zipf", 24, 0, "grouped"),
        ("skewed", 40, 4, "grouped"),
        ("identical", 33, 0, "slot-major"),
    ],
)
def test_backend_matches_the_sgmv_reference_in_both_layouts(
    hidden: int, popularity: str, tokens: int, base_rows: int, layout: str
) -> None:
    config = _config(hidden)
    slots = _slots(config, seed=tokens)
    token_slots = _token_slots(popularity, tokens, base_rows, seed=tokens + 1)
    backend = TorchLoraBackend(torch.float32, torch.device("cpu"))
    meta = backend.prepare(token_slots, slots)
    assert meta is not None and meta.slot_major == (layout == "slot-major")
    for module in ("q_proj", "down_proj"):
        fan_in, fan_out = config.module_shapes()[module]
        x = torch.randn(len(token_slots), fan_in)
        out = torch.randn(len(token_slots), fan_out + 8)
        expected = out.clone()
        backend.add(x, slots.a[module][0], slots.b[module][0], out, 8, meta)
        t_slots = torch.tensor(token_slots, dtype=torch.int32)
        ranks = torch.tensor([info.rank for info in slots.table], dtype=torch.int32)
        scalings = torch.tensor([info.scaling for info in slots.table])
        h = sgmv_shrink_ref(x, slots.a[module][0], t_slots, ranks)
        sgmv_expand_ref(h, slots.b[module][0], t_slots, ranks, scalings, expected, slice_offset=8)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("token_slots", "lo", "span"),
    [([5] * 9, 5, 1), ([3, 4, 3, -1, 4, 4], 3, 2), ([3, -1, 3, 3], 3, 1), ([0, 2, 2], 0, 3)],
    ids=["one-high-slot", "range-3-4", "rank-64-slot", "from-zero"],
)
@pytest.mark.parametrize("native", [False, True], ids=["bmm", "native"])
def test_slot_major_reads_only_the_range_of_slots_in_use(
    token_slots: list[int], lo: int, span: int, native: bool
) -> None:
    """A prefill of one adapter in slot 5 is one bmm over slot 5, not slots 0-5 (padding) or
    grouped_mm; the delta still matches the reference, through the fused shrink too."""
    config = _config(64)
    slots = _slots(config, seed=7)
    gen = torch.Generator().manual_seed(8)
    for s, rank in enumerate(RANKS):  # k and v adapted too, so the fused shrink is exercised
        for module in ("k_proj", "v_proj"):
            slots.a[module][0, s, :rank].normal_(0, 0.1, generator=gen)
            slots.b[module][0, s, :, :rank].normal_(0, 0.1, generator=gen)
    backend = TorchLoraBackend(torch.float32, CPU, native)
    meta = backend.prepare(token_slots, slots)
    assert meta is not None and meta.slot_major
    assert (meta.slot_lo, meta.slot_range) == (lo, span)
    t_slots = torch.tensor(token_slots, dtype=torch.int32)
    ranks = torch.tensor([info.rank for info in slots.table], dtype=torch.int32)
    scalings = torch.tensor([info.scaling for info in slots.table])
    x = torch.randn(len(token_slots), 64)
    expected = {}
    for module in ("q_proj", "k_proj", "v_proj"):
        h = sgmv_shrink_ref(x, slots.a[module][0], t_slots, ranks)
        width = config.module_shapes()[module][1]
        expected[module] = sgmv_expand_ref(
            h, slots.b[module][0], t_slots, ranks, scalings, torch.zeros(len(token_slots), width)
        )
        out = torch.zeros_like(expected[module])
        backend.add(x, slots.a[module][0], slots.b[module][0], out, 0, meta)
        torch.testing.assert_close(out, expected[module], rtol=1e-5, atol=1e-5)
    qkv = ("q_proj", "k_proj", "v_proj")
    fused = torch.zeros(len(token_slots), 128)
    took = backend.add_group(x, slots.a_groups[qkv][0], [slots.b[m][0] for m in qkv], fused,
                             [0, 64, 96], meta)
    # the bmm path shrinks in one matmul only at the storage rank; lora_rows at any rank
    assert took == (meta.max_rank == slots.storage_rank or (native and meta.rows_are_layout))
    if took:
        torch.testing.assert_close(fused, torch.cat([expected[m] for m in qkv], 1),
                                   rtol=1e-5, atol=1e-5)


def test_no_adapter_rows_means_no_metadata() -> None:
    slots = _slots(_config(64), seed=0)
    assert TorchLoraBackend(torch.float32, torch.device("cpu")).prepare([-1, -1], slots) is None


@pytest.mark.parametrize(
    ("token_slots", "identity"),
    [([0, 1, 2, 3], True), ([0, 0, 1, 1], True), ([1, 0, 2, 3], False), ([0, 1, -1], False)],
)
@pytest.mark.parametrize("native", [False, True], ids=["bmm", "native"])
def test_rows_already_in_slot_order_skip_the_gathers_and_match_the_reference(
    token_slots: list[int], identity: bool, native: bool
) -> None:
    config = _config(64)
    slots = _slots(config, seed=3)
    meta = TorchLoraBackend(torch.float32, CPU).prepare(token_slots, slots)
    assert meta is not None and (meta.layout_rows is None) == identity
    assert meta.rows_are_layout == identity
    x = torch.randn(len(token_slots), 64)
    out = torch.zeros(len(token_slots), 64)
    TorchLoraBackend(torch.float32, CPU, native).add(
        x, slots.a["q_proj"][0], slots.b["q_proj"][0], out, 0, meta
    )
    t_slots = torch.tensor(token_slots, dtype=torch.int32)
    ranks = torch.tensor([info.rank for info in slots.table], dtype=torch.int32)
    scalings = torch.tensor([info.scaling for info in slots.table])
    expected = sgmv_expand_ref(
        sgmv_shrink_ref(x, slots.a["q_proj"][0], t_slots, ranks), slots.b["q_proj"][0], t_slots,
        ranks, scalings, torch.zeros_like(out),
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_an_adapter_reaches_its_slot_in_one_copy_per_module_and_matrix(
    tiny_adapters: dict[str, Path],
) -> None:
    from lorastream.worker.device.device import Device
    from lorastream.worker.loading.fetch import AdapterFetcher

    buffer = AdapterFetcher(Device("cpu"), None).read_local("all", tiny_adapters["all-r64"])
    groups = buffer.groups()
    assert len(groups) == 14  # 7 modules x (A, B), each spanning both layers
    views = buffer.tensors()
    for module, ab, first, block in groups:
        assert first == 0 and block.shape[0] == 2
        for layer in range(2):
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{group}.{module}.lora_{ab}.weight"
            assert torch.equal(block[layer], views[name])


@pytest.mark.parametrize(
    ("ranks", "fused"),
    [([8, 8, 8], True), ([8, 4, 8], True), ([4, 4, 4], False)],
    ids=["full-rank", "mixed-ranks", "ranks-below-storage"],
)
def test_projections_of_one_input_share_one_shrink_and_match_one_by_one(
    ranks: list[int], fused: bool
) -> None:
    config = _config(32)
    gen = torch.Generator().manual_seed(3)
    slots = LoraSlots(config, len(ranks), 8, torch.float32, torch.device("cpu"))
    qkv = ("q_proj", "k_proj", "v_proj")
    for s, rank in enumerate(ranks):
        for module in qkv:
            slots.a[module][0, s, :rank].normal_(0, 0.1, generator=gen)
            slots.b[module][0, s, :, :rank].normal_(0, 0.1, generator=gen)
        slots.table[s] = SlotInfo(f"id{s}", rank, 0.5 + s, frozenset(qkv))
    # a[m] are views of the group's storage: writing them filled the fused tensor
    assert slots.a["k_proj"].data_ptr() == slots.a_groups[qkv][:, :, 8:].data_ptr()
    backend = TorchLoraBackend(torch.float32, torch.device("cpu"))
    token_slots = [0, 1, 2, -1]  # decode-like: one row per slot, and a base-model row
    meta = backend.prepare(token_slots, slots)
    assert meta is not None and meta.slot_major
    x = torch.randn(4, 32, generator=gen)
    widths = [config.module_shapes()[m][1] for m in qkv]
    cols = (0, widths[0], widths[0] + widths[1])
    before = torch.randn(4, sum(widths), generator=gen)
    one_by_one, grouped = before.clone(), before.clone()
    step = LoraStep(slots, backend, meta)
    for module, col in zip(qkv, cols, strict=True):
        step.add(0, module, x, one_by_one, col)
    b_rows = [slots.b[m][0] for m in qkv]
    took = backend.add_group(x, slots.a_groups[qkv][0], b_rows, grouped.clone(), list(cols), meta)
    assert took is fused
    step.add_group(0, qkv, x, grouped, cols)
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-6)
    assert torch.equal(grouped[3], before[3])  # the base-model row gets no delta
    assert not torch.allclose(grouped[:3], before[:3])  # the adapter rows do


@pytest.mark.parametrize(
    ("popularity", "tokens", "base_rows", "layout"),
    [("distinct", 5, 3, "slot-major"), ("skewed", 40, 4, "grouped")],
)
def test_phi3s_fused_targets_get_one_delta_over_the_whole_fused_output(
    popularity: str, tokens: int, base_rows: int, layout: str
) -> None:
    """Phi-3 adapts qkv_proj [H -> q + 2 kv] and gate_up_proj [H -> 2 I] as single modules."""
    config = dataclasses.replace(
        _config(64), qkv_modules=("qkv_proj",), gate_up_modules=("gate_up_proj",)
    )
    shapes = config.module_shapes()
    assert shapes == {"qkv_proj": (64, 128), "o_proj": (64, 64), "gate_up_proj": (64, 256),
                      "down_proj": (128, 64)}
    assert config.shared_input_groups() == ()
    gen = torch.Generator().manual_seed(5)
    slots = LoraSlots(config, len(RANKS), 64, torch.float32, torch.device("cpu"))
    fused = frozenset({"qkv_proj", "gate_up_proj"})
    for s, rank in enumerate(RANKS):
        for module in fused:
            slots.a[module][0, s, :rank].normal_(0, 0.1, generator=gen)
            slots.b[module][0, s, :, :rank].normal_(0, 0.1, generator=gen)
        slots.table[s] = SlotInfo(f"id{s}", rank, 0.5 + s, fused)
    token_slots = _token_slots(popularity, tokens, base_rows, seed=tokens)
    backend = TorchLoraBackend(torch.float32, torch.device("cpu"))
    meta = backend.prepare(token_slots, slots)
    assert meta is not None and meta.slot_major == (layout == "slot-major")
    t_slots = torch.tensor(token_slots, dtype=torch.int32)
    ranks = torch.tensor([info.rank for info in slots.table], dtype=torch.int32)
    scalings = torch.tensor([info.scaling for info in slots.table])
    for module in sorted(fused):
        fan_in, fan_out = shapes[module]
        x = torch.randn(len(token_slots), fan_in, generator=gen)
        out = torch.zeros(len(token_slots), fan_out)
        LoraStep(slots, backend, meta).add(0, module, x, out, 0)
        h = sgmv_shrink_ref(x, slots.a[module][0], t_slots, ranks)
        expected = sgmv_expand_ref(
            h, slots.b[module][0], t_slots, ranks, scalings, torch.zeros_like(out)
        )
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert out.abs().sum() > 0


@pytest.mark.parametrize("hidden", [64, 50], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("ranks", [[8, 8, 8, 8], [8, 2, 5, 8], [3, 1, 2, 3]],
                         ids=["storage-rank", "mixed-ranks", "below-storage"])
@pytest.mark.parametrize(("slot_lo", "per_slot"), [(0, 1), (2, 1), (1, 2)],
                         ids=["from-zero", "from-slot-2", "two-rows-per-slot"])
def test_lora_rows_matches_the_bmm_path_and_the_reference_in_groups_and_alone(
    hidden: int, ranks: list[int], slot_lo: int, per_slot: int
) -> None:
    """Decode steps as the step builder lays them out (rows by slot): the fused q/k/v group, the
    gate/up group and a projection alone, through the native op and through the bmm path."""
    config = _config(hidden)
    gen = torch.Generator().manual_seed(hidden + slot_lo)
    slots = LoraSlots(config, len(ranks) + slot_lo, 8, torch.float32, CPU)
    modules = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")
    for s, rank in enumerate(ranks, start=slot_lo):
        for module in modules:
            slots.a[module][0, s, :rank].normal_(0, 0.1, generator=gen)
            slots.b[module][0, s, :, :rank].normal_(0, 0.1, generator=gen)
        slots.table[s] = SlotInfo(f"id{s}", rank, 0.5 + s, frozenset(modules))
    token_slots = [s for s in range(slot_lo, slot_lo + len(ranks)) for _ in range(per_slot)]
    native, bmm = TorchLoraBackend(torch.float32, CPU, True), TorchLoraBackend(torch.float32, CPU)
    meta = native.prepare(token_slots, slots)
    assert meta is not None and meta.rows_are_layout and meta.per_slot == per_slot
    t_slots = torch.tensor(token_slots, dtype=torch.int32)
    all_ranks = torch.tensor([info.rank for info in slots.table], dtype=torch.int32)
    scalings = torch.tensor([info.scaling for info in slots.table])
    rows = len(token_slots)
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",)):
        fan_in = config.module_shapes()[group[0]][0]
        widths = [config.module_shapes()[m][1] for m in group]
        cols = [3 + sum(widths[:i]) for i in range(len(group))]  # after 3 columns of another
        x = torch.randn(rows, fan_in, generator=gen)
        before = torch.randn(rows, 3 + sum(widths), generator=gen)
        expected = before.clone()
        for module, col in zip(group, cols, strict=True):
            h = sgmv_shrink_ref(x, slots.a[module][0], t_slots, all_ranks)
            sgmv_expand_ref(h, slots.b[module][0], t_slots, all_ranks, scalings, expected,
                            slice_offset=col)
        for backend in (native, bmm):
            out = before.clone()
            step = LoraStep(slots, backend, meta)
            if len(group) == 1:
                step.add(0, group[0], x, out, cols[0])
            else:
                step.add_group(0, group, x, out, tuple(cols))
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(out[:, :3], before[:, :3])  # other columns untouched


# storage ranks: one 8-lane chunk, a partial second one, whole chunks; the rank used below it;
# output widths: whole groups of 8 rows, a tail, fewer than 8; inputs: 4 chains of 8 and tails
@pytest.mark.parametrize(("r_slot", "rank"), [(8, 8), (12, 12), (12, 5), (16, 16), (20, 9)])
@pytest.mark.parametrize(("k_in", "widths"), [(64, [16, 8]), (70, [19, 5]), (7, [3])])
def test_lora_rows_is_the_fp64_delta_at_any_rank_and_width(
    r_slot: int, rank: int, k_in: int, widths: list[int]
) -> None:
    """The op's chunked shrink and 8-row expand against the module docstring's formula in fp64,
    with the lanes past the rank (another group's h, past b's row) never entering a sum."""
    from lorastream.kernels.cpu.lora import lora_rows

    gen = torch.Generator().manual_seed(r_slot * 100 + k_in + rank)
    slots, rows, group = 3, 5, len(widths)
    a = torch.randn(slots, group * r_slot, k_in, generator=gen)  # [S, G*R, K]
    bs = [torch.randn(slots, n, r_slot, generator=gen) for n in widths]  # G x [S, N_g, R]
    x = torch.randn(rows, k_in, generator=gen)
    scale = torch.tensor([0.5, 0.0, 2.0, 1.0, 0.25])  # row 1: a base-model row
    cols = [2 + sum(widths[:g]) for g in range(group)]
    out = torch.randn(rows, 4 + sum(widths), generator=gen)
    expected = out.double().clone()
    slot_lo, per_slot = 1, 3  # rows 0-2 on slot 1, rows 3-4 on slot 2
    for t in range(rows):
        slot = slot_lo + t // per_slot
        for g, b in enumerate(bs):
            h = a[slot, g * r_slot : g * r_slot + rank].double() @ x[t].double()  # [rank]
            delta = b[slot, :, :rank].double() @ h  # [N_g]
            expected[t, cols[g] : cols[g] + widths[g]] += scale[t].double() * delta
    before = out.clone()
    lora_rows(x, a, bs, cols, scale, slot_lo, per_slot, rank, out)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], before[1])  # the base-model row as it was


def test_lora_rows_refuses_columns_outside_the_output() -> None:
    """A B that does not fit where it is added is an error, never a write past the row."""
    from lorastream.kernels.cpu.lora import lora_rows

    a, b = torch.randn(2, 4, 16), torch.randn(2, 8, 4)
    with pytest.raises(RuntimeError, match=r"columns 4..12 outside out"):
        lora_rows(torch.randn(2, 16), a, [b], [4], torch.ones(2), 0, 1, 4, torch.zeros(2, 10))
