"""Overlapped adapter loading, made observable with the fault hooks: a per-chunk delay
on the store stream (``fetcher.chunk_delay_s``) and a per-copy delay on the load stream
(``device.load_stream.copy_delay_s``)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.store.servicer import AdapterStoreServicer
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.host import HostAdapterBuffer
from tests.worker.conftest import ADAPTERS, PROMPTS, EngineFactory, StoreStack, greedy_tokens

HELD_TOKENS = 32  # tokens a stream must decode while the load is held in flight


def test_running_streams_keep_decoding_while_a_load_is_in_flight(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Progress, not speed: the store holds the adapter's bytes until a base-model stream has
    decoded all of its ``HELD_TOKENS`` tokens, so the load stays in flight for every one of those
    steps (a load inside the step would stall the stream, and the store would never be let go)."""
    opened = threading.Event()  # the store began streaming the adapter
    released = threading.Event()  # the store may send the adapter's chunks
    stream_tensors = AdapterStoreServicer.StreamAdapterTensors

    def held(self, request, context):  # type: ignore[no-untyped-def]  # a test stand-in
        replies = stream_tensors(self, request, context)
        yield next(replies)  # the manifest
        opened.set()
        released.wait(timeout=120)
        yield from replies

    monkeypatch.setattr(AdapterStoreServicer, "StreamAdapterTensors", held)
    store.restart()  # serves through the held stream
    engine = engine_factory(store=store.target)
    result: dict[str, list[int]] = {}

    def generate(key: str, model: str, **params: object) -> threading.Thread:
        thread = threading.Thread(
            target=lambda: result.update({key: greedy_tokens(engine, model, 0, **params)}))
        thread.start()
        return thread

    loader = generate("adapter", "attn-r4")
    try:
        assert opened.wait(timeout=60), "the adapter's fetch never reached the store"
        decoder = generate("base", "tiny", max_tokens=HELD_TOKENS, ignore_eos=True)
        decoder.join(timeout=60)
        assert not decoder.is_alive(), "the stream stopped decoding while the load was in flight"
        assert len(result["base"]) == HELD_TOKENS
        assert "adapter" not in result  # the load was in flight all along
        assert not engine.adapters.ready(engine.adapters.resolve("attn-r4"))
    finally:
        released.set()
        loader.join(timeout=60)
    assert result["adapter"] == reference[("attn-r4", 0)]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap-on", "overlap-off"])
def test_an_adapter_is_fetched_and_copied_from_the_requests_arrival_not_the_next_step(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    overlap: bool,
) -> None:
    engine = engine_factory(store=store.target, start=False, lora_overlap_loading=overlap)
    stream = engine.submit("all-r64", PromptInput(token_ids=tuple(PROMPTS[0])),
                           SamplingParams(max_tokens=12))
    adapter_id = engine.adapters.resolve("all-r64")
    deadline = time.monotonic() + 30
    while overlap and not engine.adapters.ready(adapter_id) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats.steps == 0  # no step has run: the engine loop is not even started
    state = engine.adapters.inspect("all-r64")
    assert state is not None
    if overlap:  # fetched into its host range and copied into a slot, from submit alone
        assert engine.adapters.ready(adapter_id)
        arena = engine.adapters.host.arena
        assert state.host_offset is not None and state.on_host and state.block_addresses
        begin = arena.buffer.data_ptr()
        for address in state.block_addresses:
            assert begin <= address < begin + arena.capacity
    else:  # without overlap, loads happen inside the step, so nothing started
        time.sleep(0.2)
        state = engine.adapters.inspect("all-r64")
        assert state is not None
        assert not state.on_host and not state.fetching and state.slot is None
    engine.start()
    assert [t for event in stream for t in event.token_ids] == reference[("all-r64", 0)]


