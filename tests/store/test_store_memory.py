"""Ten concurrent streams of a 100 MB adapter barely move the store's resident memory."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from lorastream.bench.synthetic import SMOLLM2_135M, adapter_nbytes, make_synthetic_adapter
from lorastream.core.store_client import StoreClient

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STREAMS = 10


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ten_concurrent_streams_of_100mb_raise_rss_by_far_less_than_100mb(tmp_path: Path) -> None:
    rank = round(100e6 / adapter_nbytes(SMOLLM2_135M, 1, ALL))
    adapter = make_synthetic_adapter(tmp_path / "big", rank=rank)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", "store", "serve", "--port", str(port),
         "--cache-dir", str(tmp_path / "cache"), "--log-level", "WARNING"],
    )
    try:
        target = f"127.0.0.1:{port}"
        with StoreClient(target) as client:
            for _ in range(100):
                try:
                    client.list()
                    break
                except Exception:
                    time.sleep(0.1)
            manifest = None
            for event in client.preload(str(adapter), "big"):
                manifest = event.manifest or manifest
            assert manifest is not None and manifest.total_bytes >= 95e6
            server = psutil.Process(proc.pid)
            baseline = server.memory_info().rss
            peak = baseline
            done = threading.Event()

            def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, server.memory_info().rss)
                    time.sleep(0.01)

            received = [0] * STREAMS

            def stream(i: int) -> None:
                with StoreClient(target) as c:
                    received[i] = sum(len(ch.data) for ch in c.iter_chunks("big"))

            sampler = threading.Thread(target=sample)
            sampler.start()
            workers = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            done.set()
            sampler.join()
        assert received == [manifest.total_bytes] * STREAMS
        growth = peak - baseline
        # 10 streams x 100 MB would be 1 GB if the store buffered whole adapters.
        assert growth < 60e6, f"store RSS grew by {growth / 1e6:.0f} MB"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
