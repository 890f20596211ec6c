"""Store streaming rate against a bare gRPC stream of the same bytes, on loopback, for one or
more chunk sizes.

Both servers run in their own processes (as in deployment), and so does each measured client: a
client's heap would otherwise carry one run's allocations into the next (a 96 MB landing buffer
freed and trimmed makes the following run page-fault on every message). The parent drives the
clients round by round (bare, store, verified, bare, ...) so that drift hits all alike. Every
chunk size gets one unmeasured warm-up round, then ``repeats`` measured rounds.

- bare: a server streaming pre-cut raw ``bytes`` chunks from memory with identity serializers,
  to a client that only counts them, over the store client's stream channel options
  (single-threaded unary-stream calls): the fastest gRPC can move these bytes.
- bare_kept: the same client in a process that keeps freed buffers, as the verified clients and
  the worker's fetch process do (``native_env.keep_freed_buffers``): what that setting is worth
  to gRPC alone, so that the verified stream is also compared with a bare one on equal terms.
- store: the store reads the staged file chunk by chunk, checksums (CRC-32C) and frames each
  chunk as a ``StreamAdapterTensorsResponse``; the client decodes and checks every chunk.
- verified (one client per tensor digest, each from a store staging with that digest): what the
  worker does (``StoreClient.stream_tensors``): the store frames the chunks as for store but
  without their CRC-32C (``skip_chunk_crc``: the tensor digests cover the bytes end to end), and
  the client lands every chunk at its offset in a buffer allocated and faulted in once (as the
  worker's host arena is) and runs the per-tensor check the manifest asks for: sha256 (manifests
  without a fast digest), blake3, xxh3-128 (the default,
  :data:`~lorastream.core.checksum.DEFAULT_TENSOR_DIGEST`). Its process keeps freed buffers, as
  the fetch process does.

The same run times each digest alone over the adapter's tensors (``hash_GBps``) and, unless
``staging_mb`` is 0, a preload from S3 against boto3's own download (``transfer_staging.py``).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import grpc

from lorastream.bench.machine import command_line, machine_info
from lorastream.core.checksum import BLAKE3, DEFAULT_TENSOR_DIGEST, SHA256, XXH3_128
from lorastream.core.store_client import (
    GRPC_OPTIONS,
    STREAM_GRPC_OPTIONS,
    BytesSink,
    StoreClient,
)
from lorastream.core.tls import open_channel
from lorastream.worker.device.cpu.native_env import keep_freed_buffers

_BARE_METHOD = "/lorastream.bench.Bare/Stream"
# verified client -> the tensor digest its store stages with
VERIFIED = {"verified_sha256": SHA256, "verified_blake3": BLAKE3, "verified_xxh3": XXH3_128}
BARE = ("bare", "bare_kept")  # clients of the bare server
CLIENTS = (*BARE, "store", *VERIFIED)
# Clients whose process keeps freed message buffers, as the worker's fetch process does
# (native_env.keep_freed_buffers): the verified ones, and bare_kept, a bare client given the same
# setting to show what it is worth to gRPC alone.
KEEP_FREED_BUFFERS = ("bare_kept", *VERIFIED)
DEFAULT_VERIFIED = next(k for k, d in VERIFIED.items() if d == DEFAULT_TENSOR_DIGEST)
HEADLINE_CHUNK_BYTES = 1 << 20  # the point whose figures are also reported at top level
MAX_CHUNK_BYTES = 8 << 20  # the store's limit per message
_SIZE = re.compile(r"(\d+)\s*([KMG]?)(?:I?B)?", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"1M"`` -> 1048576, ``"1048576"`` -> 1048576 (binary units)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise ValueError(
            f"invalid size {text!r}: use a positive number of bytes, optionally with K, M or G "
            "(binary units), e.g. 64K, 1M, 1048576"
        )
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes, e.g. ``"64K,256K,1M,4M"``."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"invalid size list {text!r}: give sizes separated by commas, e.g. 64K,1M")
    return [parse_size(p) for p in parts]


def checked_chunk_sizes(sizes: Sequence[int]) -> list[int]:
    """``sizes`` sorted without duplicates; ValueError if one is beyond what the store sends."""
    for size in sizes:
        if not 0 < size <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk size {size} is out of range: the store sends chunks of 1 byte to "
                f"{MAX_CHUNK_BYTES >> 20} MiB"
            )
    return sorted(set(sizes))


def _run_bare_server(payload_bytes: int, ports: mp.Queue[int]) -> None:
    from concurrent import futures

    payload = bytes(payload_bytes)
    cut: dict[int, list[bytes]] = {}  # chunk size -> chunks; only the size in use is kept

    def stream(request: bytes, context: grpc.ServicerContext):
        size = int(request)
        if size not in cut:
            cut.clear()
            cut[size] = [payload[i : i + size] for i in range(0, payload_bytes, size)]
        yield from cut[size]

    handler = grpc.method_handlers_generic_handler(
        "lorastream.bench.Bare", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler], options=GRPC_OPTIONS)
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _run_store_server(cache_dir: str, digest: str, ports: mp.Queue[int]) -> None:
    from lorastream.store.config import StoreSettings
    from lorastream.store.server import create_server

    settings = StoreSettings(port=0, cache_dir=Path(cache_dir),  # adapters are made beside it
                             allowed_local_roots=[Path(cache_dir).parent], tensor_digest=digest)
    server, port, _ = create_server(settings)
    server.start()
    ports.put(port)
    server.wait_for_termination()


def _run_client(kind: str, target: str, conn: Connection) -> None:
    """A measuring client: on each chunk size from ``conn``, stream once and send back (bytes/s,
    this process's CPU seconds per MB); a size of 0 ends it."""
    if kind in KEEP_FREED_BUFFERS:
        keep_freed_buffers()
    if kind in BARE:
        # the store client's stream options (single-threaded unary-stream): the same gRPC path
        channel = open_channel(target, None, STREAM_GRPC_OPTIONS)
        call: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(_BARE_METHOD)

        def run(chunk_bytes: int) -> int:
            return sum(len(chunk) for chunk in call(str(chunk_bytes).encode()))
    else:
        client = StoreClient(target)
        # The worker lands adapters in its host arena, allocated once and faulted in at start
        # (--host-memory-prefault, on by default): so does this client, in buffers it keeps from
        # round to round (the warm-up round faults them in). Fresh buffers every round measured
        # the kernel's page faults (2 GB/s), not the landing.
        sink = BytesSink()

        def run(chunk_bytes: int) -> int:
            if kind == "store":
                chunks = client.iter_chunks("bench", chunk_bytes=chunk_bytes)
                return sum(len(c.data) for c in chunks)
            return client.stream_tensors("bench", sink, chunk_bytes=chunk_bytes).total_bytes

    while chunk_bytes := conn.recv():
        start, cpu = time.perf_counter(), time.process_time()  # every thread of the process
        nbytes = run(chunk_bytes)
        conn.send((nbytes / (time.perf_counter() - start),
                   (time.process_time() - cpu) / (nbytes / 1e6)))


def _start(target: Callable[..., None], *args: object) -> tuple[mp.process.BaseProcess, int]:
    ctx = mp.get_context("spawn")
    ports: mp.Queue[int] = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, ports), daemon=True)
    proc.start()
    return proc, ports.get(timeout=60)


