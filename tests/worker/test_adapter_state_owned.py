"""The adapter manager owns adapter state (issue 24): nothing outside ``loading/`` reads or
writes an ``AdapterEntry``, the manager's API neither takes nor returns one, and an operator's
load waits on events, never polls with sleeps."""

from __future__ import annotations

import ast
import inspect
import threading
import time
from pathlib import Path

import pytest

from lorastream.worker.device.device import HostEvent
from lorastream.worker.loading.manager import AdapterManager
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import EngineFactory, StoreStack

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "lorastream" / "worker"
OWNER = WORKER / "loading"
# Code that drives the worker from above: the engine's own modules, its service, the benchmarks.
SCANNED = [WORKER, ROOT / "lorastream" / "bench", ROOT / "lorastream" / "stack"]

# Fields an adapter's record has and nothing else in the worker does.
ENTRY_ONLY = {
    "slot_event", "refs", "host_offset", "host_bytes", "last_used", "fetch_started",
    "copy_started", "copying", "_entries", "_names", "entries",
}
# Fields other objects share (a sequence's slot, a device event's error, the manager's
# ``fetching``, a request's ``local_path``): flagged only on an expression that names an
# adapter or an entry.
SHARED = {"slot", "error", "weights", "fetching", "pinned", "residency", "manifest", "local_path"}
ENTRY_NAMES = {"adapter", "entry", "AdapterEntry", "Residency"}


def _holder(node: ast.expr) -> str:
    """The last name in the expression an attribute is read from: ``seq.adapter`` -> adapter."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _holder(node.func)
    if isinstance(node, ast.Subscript):
        return _holder(node.value)
    return ""


def entry_accesses(source: str) -> list[str]:
    """Every place in ``source`` that reaches into adapter records (line: what)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "lorastream.worker.loading.entry":
            found.append(f"{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Name) and node.id in {"AdapterEntry", "Residency"}:
            found.append(f"{node.lineno}: names {node.id}")
        elif isinstance(node, ast.Attribute):
            if node.attr in ENTRY_ONLY:
                found.append(f"{node.lineno}: .{node.attr}")
            elif node.attr in SHARED and _holder(node.value) in ENTRY_NAMES:
                found.append(f"{node.lineno}: {_holder(node.value)}.{node.attr}")
    return found


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("from lorastream.worker.loading.entry import AdapterEntry", True),
        ("x: AdapterEntry | None = None", True),
        ("if entry.slot_event is not None: pass", True),
        ("n = sum(e.refs for e in manager.entries())", True),
        ("err = seq.adapter.error", True),
        ("slot = entry.slot", True),
        ("manager._entries.clear()", True),
        ("seq.slot = -1; failed = event.error; busy = self.adapters.fetching", False),
        ("ready = self.adapters.ready(seq.adapter_id)", False),
    ],
)
def test_the_scan_flags_reaching_into_adapter_records(source: str, flagged: bool) -> None:
    assert bool(entry_accesses(source)) is flagged


def test_no_module_outside_loading_touches_adapter_records() -> None:
    scanned = [
        path for root in SCANNED for path in sorted(root.rglob("*.py"))
        if OWNER not in path.parents
    ]
    assert len(scanned) > 20
    found = {
        str(path.relative_to(ROOT)): hits for path in scanned
        if (hits := entry_accesses(path.read_text()))
    }
    assert not found, f"adapter state read outside loading/: {found}"


def test_the_managers_api_neither_takes_nor_returns_an_entry() -> None:
    public = {
        name: member for name, member in inspect.getmembers(AdapterManager)
        if not name.startswith("_") and callable(member)
    }
    assert {"acquire", "release", "prepare_step", "place", "load", "status"} <= set(public)
    leaks = [name for name, member in public.items() if "Entry" in str(inspect.signature(member))]
    assert not leaks, f"public methods that take or return adapter records: {leaks}"


def test_loads_never_sleep_to_wait() -> None:
    waiters = ("manager.py", "host_loader.py", "device_tier.py")
    for path in (WORKER / "service" / "operations.py", *(OWNER / name for name in waiters)):
        calls = [
            node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr == "sleep"
        ]
        assert not calls, f"{path.name} sleeps at lines {calls}"


@pytest.mark.parametrize(
    ("chunk_delay_s", "copy_delay_s"),
    [(0.3, 0.0), (0.0, 0.3)],
    ids=["slow-fetch", "slow-copy"],
)
def test_a_load_waits_on_events_and_returns_as_soon_as_the_copy_landed(
    engine_factory: EngineFactory, store: StoreStack, monkeypatch: pytest.MonkeyPatch,
    chunk_delay_s: float, copy_delay_s: float,
) -> None:
    engine = engine_factory(store=store.target)
    engine.adapters.fetcher.chunk_delay_s = chunk_delay_s
    engine.device.load_stream.copy_delay_s = copy_delay_s
    caller = threading.get_ident()
    slept: list[float] = []
    landed: list[float] = []
    real_sleep, real_set = time.sleep, HostEvent.set

    def recording_sleep(seconds: float) -> None:
        if threading.get_ident() == caller:
            slept.append(seconds)
        real_sleep(seconds)

    def recording_set(self: HostEvent, error: BaseException | None = None) -> None:
        if threading.current_thread().name == "load-stream":  # a copy into a slot completed
            landed.append(time.perf_counter())
        real_set(self, error)

    monkeypatch.setattr(time, "sleep", recording_sleep)
    monkeypatch.setattr(HostEvent, "set", recording_set)
    started = time.perf_counter()
    status = WorkerOperations(engine).load_adapter("attn-r4")
    returned = time.perf_counter()
    assert status.residency == "device" and status.slot >= 0 and status.references == 0
    assert returned - started >= 0.3  # it did wait for the slow part ...
    assert not slept, f"the load polled with time.sleep: {slept[:5]}"  # ... on events
    assert landed and returned - landed[-1] < 0.2, "the load returned late after its copy"
