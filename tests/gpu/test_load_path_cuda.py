"""The CUDA load path: pinned landing, the load stream and its events, and rules 1 and 2 of
docs/design.md with injected delays.

Rule 1: no step reads a slot before its load completed. Rule 2: no load overwrites a slot that a
step may still read. The delays are made on the device (``torch.cuda._sleep`` spins a stream), so
a copy or a step is still running when the other side would otherwise go ahead; each rule is
checked with its event (the slot holds what the rule promises) and without it (the race is real:
the test would fail if the device layer forgot the wait). Then the engine-level tests of
tests/worker/loading/test_overlap_loading.py run again on a CUDA engine, with their host-side
delays.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorastream.core.store_client import StoreClient
from lorastream.worker.device.device import Device, Event
from lorastream.worker.loading.fetch import AdapterFetcher
from tests.worker.conftest import EngineFactory, StoreStack
from tests.worker.loading import test_overlap_loading as overlap

DELAY_MS = 100.0  # how long the delayed side keeps its stream busy
SLOT = 1 << 20  # elements of the fake slot


def _cycles(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` spins for about ``ms`` (measured once)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * ms / start.elapsed_time(end))


@pytest.fixture
def device() -> Device:
    dev = Device("cuda")
    yield dev
    dev.close()


def _pinned(value: float) -> torch.Tensor:
    return torch.full((SLOT,), value).pin_memory()


@pytest.mark.parametrize("wait", [True, False], ids=["compute waits", "no wait (the race)"])
def test_rule_1_a_step_reads_a_slot_only_after_its_delayed_load(device: Device,
                                                                wait: bool) -> None:
    slot = torch.zeros(SLOT, device="cuda")
    new = _pinned(1.0)
    spin = _cycles(DELAY_MS)

    def delayed_copy() -> None:
        torch.cuda._sleep(spin)  # the load stream is still busy when the step is issued
        slot.copy_(new, non_blocking=True)

    loaded = device.load_stream.submit([delayed_copy])
    assert not loaded.query(), "the delayed copy finished before the step: raise DELAY_MS"
    if wait:
        device.compute_wait(loaded)  # rule 1, on the compute stream: no host block
    seen = slot.sum()  # the step reads the slot on the compute stream
    torch.cuda.synchronize()
    assert seen.item() == (SLOT if wait else 0)


@pytest.mark.parametrize("after", [True, False], ids=["load waits", "no wait (the race)"])
def test_rule_2_a_load_waits_for_the_last_step_that_read_the_slot(device: Device,
                                                                  after: bool) -> None:
    slot = torch.full((SLOT,), 2.0, device="cuda")  # the old adapter
    new = _pinned(3.0)
    torch.cuda._sleep(_cycles(DELAY_MS))  # the step is slow: it reads the slot late
    read = slot.sum()
    step_done: Event = device.record_compute()
    loaded = device.load_stream.submit(
        [lambda: slot.copy_(new, non_blocking=True)], after=step_done if after else None
    )
    device.compute_wait(loaded)
    final = slot.sum()
    torch.cuda.synchronize()
    assert read.item() == (2.0 * SLOT if after else 3.0 * SLOT)  # the step saw the old adapter
    assert final.item() == 3.0 * SLOT  # and the new one landed after it


def test_host_buffers_are_pinned_and_copies_from_them_do_not_block(device: Device) -> None:
    host = device.host_empty(64 << 20, torch.uint8)
    assert host.is_pinned()
    target = torch.empty_like(host, device="cuda")
    spin = _cycles(DELAY_MS)
    event = device.load_stream.submit([lambda: torch.cuda._sleep(spin),
                                       lambda: target.copy_(host, non_blocking=True)])
    assert not event.query()  # submit returned while the copy is still queued
    event.wait()
    assert event.query()


def test_a_store_fetch_lands_verified_in_pinned_memory(
    store: StoreStack, tiny_adapters: dict[str, Path], device: Device
) -> None:
    with StoreClient(store.target) as client:
        expected_id = client.describe("all-r64").adapter_id
    fetcher = AdapterFetcher(device, store.target, process=None)
    try:
        buffer = fetcher.fetch("all-r64", expected_id)
    finally:
        fetcher.close()
    assert buffer.buffer is not None and buffer.buffer.is_pinned()
    original = load_file(str(tiny_adapters["all-r64"] / "adapter_model.safetensors"))
    for name, tensor in buffer.tensors().items():
        assert torch.equal(tensor, original[name]), name


def _on_cuda(engine_factory: EngineFactory) -> EngineFactory:
    def make(**overrides: object) -> object:
        engine = engine_factory(device="cuda", dtype="float32", **overrides)
        assert engine.device.is_cuda
        return engine
    return make  # type: ignore[return-value]  # make() is typed to return object, the factory an Engine


def test_the_engines_host_arena_is_pinned(engine_factory: EngineFactory) -> None:
    engine = _on_cuda(engine_factory)()
    assert engine.adapters.host.arena.buffer.is_pinned()


# the CPU tests whose bodies run again here, on a CUDA engine (and whether one takes monkeypatch)
ENGINE_TESTS: dict[str, tuple[Callable[..., None], bool]] = {
    "rule 1: no step reads a slot before its copy completed":
        (overlap.test_no_step_reads_a_slot_before_its_copy_completed, False),
    "running streams keep decoding while a load is in flight":
        (overlap.test_running_streams_keep_decoding_while_a_load_is_in_flight, True),
    "rule 2: churn with more adapters than slots stays exact":
        (overlap.test_churn_with_more_adapters_than_slots_and_cancellations_stays_exact_and_leaks_nothing,
         False),
}


@pytest.mark.parametrize("check", list(ENGINE_TESTS))
def test_the_overlap_loading_tests_hold_on_a_cuda_engine(
    check: str, engine_factory: EngineFactory, store: StoreStack,
    reference: dict[tuple[str, int], list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    body, patches = ENGINE_TESTS[check]
    args = (monkeypatch,) if patches else ()
    body(_on_cuda(engine_factory), store, reference, *args)