def _measure(
    adapter_mb: float, chunk_sizes: Sequence[int], repeats: int, staging_mb: float
) -> tuple[int, int, dict[int, dict[str, list[float]]], dict[int, dict[str, list[float]]],
           dict[str, float], dict[str, object] | None]:
    """(adapter bytes, rank, chunk size -> client -> bytes/s of each measured round, the same
    -> the client's CPU seconds per MB, digest -> GB/s alone, the staging comparison or None)."""
    # Imported here: synthetic imports torch, which the spawned servers and clients do not need.
    from lorastream.bench.synthetic import (
        ALL_LINEAR,
        SMOLLM2_135M,
        adapter_nbytes,
        make_synthetic_adapter,
    )

    def rank_for(mb: float) -> int:
        return max(1, round(mb * 1e6 / adapter_nbytes(SMOLLM2_135M, 1, ALL_LINEAR)))

    rank = rank_for(adapter_mb)
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    rates: dict[int, dict[str, list[float]]] = {
        size: {kind: [] for kind in CLIENTS} for size in chunk_sizes}
    cpu: dict[int, dict[str, list[float]]] = {
        size: {kind: [] for kind in CLIENTS} for size in chunk_sizes}
    with tempfile.TemporaryDirectory(prefix="lorastream-bench-") as tmp:
        adapter_dir = make_synthetic_adapter(Path(tmp) / "adapter", rank=rank)
        hash_rates = measure_hash_rates(adapter_dir)
        try:
            store_ports: dict[str, int] = {}  # tensor digest -> its store's port
            for digest in VERIFIED.values():
                store_proc, store_ports[digest] = _start(
                    _run_store_server, str(Path(tmp) / f"cache-{digest}"), digest
                )
                procs.append(store_proc)
                with StoreClient(f"127.0.0.1:{store_ports[digest]}") as client:
                    for _event in client.preload(str(adapter_dir), "bench"):
                        pass
                    total = client.describe("bench").total_bytes
            bare_proc, bare_port = _start(_run_bare_server, total)
            procs.append(bare_proc)
            conns: dict[str, Connection] = {}
            for kind in CLIENTS:
                digest = VERIFIED.get(kind, DEFAULT_TENSOR_DIGEST)
                port = bare_port if kind in BARE else store_ports[digest]
                parent, child = ctx.Pipe()
                client_proc = ctx.Process(
                    target=_run_client, args=(kind, f"127.0.0.1:{port}", child), daemon=True
                )
                client_proc.start()
                procs.append(client_proc)
                conns[kind] = parent
            for size in chunk_sizes:
                for round_ in range(repeats + 1):  # round 0 warms up this chunk size
                    for kind, conn in conns.items():
                        conn.send(size)
                        rate, cpu_per_mb = conn.recv()
                        if round_:
                            rates[size][kind].append(rate)
                            cpu[size][kind].append(cpu_per_mb)
            for conn in conns.values():
                conn.send(0)
        finally:
            for proc in procs:
                proc.kill()
        staging = None
        if staging_mb > 0:  # after the stream rounds: the S3 server would compete with them
            from lorastream.bench.transfer_staging import measure_staging

            staged_dir = make_synthetic_adapter(Path(tmp) / "s3-adapter", rank=rank_for(staging_mb))
            staging = measure_staging(staged_dir, staging_repeats(repeats))
    return total, rank, rates, cpu, hash_rates, staging


