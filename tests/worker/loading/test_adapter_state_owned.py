"""The adapter manager owns adapter state: nothing outside ``loading/`` reads or writes an
``AdapterEntry``; inside it, only the entry's own methods assign its fields, only
``AdapterRecords`` holds the entries and names, and only ``LoraSlots`` writes its slot table; the
manager's collaborators get neither its maps, nor its lock, nor callbacks into it; the manager's
API neither takes nor returns an entry; an operator's load waits on events, never polls with
sleeps."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import threading
import time
from pathlib import Path

import pytest

from lorastream.worker.device.device import HostEvent
from lorastream.worker.loading.adapter import AdapterEntry
from lorastream.worker.loading.fetch import HostLoader
from lorastream.worker.loading.manager import AdapterManager
from lorastream.worker.loading.names import NameResolver
from lorastream.worker.lora.slots import SlotInfo
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import EngineFactory, StoreStack

ROOT = Path(__file__).resolve().parents[3]
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
        if isinstance(node, ast.ImportFrom) and node.module == "lorastream.worker.loading.adapter":
            found.extend(f"{node.lineno}: imports {alias.name}" for alias in node.names
                         if alias.name in {"AdapterEntry", "Residency"})
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
        ("from lorastream.worker.loading.adapter import AdapterEntry", True),
        ("from lorastream.worker.loading.adapter import adapter_weights", False),
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


ENTRY_FIELDS = {f.name for f in dataclasses.fields(AdapterEntry)}
RECORD_MAPS = {"_entries", "_names", "_pin_next"}  # AdapterRecords' own


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment, augmented assignment or ``del`` writes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        else:
            flat.append(target)
    return flat


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in {"self", "cls"}


def entry_field_writes(source: str) -> list[str]:
    """Every place in ``source`` that assigns a field an ``AdapterEntry`` has to an object
    other than ``self`` (line: what): in ``loading/`` only the entry's methods may."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            if (isinstance(target, ast.Attribute) and target.attr in ENTRY_FIELDS
                    and not _is_self(target.value)):
                found.append(f"{target.lineno}: {ast.unparse(target)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _is_table(node: ast.expr) -> bool:
    """``<x>.table`` or ``<x>.table[<i>]``."""
    if isinstance(node, ast.Subscript):
        node = node.value
    return isinstance(node, ast.Attribute) and node.attr == "table"


def slot_table_writes(source: str) -> list[str]:
    """Every place in ``source`` that writes a slot table or one of its slots (line: what)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            if (isinstance(target, ast.Subscript) and _is_table(target.value)) or (
                isinstance(target, ast.Attribute) and _is_table(target.value)
                and isinstance(target.value, ast.Subscript)
            ):
                found.append(f"{target.lineno}: {ast.unparse(target)}")
        if (isinstance(node, ast.Attribute) and _is_table(node.value)
                and node.attr in {"__setitem__", "append", "insert", "clear", "pop", "extend"}):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def record_map_uses(source: str) -> list[str]:
    """Every place in ``source`` that names one of ``AdapterRecords``' maps (line: what)."""
    return [
        f"{node.lineno}: .{node.attr}" for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr in RECORD_MAPS
    ]


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("entry.refs += 1", True),
        ("entry.slot, entry.slot_event = None, None", True),
        ("victim.weights = None", True),
        ("self._entries[i].pinned = True", True),
        ("del entry.error", True),
        ("setattr(entry, 'pinned', True)", True),
        ("self.refs += 1; self.slot = slot", False),  # the entry's own methods
        ("entry.pin(); entry.take_slot(3); n = entry.refs", False),
    ],
)
def test_the_scan_flags_writing_an_entrys_fields(source: str, flagged: bool) -> None:
    assert bool(entry_field_writes(source)) is flagged


@pytest.mark.parametrize(
    ("source", "flagged"),
    [
        ("self.slots.table[slot].adapter_id = entry.adapter_id", True),
        ("slots.table[3] = SlotInfo()", True),
        ("self.table.append(SlotInfo())", True),
        ("ops.append(partial(self.slots.table.__setitem__, slot, info))", True),
        ("rank = slots.table[s].rank; self.slots.claim(slot, adapter_id)", False),
        ("table = block_table[first:][None]; table[0] = 1", False),
    ],
)
def test_the_scan_flags_writing_a_slot_table(source: str, flagged: bool) -> None:
    assert bool(slot_table_writes(source)) is flagged


def _sources(root: Path, *, but: Path) -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for path in sorted(root.rglob("*.py")) if path != but
    }


def _without_class(source: str, name: str) -> str:
    """``source`` with the body of ``class name`` blanked: the owner's own methods are left out."""
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            assert node.end_lineno is not None
            lines[node.lineno - 1:node.end_lineno] = ["\n"] * (node.end_lineno - node.lineno + 1)
    return "".join(lines)


