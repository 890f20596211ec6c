"""Registration through the store's ``PreloadAdapter`` RPC against the number of names.

The SQLite figure (``registry.py``) times the registry alone; this times what an operator waits
for: a real store server on loopback (port 0, local source, no worker), a ``PreloadAdapter``
stream from request to its last event, for a distinct tiny adapter each time (one float of
``lora_B`` changed, so each is new content: resolve, copy, validate, hash, fsync, commit,
register). Two figures:

- **sequence**: ``sequence`` adapters preloaded one after another into an empty store; the median
  of the last fifth over that of the first (the issue's 2,000: first 400 7 ms, last 400 22 ms).
- **counts**: one store per count N, each filled with N distinct adapters through the store core
  (``AdapterStore.push``, the UploadAdapter path, from bytes in memory, ``FILL_THREADS`` at a
  time: the fsyncs overlap), then ``registrations`` more preloads through the RPC in interleaved
  rounds across the counts, so the disk's drift falls on every count alike.

Goals: registrations/s through the RPC flat within 20% from the smallest to the largest N
(``goal``), and the sequence's last / first within 1.2 (``sequence.goal``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from safetensors.torch import save

from lorastream.bench.synthetic import BaseShape, synthetic_lora
from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.store_client import StoreClient
from lorastream.core.upload import UploadHeader, upload_items
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server
from lorastream.store.store import AdapterStore

__all__ = ["DistinctAdapters", "preload_ms", "run_rpc_registration", "served_store"]

# One rank-2 q_proj LoRA on one 16-wide layer: a few hundred bytes of tensors.
TINY_SHAPE = BaseShape(hidden=16, intermediate=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8)
FILL_THREADS = 16
ROUND = 10  # RPC registrations per count in each interleaved round
WARMUP = 10  # RPC registrations per store before timing (channel, threads, caches)


class DistinctAdapters:
    """Adapter ``i``: the same tiny PEFT LoRA with ``lora_B[0, 0] = i + 1``, as bytes."""

    def __init__(self) -> None:
        tensors, config = synthetic_lora(TINY_SHAPE, rank=2, targets=("q_proj",))
        self._config = json.dumps(config).encode()
        self._weights = save(tensors, metadata={"format": "pt"})
        (header_len,) = struct.unpack("<Q", self._weights[:8])
        header = json.loads(self._weights[8:8 + header_len])
        key = next(k for k in sorted(header) if k.endswith("lora_B.weight"))
        self._offset = 8 + header_len + header[key]["data_offsets"][0]  # lora_B's first float

    def files(self, i: int) -> list[tuple[str, bytes]]:
        weights = bytearray(self._weights)
        struct.pack_into("<f", weights, self._offset, float(i + 1))
        return [(CONFIG_FILE, self._config), (WEIGHTS_FILE, bytes(weights))]

    def write(self, i: int, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in self.files(i):
            (directory / name).write_bytes(data)
        return directory

    def push(self, store: AdapterStore, i: int, name: str) -> None:
        """Stage adapter ``i`` as ``name`` through the store core's push (no RPC, no files)."""
        items = upload_items(name, self.files(i))
        header = next(items)
        assert isinstance(header, UploadHeader)
        store.push(header, items)  # type: ignore[arg-type]  # the rest are chunks


def name_of(i: int) -> str:
    return f"tenant-{i:07d}/adapter"


@contextlib.contextmanager
def served_store(directory: Path, cache_bytes: int = 20 << 30
                 ) -> Iterator[tuple[StoreClient, AdapterStore]]:
    """A store server on 127.0.0.1, port 0, caching under ``directory``, local paths under
    ``directory / "src"`` allowed; a client of it. Stopped on exit."""
    sources = directory / "src"
    sources.mkdir(parents=True, exist_ok=True)
    settings = StoreSettings(port=0, cache_dir=directory / "cache", cache_bytes=cache_bytes,
                             allowed_local_roots=[sources], metrics_port=None)
    server, port, store = create_server(settings)
    server.start()
    try:
        with StoreClient(f"127.0.0.1:{port}") as client:
            yield client, store
    finally:
        server.stop(None).wait()


