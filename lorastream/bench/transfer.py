"""Store streaming rate against a bare gRPC stream of the same bytes, on loopback.

Both servers run in their own processes (as in deployment), and so does each measured client: a
client's heap would otherwise carry one run's allocations into the next (a 96 MB landing buffer
freed and trimmed makes the following run page-fault on every message). The parent drives the
clients round by round (bare, store, verified, bare, ...) so that drift hits all alike.

- bare: a server streaming pre-cut raw ``bytes`` chunks from memory with identity serializers,
  to a client that only counts them: the fastest gRPC can move these bytes.
- store: the store reads the staged file chunk by chunk, checksums (CRC-32C) and frames each
  chunk as a ``StreamAdapterTensorsResponse``; the client decodes and checks every chunk.
- verified: as store, plus landing every chunk at its offset in a preallocated buffer and the
  per-tensor sha256 check, i.e. what the worker does.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import grpc

from lorastream.bench.synthetic import ALL_LINEAR, SMOLLM2_135M, adapter_nbytes
from lorastream.bench.synthetic import make_synthetic_adapter
from lorastream.store_client import GRPC_OPTIONS, BytesSink, StoreClient

_BARE_METHOD = "/lorastream.bench.Bare/Stream"
CLIENTS = ("bare", "store", "verified")


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


def _run_client(kind: str, target: str, chunk_bytes: int, conn: Connection) -> None:
    """A measuring client: on each message from ``conn``, stream once and send back bytes/s."""
    if kind == "bare":
        channel = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        call = channel.unary_stream(_BARE_METHOD)

        def run() -> int:
            return sum(len(chunk) for chunk in call(b""))
    else:
        client = StoreClient(target)

        def run() -> int:
            if kind == "store":
                return sum(len(c.data) for c in client.iter_chunks("bench", chunk_bytes=chunk_bytes))
            return client.stream_tensors("bench", BytesSink(), chunk_bytes=chunk_bytes).total_bytes

    run()  # warm-up: connection, first allocations
    while conn.recv():
        start = time.perf_counter()
        nbytes = run()
        conn.send(nbytes / (time.perf_counter() - start))


def _start(target: Callable[..., None], *args: object) -> tuple[mp.process.BaseProcess, int]:
    ctx = mp.get_context("spawn")
    ports: mp.Queue[int] = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, ports), daemon=True)
    proc.start()
    return proc, ports.get(timeout=60)


def run_transfer_bench(
    adapter_mb: int = 96, chunk_bytes: int = 1 << 20, repeats: int = 15
) -> dict[str, object]:
    """Stage a synthetic adapter of about ``adapter_mb`` MB and compare the streams."""
    rank = max(1, round(adapter_mb * 1e6 / adapter_nbytes(SMOLLM2_135M, 1, ALL_LINEAR)))
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    rates: dict[str, list[float]] = {kind: [] for kind in CLIENTS}
    with tempfile.TemporaryDirectory(prefix="lorastream-bench-") as tmp:
        adapter_dir = make_synthetic_adapter(Path(tmp) / "adapter", rank=rank)
        try:
            store_proc, store_port = _start(_run_store_server, str(Path(tmp) / "cache"), chunk_bytes)
            procs.append(store_proc)
            with StoreClient(f"127.0.0.1:{store_port}") as client:
                for _event in client.preload(str(adapter_dir), "bench"):
                    pass
                total = client.describe("bench").total_bytes
            bare_proc, bare_port = _start(_run_bare_server, total, chunk_bytes)
            procs.append(bare_proc)
            conns: dict[str, Connection] = {}
            for kind in CLIENTS:
                port = bare_port if kind == "bare" else store_port
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_run_client,
                    args=(kind, f"127.0.0.1:{port}", chunk_bytes, child),
                    daemon=True,
                )
                proc.start()
                procs.append(proc)
                conns[kind] = parent
            for _ in range(repeats):
                for kind, conn in conns.items():
                    conn.send(True)
                    rates[kind].append(conn.recv())
            for conn in conns.values():
                conn.send(False)
        finally:
            for proc in procs:
                proc.kill()
    median = statistics.median
    ratios = [s / b for s, b in zip(rates["store"], rates["bare"], strict=True)]
    verified = [v / b for v, b in zip(rates["verified"], rates["bare"], strict=True)]
    return {
        "benchmark": "transfer",
        "adapter_bytes": total,
        "adapter_rank": rank,
        "chunk_bytes": chunk_bytes,
        "repeats": repeats,
        "bare_grpc_MBps": round(median(rates["bare"]) / 1e6, 1),
        "store_stream_MBps": round(median(rates["store"]) / 1e6, 1),
        "store_verified_MBps": round(median(rates["verified"]) / 1e6, 1),
        # Median over rounds of (store rate / bare rate of the same round).
        "store_vs_bare": round(median(ratios), 3),
        "store_verified_vs_bare": round(median(verified), 3),
        "goal": "store_vs_bare >= 0.8",
        "goal_met": median(ratios) >= 0.8,
    }
