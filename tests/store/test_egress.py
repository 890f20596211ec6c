"""The store's egress cap: streams together stay under the configured rate, on a fake clock and
through a real store on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lorastream.core.store_client import BytesSink, StoreClient
from lorastream.store.config import StoreSettings
from lorastream.store.egress import EgressLimiter
from lorastream.store.server import create_server
from tests.support.models import ALL_LINEAR, make_peft_adapter, make_tiny_llama


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_chunks_are_paced_at_the_rate_and_idle_time_is_not_banked() -> None:
    clock = FakeClock()
    limiter = EgressLimiter(1000.0, clock=clock, sleep=clock.sleep)  # 1000 bytes per second
    assert limiter.acquire(500) == 0.0  # an idle link sends at once
    assert limiter.acquire(500) == pytest.approx(0.5)  # then waits for the first chunk's time
    assert limiter.acquire(1000) == pytest.approx(0.5)
    assert clock.now == pytest.approx(101.0)  # 1000 bytes sent by 101.0, the next 1000 by 102.0
    clock.now += 10.0  # a quiet period
    assert limiter.acquire(100) == 0.0
    assert limiter.acquire(100) == pytest.approx(0.1)  # no burst from the 10 idle seconds


def _sent_at_once(limiter: EgressLimiter, chunk: int) -> int:
    """Bytes the limiter lets go without waiting, chunk by chunk, up to the first that waits."""
    sent = 0
    while limiter.acquire(chunk) == 0.0:
        sent += chunk
    return sent


@pytest.mark.parametrize("burst", [0, 256, 2048])
def test_a_late_sender_catches_up_by_at_most_the_burst(burst: int) -> None:
    # 1024 bytes per second, chunks of 128 (1/8 s): every time below is exact in binary
    clock = FakeClock()
    limiter = EgressLimiter(1024.0, burst, clock=clock, sleep=clock.sleep)
    clock.now += 10.0  # a long quiet spell banks the whole burst, no more
    assert _sent_at_once(limiter, 128) == burst + 128  # the burst, and the chunk due now
    assert clock.now == pytest.approx(110.125)  # the chunk after that waited for its slot
    clock.now += 0.5  # the sender was off the CPU for 4 chunks' time: 512 bytes of idle link
    assert _sent_at_once(limiter, 128) == min(burst, 512 - 128) + 128


def test_reservations_from_many_threads_never_overlap() -> None:
    limiter = EgressLimiter(1e6)  # 1 MB/s, real clock
    sizes = [20_000] * 20  # 400 KB: at least 0.38 s whatever the interleaving
    start = time.monotonic()
    threads = [threading.Thread(target=limiter.acquire, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - start >= (sum(sizes) - sizes[0]) / 1e6


@pytest.mark.parametrize("rate", [0.0, -5.0])
def test_a_rate_that_is_not_positive_is_refused(rate: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        EgressLimiter(rate)


def test_a_negative_burst_is_refused() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        EgressLimiter(1000.0, -1)


@contextmanager
def capped_store(tmp_path: Path, seconds: float, burst_of: float = 0.0,
                 streams: int = 1) -> Iterator[tuple[StoreClient, int, float]]:
    """A store holding adapter ``a``, its egress capped so that ``streams`` streams of it take
    ``seconds`` paced chunk by chunk, banking ``burst_of`` times the adapter's size; yields a
    client, the adapter's file size and the cap (MB/s)."""
    base = make_tiny_llama(tmp_path / "base")
    adapter = make_peft_adapter(base, tmp_path / "adapter", rank=16, targets=ALL_LINEAR)
    nbytes = (adapter / "adapter_model.safetensors").stat().st_size
    rate_mbps = streams * nbytes / 1e6 / seconds
    settings = StoreSettings(port=0, cache_dir=tmp_path / "cache", egress_limit_mbps=rate_mbps,
                             egress_burst_bytes=int(burst_of * nbytes))
    server, port, _ = create_server(settings)
    server.start()
    try:
        with StoreClient(f"127.0.0.1:{port}") as client:
            for _ in client.preload(str(adapter), "a"):
                pass
            yield client, nbytes, rate_mbps
    finally:
        server.stop(grace=None).wait()


def test_two_streams_through_a_capped_store_share_the_rate(tmp_path: Path) -> None:
    # two streams of the adapter: >= 0.6 s together
    with capped_store(tmp_path, seconds=0.6, streams=2) as (client, nbytes, rate_mbps):
        sinks = [BytesSink(), BytesSink()]
        start = time.monotonic()
        threads = [threading.Thread(target=client.stream_tensors,
                                    args=("a", sink), kwargs={"chunk_bytes": 16 << 10})
                   for sink in sinks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
    streamed = sum(len(buf) for sink in sinks for buf in sink.buffers)
    assert streamed > 0.9 * 2 * nbytes  # the tensors (the file adds only its header)
    assert elapsed >= (streamed - (16 << 10)) / (rate_mbps * 1e6)


def test_a_capped_store_with_a_burst_sends_what_it_banked_at_once(tmp_path: Path) -> None:
    # paced chunk by chunk, one stream would take ~5 s; the link banks twice the adapter
    with capped_store(tmp_path, seconds=5.0, burst_of=2.0) as (client, nbytes, _):
        start = time.monotonic()
        sink = BytesSink()
        client.stream_tensors("a", sink, chunk_bytes=16 << 10)
        elapsed = time.monotonic() - start
    assert sum(len(buf) for buf in sink.buffers) > 0.9 * nbytes
    assert elapsed < 2.5, f"{elapsed:.2f} s: the banked burst was not used"
