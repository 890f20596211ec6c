"""The device bytes of adapters' vocabulary modules (``--lora-vocab-bytes``): an adapter with
saved ``embed_tokens`` / ``lm_head`` takes a slot only when its bytes fit, idle adapters are
evicted by these bytes (LRU), one in use never is, evicting frees the parts, and an adapter that
exceeds the whole budget is refused naming the flag to raise. Real PEFT adapters on a tiny
checkpoint, real slot copies."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorastream.core.errors import InvalidAdapter
from lorastream.core.manifest import AdapterManifest
from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import (
    AdapterEntry,
    AdapterWeights,
    adapter_weights,
    check_fits,
)
from lorastream.worker.loading.device_tier import AdmissionCostModel, DeviceTier
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig
from tests.support.models import make_family_adapter, make_tiny_family, make_vocab_adapter

CPU = torch.device("cpu")
V, H = 256, 64  # the tiny llama's vocabulary and hidden size (tests/support/models.py)
SAVED_BYTES = 2 * V * H * 4  # saved embed_tokens and lm_head, fp32 slots


@dataclass
class Adapters:
    config: ModelConfig
    loaded: dict[str, tuple[AdapterManifest, AdapterWeights]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Adapters]:
    root = tmp_path_factory.mktemp("vocab-budget")
    checkpoint = make_tiny_family("llama", root / "model")
    paths: dict[str, Path] = {
        name: make_vocab_adapter(checkpoint, root / name, rank=4, seed=i,
                                 target_modules=["q_proj"],
                                 modules_to_save=["embed_tokens", "lm_head"])
        for i, name in enumerate(("saved-1", "saved-2"))}
    paths["plain"] = make_family_adapter(checkpoint, root / "plain", rank=4,
                                         targets="all-linear", seed=9)
    config = ModelConfig.from_dir(checkpoint)
    device = Device("cpu")
    fetcher = AdapterFetcher(device, None)
    loaded = {}
    for name, path in paths.items():
        buffer = fetcher.read_local(name, path)
        assert buffer.manifest is not None
        loaded[name] = (buffer.manifest, adapter_weights(buffer, config, 8))
    yield Adapters(config, loaded)
    device.close()


@pytest.fixture
def device() -> Iterator[Device]:
    d = Device("cpu")
    yield d
    d.close()


def _tier(adapters: Adapters, device: Device, vocab_bytes: int) -> DeviceTier:
    slots = LoraSlots(adapters.config, 3, 8, torch.float32, CPU, vocab_bytes=vocab_bytes)
    return DeviceTier(slots, device, WorkerMetrics(), AdmissionCostModel())


def _place(tier: DeviceTier, entries: list[AdapterEntry], adapters: Adapters, name: str,
           last_used: float) -> AdapterEntry | None:
    """Claim a slot for ``name`` and run its copy; the entry, or None when it got none."""
    manifest, weights = adapters.loaded[name]
    entry = AdapterEntry(weights.adapter_id, name, manifest, weights=weights,
                         last_used=last_used)
    if not tier.claim(entries, entry, weights):
        return None
    assert entry.slot_event is not None
    entry.slot_event.wait()
    entries.append(entry)
    return entry


def test_the_budget_counts_each_adapters_vocabulary_parts(adapters: Adapters,
                                                          device: Device) -> None:
    tier = _tier(adapters, device, 10 * SAVED_BYTES)
    entries: list[AdapterEntry] = []
    saved = _place(tier, entries, adapters, "saved-1", 1.0)
    plain = _place(tier, entries, adapters, "plain", 2.0)
    assert saved is not None and plain is not None and saved.slot is not None
    budget = tier.slots.vocab_budget
    assert budget.need(adapters.loaded["plain"][0]) == 0
    assert budget.need(saved.manifest) == SAVED_BYTES
    assert tier.slots.vocab[saved.slot].nbytes == SAVED_BYTES == tier.slots.vocab_nbytes
    assert tier.vocab_used(entries) == SAVED_BYTES


@pytest.mark.parametrize(
    ("first_in_use", "placed"),
    [(False, True), (True, False)],
    ids=["idle-evicted", "in-use-kept"],
)
def test_the_budget_evicts_idle_adapters_by_vocabulary_bytes(
    adapters: Adapters, device: Device, first_in_use: bool, placed: bool
) -> None:
    """Room for one adapter's saved modules, three slots: the second saved adapter evicts the
    first (idle, least recently used, though a slot is free) and leaves the plain LoRA; with
    the first in use it gets no slot and nothing is evicted."""
    tier = _tier(adapters, device, SAVED_BYTES + SAVED_BYTES // 2)
    entries: list[AdapterEntry] = []
    first = _place(tier, entries, adapters, "saved-1", 1.0)
    plain = _place(tier, entries, adapters, "plain", 0.5)  # older than first: LRU overall
    assert first is not None and plain is not None and first.slot is not None
    if first_in_use:
        first.acquire()
    parts = weakref.ref(tier.slots.vocab[first.slot].embed_full)  # type: ignore[arg-type]  # a saved module is present
    second = _place(tier, entries, adapters, "saved-2", 3.0)
    assert (second is not None) is placed
    assert plain.slot is not None  # never evicted: it has no vocabulary bytes to free
    if placed:
        assert second is not None and second.slot is not None
        assert first.slot is None and first.slot_event is None
        assert list(tier.slots.vocab) == [second.slot]
        assert tier.slots.vocab_nbytes == SAVED_BYTES == tier.vocab_used(entries)
        gc.collect()
        assert parts() is None  # evicting freed the first adapter's [V, H] matrices
    else:
        assert first.slot is not None and list(tier.slots.vocab) == [first.slot]
        assert parts() is not None


def test_an_adapter_beyond_the_whole_budget_is_refused(adapters: Adapters) -> None:
    manifest, _ = adapters.loaded["saved-1"]
    slots = LoraSlots(adapters.config, 2, 8, torch.float32, CPU, vocab_bytes=SAVED_BYTES - 1)
    with pytest.raises(InvalidAdapter, match="--lora-vocab-bytes") as caught:
        check_fits(manifest, adapters.config, 8, slots.vocab_budget)
    assert str(SAVED_BYTES) in str(caught.value)
    plain, _ = adapters.loaded["plain"]
    check_fits(plain, adapters.config, 8, slots.vocab_budget)  # no vocabulary part: it fits
