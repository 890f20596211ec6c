"""A slot filled layer by layer as an adapter's layers land (``LayeredSlots.claim``): each
layer's copy goes on the load stream once that layer landed, a prefill may read the leading
layers whose copies completed, and the slot counts as ready (rule 1) only after the last.
Runs the CPU load stream for real."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lorastream.worker.device.device import Device, HostEvent
from lorastream.worker.loading.adapter import (
    AdapterEntry,
    AdapterWeights,
    Residency,
    adapter_weights,
)
from lorastream.worker.loading.device_tier import AdmissionCostModel, DeviceTier
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.loading.layered import LayeredSlots
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig
from tests.support.models import make_family_adapter

CPU = torch.device("cpu")


@pytest.fixture
def device() -> Iterator[Device]:
    device = Device("cpu")
    yield device
    device.close()


def _until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _adapter(device: Device, config: ModelConfig, path: Path) -> tuple[AdapterEntry,
                                                                       AdapterWeights]:
    buffer = AdapterFetcher(device, None).read_local(path.name, path)
    assert buffer.manifest is not None
    weights = adapter_weights(buffer, config, 64)
    return AdapterEntry(weights.adapter_id, path.name, buffer.manifest), weights


def _layer_equal(a: LoraSlots, b: LoraSlots, layer: int, slot: int) -> bool:
    return all(torch.equal(a.a[m][layer, slot], b.a[m][layer, slot])
               and torch.equal(a.b[m][layer, slot], b.b[m][layer, slot]) for m in a.a)


@pytest.mark.parametrize("adapter", ["attn-r4", "patterned"])
def test_a_slot_fills_layer_by_layer_as_layers_land(
    device: Device, tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path: Path,
    adapter: str,
) -> None:
    """``patterned``: modules of their own rank and alpha (rank_pattern / alpha_pattern), whose
    scaling folds apply once per layer, as a whole copy applies them."""
    config = ModelConfig.from_dir(tiny_model)
    path = tiny_adapters.get(adapter) or make_family_adapter(
        tiny_model, tmp_path / adapter, rank=4, targets=["q_proj", "k_proj", "v_proj"], seed=9,
        rank_pattern={"q_proj": 2}, alpha_pattern={"q_proj": 5.0, "v_proj": 3.0})
    layers = config.num_layers
    assert layers >= 2
    slots = LoraSlots(config, 2, 64, torch.float32, CPU)
    whole = LoraSlots(config, 2, 64, torch.float32, CPU)
    tier = DeviceTier(slots, device, WorkerMetrics(), AdmissionCostModel())
    layered = LayeredSlots(tier)
    old, old_weights = _adapter(device, config, tiny_adapters["all-r64"])
    for target in (slots, whole):  # the slot held another adapter: every layer gets replaced
        target.write(0, old.adapter_id, old_weights.rank, old_weights.scaling,
                     list(old_weights.blocks))
    entry, weights = _adapter(device, config, path)
    assert bool(weights.folds) is (adapter == "patterned")
    whole.write(0, weights.adapter_id, weights.rank, weights.scaling, list(weights.blocks),
                folds=weights.folds)
    reading = HostEvent()  # a step still reads slot 0 (rule 2)
    tier.mark_read([0], reading)

    assert layered.claim([entry], entry, weights, landed=1)
    assert entry.slot == 0
    time.sleep(0.05)
    assert layered.layers_ready(entry) == 0  # nothing is written while the step may read
    assert not tier.ready(entry) and entry.residency is Residency.LOADING
    reading.set()
    _until(lambda: layered.layers_ready(entry) == 1)
    assert _layer_equal(slots, whole, 0, 0)
    assert not _layer_equal(slots, whole, 1, 0)  # layer 1 has not landed: still the old one
    assert not tier.ready(entry) and entry.copying
    assert slots.table[0].adapter_id == entry.adapter_id and slots.table[0].rank == 4

    layered.land(entry, layers)
    assert entry.slot_event is not None and entry.slot_event.wait(5)
    assert tier.ready(entry) and layered.layers_ready(entry) == layers
    assert entry.residency is Residency.DEVICE
    for layer in range(layers):
        assert _layer_equal(slots, whole, layer, 0), layer


def test_a_layered_copy_waits_for_its_layers_whatever_the_stream_runs(
    device: Device, tiny_model: Path, tiny_adapters: dict[str, Path]
) -> None:
    """Layers not landed are never copied, however long the stream runs; an adapter copied
    whole afterwards into another slot is not held up by the layers still to land."""
    config = ModelConfig.from_dir(tiny_model)
    slots = LoraSlots(config, 2, 64, torch.float32, CPU)
    tier = DeviceTier(slots, device, WorkerMetrics(), AdmissionCostModel())
    layered = LayeredSlots(tier)
    entry, weights = _adapter(device, config, tiny_adapters["mlp-r8"])
    other, other_weights = _adapter(device, config, tiny_adapters["attn-r4"])
    assert layered.claim([entry], entry, weights, landed=0)
    assert tier.claim([entry, other], other, other_weights)
    assert other.slot_event is not None and other.slot_event.wait(5)
    assert tier.ready(other)
    assert layered.layers_ready(entry) == 0 and not tier.ready(entry)
    assert entry.slot_event is not None and not entry.slot_event.wait(0.05)
    assert all(slots.a[m][:, entry.slot].abs().sum() == 0 for m in slots.a)  # nothing copied
    for landed in range(1, config.num_layers + 1):
        layered.land(entry, landed)
        _until(lambda landed=landed: layered.layers_ready(entry) == landed)
    assert tier.ready(entry)


def test_a_slot_a_span_reads_goes_to_no_other_adapter_until_the_read_is_recorded(
    device: Device, tiny_model: Path, tiny_adapters: dict[str, Path]
) -> None:
    """A layered prefill's span holds its slot (``hold``) from the slot's lookup to the record of
    its read (``release``). If the adapter's fetch fails meanwhile and takes the slot back, no
    other adapter gets it before then, and the one that gets it after copies only once the
    span's read completed (rule 2)."""
    config = ModelConfig.from_dir(tiny_model)
    slots = LoraSlots(config, 2, 64, torch.float32, CPU)
    tier = DeviceTier(slots, device, WorkerMetrics(), AdmissionCostModel())
    layered = LayeredSlots(tier)
    landing, landing_weights = _adapter(device, config, tiny_adapters["all-r64"])
    busy, busy_weights = _adapter(device, config, tiny_adapters["mlp-r8"])
    late, late_weights = _adapter(device, config, tiny_adapters["attn-r4"])
    assert layered.claim([landing], landing, landing_weights, landed=1)
    slot = landing.slot
    assert slot is not None
    tier.hold([slot])  # a span looked the slot up and runs
    tier.evict(landing)  # its fetch failed: the slot holds part of an adapter that will not come
    assert tier.claim([landing, busy], busy, busy_weights)
    assert busy.slot != slot  # the other slot, though the held one looks free
    busy.refs = 1  # in use: not evictable
    assert not tier.claim([busy, late], late, late_weights)  # nothing free until the release
    span_read = HostEvent()  # the span's kernels, still running
    tier.release([slot], span_read)
    assert tier.claim([busy, late], late, late_weights)
    assert late.slot == slot and late.slot_event is not None
    assert not late.slot_event.wait(0.05)  # the copy waits for the span's read
    span_read.set()
    assert late.slot_event.wait(5) and tier.ready(late)
