"""Registration cost and listing latency against the number of names already registered.

For each count N the store's registry (SQLite, WAL, ``synchronous=FULL``) is filled with N names
in one transaction, then ``registrations`` more names are registered one at a time, each its own
durable transaction, as a preload does; registrations/s follow from their median. A
``ListAdapters`` page (1000 names, from the middle of the name order) is timed at the same N. In
the same run the previous scheme is measured as the baseline: the whole name table rewritten as
JSON, fsynced and renamed into place on every registration (what ``registry.json`` did), at the
same N. The goal: registrations/s flat within 20% from 1k to 100k names, while the JSON baseline
falls with N.

Beside it, under ``rpc``, the same counts through the store's ``PreloadAdapter`` RPC end to end
(``registry_rpc.py``: what an operator waits for, each a distinct adapter staged and registered),
with its own goal: the SQLite layer stayed flat while the RPC path grew 3x over 2,000 names
(before the registry kept its eviction order as names change), so both are measured and
both must be flat.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.registry_rpc import run_rpc_registration
from lorastream.store.registry import Registry, RegistryEntry

DEFAULT_COUNTS = (1_000, 10_000, 100_000)
PAGE = 1_000  # names per ListAdapters page, the store's largest
ROUND = 10  # registrations per count in each interleaved round


def _entry(i: int) -> RegistryEntry:
    name = f"customer-{i:07d}/adapter"
    now = time.time()
    return RegistryEntry(name, f"{i:064x}", f"s3://adapters/{name}", "etag", now, now, False)


def _put(registry: Registry, i: int) -> None:
    registry.put(_entry(i))


def _timed(register: Callable[[int], None], first: int, count: int) -> list[float]:
    """Milliseconds of each of ``count`` registrations, names ``first`` onwards."""
    samples = []
    for i in range(first, first + count):
        start = time.perf_counter()
        register(i)
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def _json_rewrite(directory: Path, names: dict[str, dict[str, object]]) -> Callable[[int], None]:
    """The previous registry: every registration rewrites, fsyncs and renames the whole file."""
    path = directory / "registry.json"

    def register(i: int) -> None:
        entry = _entry(i)
        names[entry.name] = vars(entry)
        temp = path.with_name(".registry.json.tmp")
        with temp.open("w") as f:
            json.dump({"format": 1, "names": sorted(names.values(), key=lambda e: e["name"])}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)

    return register


def _page_ms(registry: Registry, n: int, repeats: int = 20) -> list[float]:
    """Milliseconds to read one page of PAGE names starting in the middle of the order."""
    after = _entry(n // 2).name
    expected = min(PAGE, len(registry) - n // 2 - 1)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        page = registry.matching(after=after, limit=PAGE)
        samples.append((time.perf_counter() - start) * 1e3)
        if len(page) != expected:
            raise RuntimeError(f"a page after the middle of {n} names held {len(page)}")
    return samples


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered), 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def run_registry_bench(
    counts: tuple[int, ...] = DEFAULT_COUNTS,
    registrations: int = 400,
    json_registrations: int = 20,
    work_dir: Path | None = None,
    rpc_sequence: int = 2000,
    rpc: bool = True,
) -> dict[str, object]:
    """Per-registration latency at each count, SQLite registry against the JSON baseline, and
    (``rpc``) through the PreloadAdapter RPC: ``registrations`` at each count and a sequence of
    ``rpc_sequence`` preloads into an empty store (0: none).

    The counts' registries are all filled first, then registered into in interleaved rounds of
    ``ROUND`` registrations each, so that the disk's drift over the run falls on every count
    alike; a warm-up registry takes the process's first, slower registrations.
    """
    with contextlib.ExitStack() as stack:
        dirs = {n: Path(stack.enter_context(tempfile.TemporaryDirectory(
            dir=work_dir, prefix=f"registry-bench-{n}-"))) for n in (0, *counts)}
        registries = {n: Registry(dirs[n]) for n in dirs}
        for n in counts:
            registries[n].put_many(_entry(i) for i in range(n))
            registries[n].checkpoint()  # the fill's log folded in: each starts with an empty WAL
        _timed(lambda i: registries[0].put(_entry(i)), 0, ROUND * 4)  # warm-up, not measured
        sqlite: dict[int, list[float]] = {n: [] for n in counts}
        for done in range(0, registrations, ROUND):
            for n in counts:
                sqlite[n] += _timed(partial(_put, registries[n]), n + done,
                                    min(ROUND, registrations - done))
        pages = {n: _page_ms(registries[n], n) for n in counts}
        for registry in registries.values():
            registry.close()
        points = []
        for n in counts:
            table = {e.name: vars(e) for e in map(_entry, range(n))}
            baseline = _timed(_json_rewrite(dirs[n], table), n, json_registrations)
            summary = _summary(sqlite[n])
            points.append({
                "names": n, "sqlite": summary, "json_rewrite": _summary(baseline),
                "registrations_per_s": round(1e3 / summary["p50_ms"], 1),
                "json_registrations_per_s": round(1e3 / _summary(baseline)["p50_ms"], 2),
                "list_page_ms": _summary(pages[n]), "list_page_names": PAGE,
                "sqlite_samples": len(sqlite[n]), "json_samples": len(baseline),
            })
    rates = [float(p["registrations_per_s"]) for p in points]  # type: ignore[arg-type]  # points: JSON-like dicts, this value a number
    spread = max(rates) / min(rates)
    first, last = points[0], points[-1]
    growth = last["sqlite"]["p50_ms"] / first["sqlite"]["p50_ms"]  # type: ignore[index]  # points: JSON-like dicts, this value a dict
    json_growth = last["json_rewrite"]["p50_ms"] / first["json_rewrite"]["p50_ms"]  # type: ignore[index]  # points: JSON-like dicts, this value a dict
    through_rpc = (run_rpc_registration(counts, registrations, rpc_sequence, work_dir)
                   if rpc else None)
    return {
        "benchmark": "registry",
        "command": command_line(),
        "counts": list(counts),
        "sqlite_p50_growth": round(growth, 2),
        "json_rewrite_p50_growth": round(json_growth, 2),
        # fastest over slowest registrations/s across the counts: flat within 20%
        "registrations_per_s_spread": round(spread, 3),
        "goal": "registrations_per_s_spread <= 1.2",
        "goal_met": spread <= 1.2,
        "points": points,
        "rpc": through_rpc,
        "machine": machine_info(bandwidth=False),
    }