def staging_repeats(repeats: int) -> int:
    """Rounds of the staging comparison: a third of the stream rounds (each takes seconds)."""
    return max(1, repeats // 3)


def measure_hash_rates(adapter_dir: Path) -> dict[str, float]:
    """GB/s of each tensor check alone, tensor by tensor over the adapter's weights, one thread
    (``blake3_auto``: BLAKE3 with its own thread pool, ``max_threads=AUTO``)."""
    import blake3

    from lorastream.core.adapter_validation import validate_adapter_dir
    from lorastream.core.checksum import crc32c, new_hasher

    validated = validate_adapter_dir(adapter_dir, tensor_digest=SHA256)
    data = memoryview((adapter_dir / "adapter_model.safetensors").read_bytes())
    tensors = [data[t.file_offset : t.file_offset + t.info.nbytes] for t in validated.tensors]

    def hashed(digest: str) -> Callable[[memoryview], object]:
        def run(tensor: memoryview) -> object:
            hasher = new_hasher(digest)
            hasher.update(tensor)
            return hasher.hexdigest()
        return run

    checks: dict[str, Callable[[memoryview], object]] = {
        "sha256": hashed(SHA256),
        "blake3": hashed(BLAKE3),
        "blake3_auto": lambda t: blake3.blake3(t, max_threads=blake3.blake3.AUTO).hexdigest(),
        "xxh3_128": hashed(XXH3_128),
        "crc32c": crc32c,
    }
    nbytes = sum(len(t) for t in tensors)
    rates: dict[str, float] = {}
    for name, check in checks.items():
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            for tensor in tensors:
                check(tensor)
            best = min(best, time.perf_counter() - start)
        rates[name] = round(nbytes / best / 1e9, 2)
    return rates


def _point(chunk_bytes: int, rates: dict[str, list[float]], cpu: dict[str, list[float]]
           ) -> dict[str, float]:
    """``<client>_mb_s``, ``<client>_vs_bare`` and ``<client>_cpu_ms_per_mb`` (the client
    process's CPU time) of every client; ``verified_*`` are those of the default digest's client.
    Ratios are medians over rounds of (rate / bare rate of the same round)."""
    median = statistics.median
    point: dict[str, float] = {"chunk_bytes": chunk_bytes}
    for kind in CLIENTS:
        point[f"{kind}_mb_s"] = round(median(rates[kind]) / 1e6, 1)
        point[f"{kind}_cpu_ms_per_mb"] = round(median(cpu[kind]) * 1e3, 3)
        if kind != "bare":
            ratios = [r / b for r, b in zip(rates[kind], rates["bare"], strict=True)]
            point[f"{kind}_vs_bare"] = round(median(ratios), 3)
    point["verified_mb_s"] = point[f"{DEFAULT_VERIFIED}_mb_s"]
    point["verified_vs_bare"] = point[f"{DEFAULT_VERIFIED}_vs_bare"]
    kept = [r / b for r, b in zip(rates[DEFAULT_VERIFIED], rates["bare_kept"], strict=True)]
    point["verified_vs_bare_kept"] = round(median(kept), 3)
    return point


def run_transfer_bench(
    adapter_mb: float = 96,
    chunk_bytes: int = HEADLINE_CHUNK_BYTES,
    repeats: int = 15,
    chunk_sizes: Sequence[int] | None = None,
    staging_mb: float = 78,
) -> dict[str, object]:
    """Stage a synthetic adapter of about ``adapter_mb`` MB and compare the streams at
    ``chunk_sizes`` (default: ``chunk_bytes`` alone); then, unless ``staging_mb`` is 0, preload
    one of about ``staging_mb`` MB from S3 against boto3's download of it.

    The top-level figures are those of the 1 MiB point when swept, else of the size nearest it."""
    sizes = checked_chunk_sizes(chunk_sizes or [chunk_bytes])
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    total, rank, rates, cpu, hash_rates, staging = _measure(adapter_mb, sizes, repeats,
                                                            staging_mb)
    points = [_point(size, rates[size], cpu[size]) for size in sizes]
    head = min(points, key=lambda p: abs(math.log2(p["chunk_bytes"] / HEADLINE_CHUNK_BYTES)))
    return {
        "benchmark": "transfer",
        "command": command_line(),
        "adapter_bytes": total,
        "adapter_rank": rank,
        "chunk_bytes": head["chunk_bytes"],
        "repeats": repeats,
        "bare_grpc_MBps": head["bare_mb_s"],
        "store_stream_MBps": head["store_mb_s"],
        "store_verified_MBps": head["verified_mb_s"],
        "store_vs_bare": head["store_vs_bare"],
        "store_verified_vs_bare": head["verified_vs_bare"],
        "verified_digest": DEFAULT_TENSOR_DIGEST,
        "verified_by_digest_vs_bare": {
            digest: head[f"{kind}_vs_bare"] for kind, digest in VERIFIED.items()
        },
        "goal": "store_vs_bare >= 0.8",
        "goal_met": head["store_vs_bare"] >= 0.8,
        "goal_verified": "store_verified_vs_bare >= 0.8",
        "goal_verified_met": head["verified_vs_bare"] >= 0.8,
        # against a bare client that keeps freed buffers too (KEEP_FREED_BUFFERS)
        "bare_kept_MBps": head["bare_kept_mb_s"],
        "store_verified_vs_bare_kept": head["verified_vs_bare_kept"],
        "goal_verified_kept": "store_verified_vs_bare_kept >= 0.8",
        "hash_GBps": hash_rates,
        "staging": staging,
        "points": points,
        "machine": machine_info(),
    }
