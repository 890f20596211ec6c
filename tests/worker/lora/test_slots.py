"""Writing an adapter into a slot that held another one leaves exactly the new adapter: what the
new blocks do not cover (ranks beyond its own, modules and layers it leaves alone) is zero."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.slots import LoraSlots, SlotInfo
from lorastream.worker.model.config import ModelConfig

Blocks = list[tuple[int, str, str, torch.Tensor]]


def _blocks(tiny_model: Path, path: Path, first_layer_only: bool) -> tuple[int, float, Blocks]:
    config = ModelConfig.from_dir(tiny_model)
    buffer = AdapterFetcher(Device("cpu"), None).read_local(path.name, path)
    w = adapter_weights(buffer, config, 64)
    blocks = list(w.blocks)
    if first_layer_only:  # as an adapter trained with layers_to_transform=[0] would be
        blocks = [(layer, m, ab, block[:1]) for layer, m, ab, block in blocks if layer == 0]
    return w.rank, w.scaling, blocks


@pytest.mark.parametrize(
    ("old", "new", "first_layer_only"),
    [
        ("all-r64", "attn-r4", False),  # lower rank, fewer modules
        ("all-r64", "mlp-r8", False),
        ("attn-r4", "all-r64", False),  # the whole slot overwritten
        ("all-r64", "all-r16-rslora", True),  # some layers left alone
    ],
)
def test_a_reused_slot_holds_only_the_new_adapter(
    tiny_model: Path, tiny_adapters: dict[str, Path], old: str, new: str, first_layer_only: bool
) -> None:
    config = ModelConfig.from_dir(tiny_model)
    reused = LoraSlots(config, 3, 64, torch.float32, torch.device("cpu"))
    fresh = LoraSlots(config, 3, 64, torch.float32, torch.device("cpu"))
    for slots in (reused, fresh):  # a neighbour slot that must stay as it is
        slots.write(2, "n", *_blocks(tiny_model, tiny_adapters["mlp-r8"], False))
    reused.write(1, "old", *_blocks(tiny_model, tiny_adapters[old], False))
    rank, scaling, blocks = _blocks(tiny_model, tiny_adapters[new], first_layer_only)
    reused.write(1, "new", rank, scaling, blocks)
    fresh.write(1, "new", rank, scaling, blocks)
    for module in reused.a:
        assert torch.equal(reused.a[module], fresh.a[module]), module
        assert torch.equal(reused.b[module], fresh.b[module]), module
    assert reused.table[1] == fresh.table[1] and reused.table[1].rank == rank
    assert any(reused.a[m][:, 1].abs().sum() > 0 for m in reused.a)  # the new one is there


@pytest.mark.parametrize(
    ("old", "new", "first_layer_only"),
    [
        ("all-r64", "attn-r4", False),
        ("attn-r4", "all-r64", False),
        ("all-r64", "all-r16-rslora", True),
    ],
)
def test_layer_by_layer_writes_finish_each_layer_in_turn(
    tiny_model: Path, tiny_adapters: dict[str, Path], old: str, new: str, first_layer_only: bool
) -> None:
    """The copy plan run layer by layer (layer-ordered admission): the record first; after
    ``layers(l, l + 1)`` layers ``0 .. l`` of the slot are what a whole write leaves and later
    layers still hold the old adapter; at the end the slot is the whole write's, its neighbour
    untouched."""
    config = ModelConfig.from_dir(tiny_model)
    layered = LoraSlots(config, 3, 64, torch.float32, torch.device("cpu"))
    whole = LoraSlots(config, 3, 64, torch.float32, torch.device("cpu"))
    for slots in (layered, whole):
        slots.write(2, "n", *_blocks(tiny_model, tiny_adapters["mlp-r8"], False))
        slots.write(1, "old", *_blocks(tiny_model, tiny_adapters[old], False))
    before = {m: (layered.a[m].clone(), layered.b[m].clone()) for m in layered.a}
    rank, scaling, blocks = _blocks(tiny_model, tiny_adapters[new], first_layer_only)
    whole.write(1, "new", rank, scaling, blocks)
    plan = layered.copy_plan(1, "new", rank, scaling, blocks)
    plan.record()
    assert layered.table[1] == whole.table[1] and layered.table[1].rank == rank
    for layer in range(config.num_layers):
        for op in plan.layers(layer, layer + 1):
            op()
        for m in layered.a:
            done, left = slice(0, layer + 1), slice(layer + 1, None)
            assert torch.equal(layered.a[m][done], whole.a[m][done]), (m, layer)
            assert torch.equal(layered.b[m][done], whole.b[m][done]), (m, layer)
            assert torch.equal(layered.a[m][left], before[m][0][left]), (m, layer)
            assert torch.equal(layered.b[m][left], before[m][1][left]), (m, layer)
    changed = False
    for m in layered.a:
        assert torch.equal(layered.a[m], whole.a[m]) and torch.equal(layered.b[m], whole.b[m])
        changed |= not torch.equal(layered.a[m][:, 1], before[m][0][:, 1])
    assert changed  # the new adapter differs from the old: the comparison proves something


@pytest.mark.parametrize(
    ("new", "first_layer_only", "spans"),
    [
        ("attn-r4", False, "each layer"),  # some modules, rank 4 of storage rank 64
        ("all-r16-rslora", True, "each layer"),  # layer 0 only
        ("attn-r4", True, "each layer"),  # both
        ("attn-r4", True, "uneven spans"),
        ("all-r64", False, "each layer"),  # the whole slot, at storage rank
    ],
)
def test_the_whole_copy_is_the_per_layer_plan_run_for_every_layer(
    tiny_model: Path, tiny_adapters: dict[str, Path], new: str, first_layer_only: bool,
    spans: str,
) -> None:
    """``write_ops`` (an adapter landed whole) and the record plus ``layers`` over spans that
    cover every layer (as layer-ordered admission runs them) leave the same slot contents and
    the same table record, over a slot that held another adapter."""
    config = ModelConfig.from_dir(tiny_model)
    layers = config.num_layers
    whole = LoraSlots(config, 3, 64, torch.float32, torch.device("cpu"))
    by_layer = LoraSlots(config, 3, 64, torch.float32, torch.device("cpu"))
    for slots in (whole, by_layer):
        slots.write(1, "old", *_blocks(tiny_model, tiny_adapters["all-r64"], False))
    rank, scaling, blocks = _blocks(tiny_model, tiny_adapters[new], first_layer_only)
    for op in whole.write_ops(1, "new", rank, scaling, blocks):
        op()
    plan = by_layer.copy_plan(1, "new", rank, scaling, blocks)
    cuts = list(range(layers + 1)) if spans == "each layer" else [0, 1, layers]
    plan.record()
    for first, stop in itertools.pairwise(cuts):
        for op in plan.layers(first, stop):
            op()
    assert by_layer.table[1] == whole.table[1]
    assert whole.table[1] == SlotInfo("new", rank, scaling, frozenset(m for _, m, _, _ in blocks))
    for m in whole.a:
        assert torch.equal(by_layer.a[m], whole.a[m]), m
        assert torch.equal(by_layer.b[m], whole.b[m]), m
    assert rank == 64 or all(whole.a[m][:, 1, rank:].abs().sum() == 0 for m in whole.a)
