"""Loader priorities (``--loader-priority``): set per thread, inherited by the threads it starts,
and a priority that does not exist is refused."""

from __future__ import annotations

import os
import threading

import pytest

from lorastream.worker.device.cpu.priority import (
    loader_priority,
    lower_priority,
    starvation_warning,
)


def _in_thread(priority: str) -> tuple[int, int, int, int]:
    """(policy, nice) of a thread after ``lower_priority``, and of a thread that one starts."""
    seen: list[tuple[int, int]] = []

    def probe() -> None:
        tid = threading.get_native_id()
        seen.append((os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)))

    def loader() -> None:
        lower_priority(priority)
        probe()
        child = threading.Thread(target=probe)
        child.start()
        child.join()

    thread = threading.Thread(target=loader)
    thread.start()
    thread.join()
    return (*seen[0], *seen[1])


@pytest.mark.parametrize(
    ("mode", "nice", "policy", "added"),
    [
        ("idle", 10, os.SCHED_IDLE, 0),
        ("nice", 5, os.SCHED_OTHER, 5),
        ("nice", 0, os.SCHED_OTHER, 0),
    ],
)
def test_a_loader_thread_and_the_threads_it_starts_run_at_the_loader_priority(
    mode: str, nice: int, policy: int, added: int,
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread_policy, thread_nice, child_policy, child_nice = _in_thread(loader_priority(mode, nice))
    assert (thread_policy, thread_nice) == (policy, base + added)
    assert (child_policy, child_nice) == (policy, base + added)
    me = threading.get_native_id()  # the caller's own thread is left alone
    assert (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me)) == (
        os.SCHED_OTHER, base)


def test_an_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown loader priority 'fast'"):
        lower_priority("fast")


@pytest.mark.parametrize(
    ("priority", "openmp_waits_actively", "warned"),
    [("idle", True, True), ("idle", False, False), ("nice:10", True, False)],
)
def test_idle_loaders_under_spinning_openmp_are_warned_about(
    priority: str, openmp_waits_actively: bool, warned: bool,
) -> None:
    warning = starvation_warning(priority, openmp_waits_actively)
    assert (warning is not None) == warned
    if warned:
        assert "--loader-priority nice" in str(warning)