def test_only_an_entry_assigns_its_fields() -> None:
    sources = _sources(OWNER, but=OWNER / "adapter.py")
    sources["lorastream/worker/loading/adapter.py"] = _without_class(
        (OWNER / "adapter.py").read_text(), "AdapterEntry")
    assert {"lorastream/worker/loading/manager.py", "lorastream/worker/loading/device_tier.py",
            "lorastream/worker/loading/host.py"} <= set(sources)
    found = {path: hits for path, source in sources.items()
             if (hits := entry_field_writes(source))}
    assert not found, f"entry fields assigned outside AdapterEntry's methods: {found}"


def test_only_the_slots_write_their_table() -> None:
    sources = _sources(ROOT / "lorastream", but=WORKER / "lora" / "slots.py")
    found = {path: hits for path, source in sources.items()
             if (hits := slot_table_writes(source))}
    assert not found, f"slot table written outside LoraSlots: {found}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        SlotInfo().adapter_id = "x"  # type: ignore[misc]  # a slot's record cannot be edited


def test_only_the_records_hold_the_entries_and_names() -> None:
    sources = _sources(OWNER, but=OWNER / "names.py")
    sources["lorastream/worker/loading/names.py"] = _without_class(
        (OWNER / "names.py").read_text(), "AdapterRecords")
    found = {path: hits for path, source in sources.items() if (hits := record_map_uses(source))}
    assert not found, f"AdapterRecords' maps named outside it: {found}"


@pytest.mark.parametrize("collaborator", [NameResolver, HostLoader])
def test_collaborators_get_no_lock_map_or_callback(collaborator: type) -> None:
    """The manager's collaborators get narrow objects: not its lock or condition, not a map
    of its entries, not a function to call back into it."""
    parameters = inspect.signature(collaborator.__init__).parameters  # type: ignore[misc]  # reading __init__ off the class
    wide = {
        name: str(parameter.annotation) for name, parameter in parameters.items()
        if any(kind in str(parameter.annotation)
               for kind in ("Lock", "Condition", "dict", "Callable", "Executor"))
    }
    assert not wide, f"{collaborator.__name__} is handed the manager's internals: {wide}"


def test_the_managers_api_neither_takes_nor_returns_an_entry() -> None:
    public = {
        name: member for name, member in inspect.getmembers(AdapterManager)
        if not name.startswith("_") and callable(member)
    }
    assert {"acquire", "release", "prepare_step", "place", "load", "status"} <= set(public)
    leaks = [name for name, member in public.items() if "Entry" in str(inspect.signature(member))]
    assert not leaks, f"public methods that take or return adapter records: {leaks}"


def test_loads_never_sleep_to_wait() -> None:
    waiters = ("manager.py", "fetch.py", "device_tier.py")
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
    """Behaviour, not timing: the caller never sleeps, and every wait of its own ends because
    something it waits on happened (a wait that runs out its timeout is a poll), the last after
    the copy into the slot landed."""
    engine = engine_factory(store=store.target)
    engine.adapters.fetcher.chunk_delay_s = chunk_delay_s
    engine.device.load_stream.copy_delay_s = copy_delay_s
    caller = threading.get_ident()
    slept: list[float] = []
    order: list[str] = []  # "landed" (a copy into a slot completed), "woken", "timed out"
    real_sleep, real_set, real_wait = time.sleep, HostEvent.set, HostEvent.wait
    real_condition_wait = threading.Condition.wait

    def recording_sleep(seconds: float) -> None:
        if threading.get_ident() == caller:
            slept.append(seconds)
        real_sleep(seconds)

    def recording_set(self: HostEvent, error: BaseException | None = None) -> None:
        if threading.current_thread().name == "load-stream":
            order.append("landed")
        real_set(self, error)

    def woken(result: bool, timeout: float | None) -> bool:
        if threading.get_ident() == caller and timeout != 0:  # 0: a try, not a wait
            order.append("woken" if result else "timed out")
        return result

    monkeypatch.setattr(time, "sleep", recording_sleep)
    monkeypatch.setattr(HostEvent, "set", recording_set)
    monkeypatch.setattr(HostEvent, "wait", lambda self, timeout=None: woken(
        real_wait(self, timeout), timeout))
    monkeypatch.setattr(threading.Condition, "wait", lambda self, timeout=None: woken(
        real_condition_wait(self, timeout), timeout))
    status = WorkerOperations(engine).load_adapter("attn-r4")
    assert status.residency == "device" and status.slot >= 0 and status.references == 0
    assert not slept, f"the load polled with time.sleep: {slept[:5]}"
    assert "timed out" not in order, f"the load polled with timed waits: {order}"
    assert "landed" in order and "woken" in order, order  # it did wait, for the copy
