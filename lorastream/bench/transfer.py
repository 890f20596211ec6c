"""Store streaming rate against a bare gRPC stream of the same bytes, on loopback.

Both servers run in their own processes (as in deployment); the client side runs here. The bare
server streams pre-cut raw ``bytes`` chunks from memory with identity serializers: the fastest
gRPC can move these bytes. The store reads the staged file chunk by chunk, computes crc32 and
wraps each chunk in a protobuf message. Both are received and decoded by the client; the store
side is also reported with full landing + crc32/sha256 verification (what the worker does).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from lorastream.bench.synthetic import SMOLLM2_135M, adapter_nbytes, make_synthetic_adapter
from lorastream.store_client import GRPC_OPTIONS, BytesSink, StoreClient

_BARE_METHOD = "/lorastream.bench.Bare/Stream"


def _run_bare_server(payload_bytes: int, chunk_bytes: int, ports: "mp.Queue[int]") -> None:
    from concurrent import futures

    payload = bytes(payload_bytes)
    chunks = [payload[i : i + chunk_bytes] for i in range(0, payload_bytes, chunk_bytes)]

    def stream(request: bytes, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
        yield from chunks

    handler = grpc.method_handlers_generic_handler(
        "lorastream.bench.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler], options=GRPC_OPTIONS)
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _run_store_server(cache_dir: str, chunk_bytes: int, ports: "mp.Queue[int]") -> None:
    from services.adapter_store.config import StoreSettings
    from services.adapter_store.server import create_server

    settings = StoreSettings(port=0, cache_dir=Path(cache_dir), chunk_bytes=chunk_bytes)
    server, port, _ = create_server(settings)
    server.start()
    ports.put(port)
    server.wait_for_termination()


def _start(target: Callable[..., None], *args: object) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    ports: mp.Queue[int] = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, ports), daemon=True)
    proc.start()
    return proc, ports.get(timeout=60)


def _median_rate(run: Callable[[], int], repeats: int) -> tuple[float, int]:
    rates, nbytes = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        nbytes = run()
        rates.append(nbytes / (time.perf_counter() - start))
    return statistics.median(rates), nbytes


def run_transfer_bench(adapter_mb: int = 96, chunk_bytes: int = 1 << 20, repeats: int = 5) -> dict:
    """Stage a synthetic adapter of about ``adapter_mb`` MB and compare the two streams."""
    per_rank = adapter_nbytes(SMOLLM2_135M, 1, ("q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"))
    rank = max(1, round(adapter_mb * 1e6 / per_rank))
    with tempfile.TemporaryDirectory(prefix="lorastream-bench-") as tmp:
        adapter_dir = make_synthetic_adapter(Path(tmp) / "adapter", rank=rank)
        store_proc, store_port = _start(_run_store_server, str(Path(tmp) / "cache"), chunk_bytes)
        try:
            with StoreClient(f"127.0.0.1:{store_port}") as client:
                manifest = None
                for event in client.preload(str(adapter_dir), "bench"):
                    manifest = event.manifest or manifest
                assert manifest is not None
                total = manifest.total_bytes
                bare_proc, bare_port = _start(_run_bare_server, total, chunk_bytes)
                try:
                    channel = grpc.insecure_channel(f"127.0.0.1:{bare_port}", options=GRPC_OPTIONS)
                    bare_call = channel.unary_stream(_BARE_METHOD)

                    def bare() -> int:
                        return sum(len(c) for c in bare_call(b""))

                    def store_raw() -> int:
                        return sum(len(c.data) for c in client.iter_chunks("bench", chunk_bytes=chunk_bytes))

                    def store_verified() -> int:
                        sink = BytesSink()
                        m = client.stream_tensors("bench", sink, chunk_bytes=chunk_bytes)
                        return m.total_bytes

                    for warm in (bare, store_raw):
                        warm()
                    bare_rate, _ = _median_rate(bare, repeats)
                    raw_rate, _ = _median_rate(store_raw, repeats)
                    verified_rate, _ = _median_rate(store_verified, repeats)
                    channel.close()
                finally:
                    bare_proc.kill()
        finally:
            store_proc.kill()
    return {
        "benchmark": "transfer",
        "adapter_bytes": total,
        "adapter_rank": rank,
        "chunk_bytes": chunk_bytes,
        "repeats": repeats,
        "bare_grpc_MBps": round(bare_rate / 1e6, 1),
        "store_stream_MBps": round(raw_rate / 1e6, 1),
        "store_verified_MBps": round(verified_rate / 1e6, 1),
        "store_vs_bare": round(raw_rate / bare_rate, 3),
        "store_verified_vs_bare": round(verified_rate / bare_rate, 3),
        "goal": "store_vs_bare >= 0.8",
    }
