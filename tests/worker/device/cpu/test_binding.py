"""The engine's compute threads, bound one per core on the CPU (``cpu_binding.py``): the threads
bound are the ones torch computes on, each on a core of its own; loader threads a bound thread
starts run on every core; the binding ends with the engine's loop, and is skipped where the
threads do not match the cores."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.device.cpu.binding import bind_team, release_thread, unbind_team
from lorastream.worker.device.cpu.threads import loader_thread_init
from tests.worker.conftest import PROMPTS, EngineFactory

T = TypeVar("T")
CPUS = frozenset(os.sched_getaffinity(0))

pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="binding needs two CPUs or more")


def on_new_thread(work: Callable[[], T]) -> T:
    """``work()`` on a thread of its own (its torch team and CPU mask die with it)."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as err:
            failure.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _cpu_ns(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/schedstat") as stat:
        return int(stat.read().split()[0])


def _threads_that_compute() -> set[int]:
    """Native ids of the threads that ran a parallel matmul of the calling thread."""
    before = {int(tid): _cpu_ns(int(tid)) for tid in os.listdir("/proc/self/task")}
    a = torch.randn(1024, 1024)
    for _ in range(20):
        torch.mm(a, a)
    busy = set()
    for tid, ns in before.items():
        try:
            if _cpu_ns(tid) - ns > 5_000_000:  # 5 ms of the ~100+ each thread computed
                busy.add(tid)
        except FileNotFoundError:
            pass
    return busy


def test_the_team_torch_computes_on_is_bound_one_thread_per_core() -> None:
    def bind_and_compute() -> tuple[dict[int, int] | None, set[int], dict[int, set[int]]]:
        torch.set_num_threads(len(CPUS))
        torch.mm(torch.ones(256, 256), torch.ones(256, 256))  # the team exists before binding
        bound = bind_team(len(CPUS))
        computing = _threads_that_compute()
        masks = {tid: os.sched_getaffinity(tid) for tid in bound or {}}
        if bound:
            unbind_team(bound)
            masks_after = {tid: os.sched_getaffinity(tid) for tid in bound}
            assert all(mask == CPUS for mask in masks_after.values()), masks_after
        return bound, computing, masks

    bound, computing, masks = on_new_thread(bind_and_compute)
    assert bound is not None and len(bound) == len(CPUS)
    assert computing <= set(bound), "torch computed on threads that were not bound"
    assert len(computing) == len(CPUS)
    assert sorted(bound.values()) == sorted(CPUS)  # one core each, every core once
    assert all(masks[tid] == {cpu} for tid, cpu in bound.items()), masks


@pytest.mark.parametrize("threads", [1, len(CPUS) + 1])
def test_no_binding_when_the_threads_do_not_match_the_cores(threads: int) -> None:
    def bind() -> tuple[dict[int, int] | None, set[int]]:
        torch.set_num_threads(threads)
        return bind_team(threads), os.sched_getaffinity(0)

    bound, mask = on_new_thread(bind)
    assert bound is None
    assert mask == CPUS


@pytest.mark.parametrize("init", [release_thread, lambda: loader_thread_init("nice:0")],
                         ids=["release_thread", "loader_thread_init"])
def test_a_thread_a_bound_thread_starts_runs_on_every_core(init: Callable[[], None]) -> None:
    def start_a_thread() -> tuple[set[int], set[int], set[int]]:
        torch.set_num_threads(len(CPUS))
        bound = bind_team(len(CPUS))
        assert bound is not None
        seen: list[set[int]] = []

        def child() -> None:
            seen.append(os.sched_getaffinity(0))  # inherited from the bound thread
            init()
            seen.append(os.sched_getaffinity(0))

        on_new_thread(child)
        own = os.sched_getaffinity(0)
        unbind_team(bound)
        return own, seen[0], seen[1]

    own, inherited, released = on_new_thread(start_a_thread)
    assert len(own) == 1 and inherited == own
    assert released == CPUS


@pytest.mark.parametrize("bind", [True, False], ids=["bind-on", "bind-off"])
def test_the_engine_binds_its_compute_threads_while_its_loop_runs(
    engine_factory: EngineFactory, bind: bool
) -> None:
    engine = engine_factory(start=False, bind_compute_threads=bind)
    engine.compute_threads = len(CPUS)

    def during_the_loop() -> tuple[dict[int, int] | None, int]:
        stream = engine.submit("tiny", PromptInput(token_ids=tuple(PROMPTS[0])),
                               SamplingParams(max_tokens=2, ignore_eos=True))
        assert sum(len(event.token_ids) for event in stream) == 2  # the loop is stepping
        assert engine._loop_thread is not None
        return engine.bound_threads, engine._loop_thread.native_id or 0

    bound, loop_tid = engine.run_while(during_the_loop)
    if bind:
        assert bound is not None and loop_tid in bound and len(bound) == len(CPUS)
    else:
        assert bound is None
    assert os.sched_getaffinity(0) == CPUS  # the loop ran here; its binding ended with it