def preload_ms(client: StoreClient, adapters: DistinctAdapters, i: int, root: Path) -> float:
    """Write adapter ``i`` under ``root/src``, then time its PreloadAdapter stream (ms)."""
    directory = adapters.write(i, root / "src" / f"a{i:07d}")
    start = time.perf_counter()
    events = list(client.preload(str(directory), name_of(i)))
    took = (time.perf_counter() - start) * 1e3
    if events[-1].manifest is None:
        raise RuntimeError(f"the preload of {name_of(i)} ended without its manifest")
    return took


def fill(store: AdapterStore, adapters: DistinctAdapters, first: int, count: int) -> float:
    """Stage ``count`` adapters from ``first`` on through the store core; seconds taken."""
    start = time.perf_counter()
    with ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="fill") as pool:
        for done in pool.map(lambda i: adapters.push(store, i, name_of(i)),
                             range(first, first + count)):
            del done
    return time.perf_counter() - start


def _median(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": _median(ordered),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
            "mean_ms": round(statistics.fmean(ordered), 3)}


def _sequence(adapters: DistinctAdapters, count: int, root: Path) -> dict[str, object]:
    with served_store(root) as (client, _):
        samples = [preload_ms(client, adapters, i, root) for i in range(count)]
    fifth = max(1, count // 5)
    first, last = _median(samples[:fifth]), _median(samples[-fifth:])
    return {"adapters": count, "fifth": fifth, "first_p50_ms": first, "last_p50_ms": last,
            "last_over_first": round(last / first, 3), "goal": "last_over_first <= 1.2",
            "goal_met": last / first <= 1.2}


def run_rpc_registration(
    counts: tuple[int, ...], registrations: int, sequence: int, work_dir: Path | None = None
) -> dict[str, object]:
    """The RPC path's figures (module docstring): the sequence (skipped at 0) and the counts."""
    adapters = DistinctAdapters()
    root = Path(tempfile.mkdtemp(prefix="registry-rpc-", dir=work_dir))
    try:
        result: dict[str, object] = {}
        if sequence:
            result["sequence"] = _sequence(adapters, sequence, root / "sequence")
        with contextlib.ExitStack() as stack:
            stores = {n: stack.enter_context(served_store(root / f"n{n}")) for n in counts}
            fill_s = {n: round(fill(stores[n][1], adapters, 0, n), 1) for n in counts}
            timed: dict[int, list[float]] = {n: [] for n in counts}
            for n in counts:  # warm-up, not measured
                for i in range(n, n + WARMUP):
                    preload_ms(stores[n][0], adapters, i, root / f"n{n}")
            for done in range(0, registrations, ROUND):
                for n in counts:
                    first = n + WARMUP + done
                    timed[n] += [preload_ms(stores[n][0], adapters, i, root / f"n{n}")
                                 for i in range(first, first + min(ROUND, registrations - done))]
            names = {n: stores[n][1].count() for n in counts}
        points = [{"names": n, "names_after": names[n], "rpc": _summary(timed[n]),
                   "registrations_per_s": round(1e3 / _median(timed[n]), 1),
                   "samples": len(timed[n]), "fill_s": fill_s[n]} for n in counts]
        rates = [float(p["registrations_per_s"]) for p in points]  # type: ignore[arg-type]  # points: JSON-like dicts, this value a number
        spread = max(rates) / min(rates)
        result.update({
            "points": points,
            "registrations_per_s_spread": round(spread, 3),
            "goal": "registrations_per_s_spread <= 1.2",
            "goal_met": spread <= 1.2,
            "fill": f"AdapterStore.push from memory, {FILL_THREADS} threads",
        })
        return result
    finally:
        remove_tree(root)


def remove_tree(root: Path) -> None:
    """Delete ``root``: the staged adapter directories of its stores first, ``FILL_THREADS`` at
    a time (one by one, 111,000 of them took 7 minutes here; 8 threads delete them ~10x
    faster), then the rest."""
    staged = [entry.path for store in root.glob("*/cache/adapters")
              for entry in os.scandir(store)]
    with ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="cleanup") as pool:
        for done in pool.map(lambda path: shutil.rmtree(path, ignore_errors=True), staged):
            del done
    shutil.rmtree(root, ignore_errors=True)