def test_no_step_reads_a_slot_before_its_copy_completed(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    engine = engine_factory(store=store.target, max_loras=2)
    engine.device.load_stream.copy_delay_s = 0.2
    reads: list[tuple[int, bool]] = []
    original = engine.device.compute_wait

    def checked_wait(event) -> None:
        reads.append((id(event), event.query()))
        original(event)

    engine.device.compute_wait = checked_wait  # type: ignore[method-assign]  # a checking wrapper around the method
    names = list(ADAPTERS)
    results: dict[str, list[int]] = {}

    def client(name: str) -> None:
        results[name] = greedy_tokens(engine, name, 1)

    threads = [threading.Thread(target=client, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert reads and all(done for _, done in reads)
    for name in names:
        assert results[name] == reference[(name, 1)], name


def test_churn_with_more_adapters_than_slots_and_cancellations_stays_exact_and_leaks_nothing(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    engine = engine_factory(store=store.target, max_loras=2, host_cache_bytes=600_000)
    engine.device.load_stream.copy_delay_s = 0.01
    rng = random.Random(7)
    models = ["tiny", *ADAPTERS]
    failures: list[str] = []

    def client(i: int) -> None:
        name, prompt = models[rng.randrange(len(models))], rng.randrange(len(PROMPTS))
        try:
            stream = engine.submit(name, PromptInput(token_ids=tuple(PROMPTS[prompt])),
                                   SamplingParams(max_tokens=12))
            if i % 5 == 4:  # cancel some mid-way
                for event in stream:
                    if event.token_ids:
                        stream.cancel()
                return
            tokens = [t for event in stream for t in event.token_ids]
        except Exception as err:
            failures.append(f"{name} prompt {prompt}: {type(err).__name__}: {err}")
            return
        expected = reference[("base" if name == "tiny" else name, prompt)]
        if tokens != expected:
            failures.append(f"{name} prompt {prompt}: {tokens} != {expected}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
        time.sleep(0.01)
    for t in threads:
        t.join(timeout=180)
    assert not failures, failures
    deadline = time.monotonic() + 10
    while (engine.running or engine.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    usage = engine.adapters.usage()
    assert usage.references == 0
    assert engine.kv.allocator.used_blocks == 0
    assert usage.slots_used <= 2
    assert usage.host_bytes_used <= 600_000


def _landed_chunks(engine: Engine, name: str, writes: list[tuple[int, int]]) -> int:
    """4 KiB chunks of ``name`` landed so far: counted by the write hook when the fetch runs in
    the worker, read from the shared host memory (random weights are never a zero chunk) when
    it runs in the fetch process."""
    if engine.adapters.fetcher.landing_memory is None:
        return len(writes)
    state = engine.adapters.inspect(name)
    if state is None or state.host_offset is None:
        return 0
    landed = engine.adapters.host.arena.view(state.host_offset, state.host_bytes)
    return int(landed.view(-1, 4096).any(dim=1).sum())


@pytest.mark.parametrize("fetch_process", [False, True])
def test_a_store_that_dies_mid_stream_is_resumed_from_the_last_verified_offset(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    monkeypatch: pytest.MonkeyPatch, fetch_process: bool,
) -> None:
    store.restart(chunk_delay_s=0.01)  # a slow store: all-r64 is 128 chunks of 4 KiB
    engine = engine_factory(store=store.target, fetch_process=fetch_process)
    engine.adapters.fetcher.chunk_bytes = 4096
    writes: list[tuple[int, int]] = []  # (tensor, offset) of each chunk landed in this process
    original_write = HostAdapterBuffer.write

    def recording_write(self, tensor_index, offset, data):
        writes.append((tensor_index, offset))
        original_write(self, tensor_index, offset, data)

    monkeypatch.setattr(HostAdapterBuffer, "write", recording_write)
    result: dict[str, list[int]] = {}
    thread = threading.Thread(target=lambda: result.update(t=greedy_tokens(engine, "all-r64", 2)))
    thread.start()
    deadline = time.monotonic() + 60
    while _landed_chunks(engine, "all-r64", writes) < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    store.server.stop(None).wait()  # the store dies mid-stream ...
    stopped_at = _landed_chunks(engine, "all-r64", writes)
    # ... base requests still serve
    assert greedy_tokens(engine, "tiny", 0) == reference[("base", 0)]
    store.restart()  # ... and comes back: the stream resumes where it stopped
    thread.join(timeout=60)
    assert result["t"] == reference[("all-r64", 2)]
    if not fetch_process:  # every chunk landed here, through the hook
        assert 10 <= stopped_at < len(writes) - 10  # it was really cut in the middle
        assert len(writes) == len(set(writes)), "some bytes were fetched twice"
    else:
        assert not writes  # none landed here: the fetch process landed them
        total = _landed_chunks(engine, "all-r64", writes)
        assert 10 <= stopped_at < total - 10  # it was really cut in the middle


def test_a_store_that_stays_dead_fails_that_adapters_requests_clearly(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
) -> None:
    engine = engine_factory(store=store.target)
    assert greedy_tokens(engine, "attn-r4", 0) == reference[("attn-r4", 0)]  # resident before
    store.restart(chunk_delay_s=0.02)
    engine.adapters.fetcher.chunk_bytes = 4096
    stream = engine.submit("all-r64", PromptInput(token_ids=tuple(PROMPTS[0])),
                           SamplingParams(max_tokens=4))
    time.sleep(0.3)
    store.server.stop(None).wait()
    with pytest.raises(errors.SourceUnavailable, match="unreachable while streaming all-r64"):
        list(stream)
    assert greedy_tokens(engine, "attn-r4", 0) == reference[("attn-r4", 0)]  # others keep serving
    assert greedy_tokens(engine, "tiny", 1) == reference[("base", 1)]
    state = engine.adapters.status("all-r64")
    assert state.references == 0 and state.slot == -1



def test_prometheus_metrics_report_tiers_hits_misses_and_load_times(
    engine_factory: EngineFactory, store: StoreStack
) -> None:
    import urllib.request

    engine = engine_factory(store=store.target, max_loras=1)
    port = engine.adapters.metrics.serve(0)
    greedy_tokens(engine, "attn-r4", 0)  # miss at both tiers: fetched, copied
    greedy_tokens(engine, "attn-r4", 1)  # device hit
    greedy_tokens(engine, "mlp-r8", 0)  # miss; evicts attn-r4 from the only slot
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values['lorastream_worker_adapter_hits_total{tier="device"}'] == 1
    assert values['lorastream_worker_adapter_misses_total{tier="device"}'] == 2
    assert values['lorastream_worker_adapter_misses_total{tier="host"}'] == 2
    assert values['lorastream_worker_adapter_evictions_total{tier="device"}'] == 1
    assert values['lorastream_worker_adapters_resident{tier="host"}'] == 2
    assert values['lorastream_worker_adapters_resident{tier="device"}'] == 1
    assert values["lorastream_worker_adapter_fetch_seconds_count"] == 2
    assert values["lorastream_worker_adapter_host_landing_seconds_count"] == 2
    assert values["lorastream_worker_adapter_device_copy_seconds_count"] == 2
    assert values["lorastream_worker_requests_waiting_on_load"] == 0


@pytest.mark.parametrize("fetch_threads", [1, 2])
def test_fetches_share_the_link_one_at_a_time_unless_configured_otherwise(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]],
    fetch_threads: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two cold adapters asked for together: with one fetch thread (the default) the second's
    bytes start arriving only after the first's have all landed, in the order asked for; with
    two, both are on the link at once (and so both arrive late)."""
    store.restart(chunk_delay_s=0.004)  # a slow link: all-r64 is 128 chunks of 4 KiB
    # Fetches on the worker's threads, where the write hook sees every chunk land.
    engine = engine_factory(store=store.target, start=False, fetch_threads=fetch_threads,
                            fetch_process=False)
    engine.adapters.fetcher.chunk_bytes = 4096
    writes: list[str] = []  # the adapter of every chunk landed, in order
    original_write = HostAdapterBuffer.write

    def recording_write(self, tensor_index, offset, data):
        writes.append(self.manifest.name)
        original_write(self, tensor_index, offset, data)

    monkeypatch.setattr(HostAdapterBuffer, "write", recording_write)
    params = SamplingParams(max_tokens=4)
    first = engine.submit("all-r64", PromptInput(token_ids=tuple(PROMPTS[0])), params)
    second = engine.submit("all-r16-rslora", PromptInput(token_ids=tuple(PROMPTS[1])), params)
    names = ("all-r64", "all-r16-rslora")

    def on_host() -> list[bool]:
        return [getattr(engine.adapters.inspect(n), "on_host", False) for n in names]

    deadline = time.monotonic() + 60
    while not all(on_host()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(on_host())
    runs = [name for i, name in enumerate(writes) if i == 0 or writes[i - 1] != name]
    if fetch_threads == 1:
        assert runs == ["all-r64", "all-r16-rslora"]  # one after the other, in order
    else:
        assert len(runs) > 2  # their chunks interleaved on the link
    engine.start()
    assert [t for e in first for t in e.token_ids] == reference[("all-r64", 0)][:4]
    assert [t for e in second for t in e.token_ids] == reference[("all-r16-rslora", 1)][:4]


def test_a_request_for_an_adapter_in_a_slot_fetches_nothing_even_without_its_host_copy(
    engine_factory: EngineFactory, store: StoreStack, reference: dict[tuple[str, int], list[int]]
) -> None:
    """The slot serves it: a request must not start a store fetch for an adapter whose host
    copy was dropped meanwhile (the fetch would be wasted, and an unload would be refused as
    "being loaded" while it ran)."""
    engine = engine_factory(store=store.target)
    assert greedy_tokens(engine, "attn-r4", 0) == reference[("attn-r4", 0)]
    adapter_id = engine.adapters.resolve("attn-r4")
    entry = engine.adapters._records.get(adapter_id)
    assert entry is not None and engine.adapters.ready(adapter_id)
    with engine.adapters._lock:  # as the host tier's LRU drops an idle copy
        engine.adapters.host.drop(entry)
    assert greedy_tokens(engine, "attn-r4", 1) == reference[("attn-r4", 1)]
    state = engine.adapters.inspect("attn-r4")
    assert state is not None and not state.fetching and not state.on_host
    engine.adapters.unload("attn-r4")  # nothing in flight: the unload is taken
