"""The engine hands freed heap back to the OS once per idle period (device/host_memory.py): a
worker's resident memory after a busy spell falls back to what it holds."""

from __future__ import annotations

import ctypes
import time

import psutil
import pytest

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.device import host_memory
from lorastream.worker.engine import engine as engine_module
from tests.worker.conftest import EngineFactory


def test_a_trim_returns_freed_heap_to_the_os() -> None:
    """Many small blocks freed (all but the last, which pins the heap's top): their pages stay
    resident until the trim; a trim gives them back."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    process = psutil.Process()
    blocks = [libc.malloc(4096) for _ in range(40_000)]  # ~160 MB of the main heap
    for b in blocks:
        ctypes.memset(b, 1, 4096)
    for b in blocks[:-1]:
        libc.free(b)
    held = process.memory_info().rss
    assert host_memory.release_free_heap()
    released = held - process.memory_info().rss
    libc.free(blocks[-1])
    assert released > 100e6, f"the trim gave back {released / 1e6:.0f} MB of ~160 MB freed"


def test_the_engine_trims_once_per_idle_period_and_never_while_busy(
    engine_factory: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    trims: list[tuple[float, int]] = []
    engine = None

    def counting_trim() -> bool:
        assert engine is not None
        trims.append((time.monotonic(), engine.running))
        return True

    monkeypatch.setattr(engine_module, "release_free_heap", counting_trim)
    engine = engine_factory()
    time.sleep(0.2)
    assert trims == []  # never stepped: nothing to give back
    for round_ in range(2):
        streams = [engine.submit("tiny", PromptInput(token_ids=(5, 9, 33 + i)),
                                 SamplingParams(max_tokens=6)) for i in range(3)]
        for stream in streams:
            list(stream)
        deadline = time.monotonic() + 5
        while len(trims) < round_ + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # idle on: no second trim in the same idle period
        assert len(trims) == round_ + 1
    assert all(running == 0 for _, running in trims)
