"""On the CPU, each of the engine's compute threads keeps one core of its own.

Why. A decode step runs its parallel ops on the engine's OpenMP team (two threads on two
cores here), which meet at a barrier after every op. The adapter fetch and the store run beside
it at SCHED_IDLE, on the time the team leaves. Left to the kernel, a short burst of other work at
normal priority (a kernel thread, the gRPC threads delivering tokens) can push one team thread
onto the other's core; the core it left then runs the SCHED_IDLE fetch, and the two team threads
time-slice one core until the load balancer moves one back -- which it is slow to do for threads
that ran a moment ago ("cache hot"). A scheduler trace (``perf sched``) of a slow decode step
during a load showed just that: both team threads alternating on one core while the other ran
the fetch (measured: docs/notes/loading.md, "Compute threads bound one per core on the CPU"). Bound
one per core, a team thread that is pushed aside waits for its own core instead, and the SCHED_IDLE
fetch yields that core the moment it wakes.

How. GNU OpenMP (torch's intra-op threading on Linux, MKL's too) gives every thread that runs a
parallel op a team of its own. :func:`bind_team` runs one parallel region through libgomp's
entry point (``GOMP_parallel``, what ``#pragma omp parallel`` compiles to) from the engine's
thread with the engine's thread count, and each thread of that team binds itself to one CPU --
what vLLM's CPU backend does in C++ (``init_cpu_threads_env``). The team is the same threads
every later op of that thread runs on.

When. Only when the team has exactly one thread per CPU this process may run on: then the
worker owns those cores (the default, one thread per core). With fewer threads, or several
workers sharing a bigger box, binding would stack them on the same first cores, so it is skipped.
When the engine's loop ends, :func:`unbind_team` frees the threads again.

Threads started later by a bound thread inherit its one-CPU mask: the adapter loaders, started
on demand, call :func:`release_thread` first (``threads.loader_thread_init``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading

log = logging.getLogger(__name__)

_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_process_cpus: frozenset[int] | None = None  # the CPUs of the process before a thread was bound


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line), None)
    except OSError:
        return None
    if path is None:
        return None
    gomp = ctypes.CDLL(path)
    gomp.omp_get_thread_num.restype = ctypes.c_int
    gomp.omp_set_num_threads.argtypes = [ctypes.c_int]
    gomp.omp_set_num_threads.restype = None
    gomp.GOMP_parallel.argtypes = [_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel.restype = None
    return gomp


def bind_team(threads: int) -> dict[int, int] | None:
    """Bind the calling thread's OpenMP team of ``threads`` threads one per CPU of this process.

    Returns ``{native thread id: cpu}`` of the team (the calling thread included), or None when
    it was not bound: fewer than two threads, not one per CPU, or no GNU OpenMP here (why is
    logged).
    """
    global _process_cpus
    cpus = sorted(os.sched_getaffinity(0))
    if threads < 2 or threads != len(cpus):
        log.info("compute threads not bound to cores: %d threads for %d CPUs", threads, len(cpus))
        return None
    gomp = _libgomp()
    if gomp is None:
        log.info("compute threads not bound to cores: no GNU OpenMP runtime in this process")
        return None
    bound: dict[int, int] = {}
    errors: list[BaseException] = []

    @_BODY
    def bind(_: int | None) -> None:  # runs on every thread of the team
        try:
            cpu = cpus[gomp.omp_get_thread_num()]
            os.sched_setaffinity(0, {cpu})
            bound[threading.get_native_id()] = cpu
        except BaseException as err:
            errors.append(err)

    _process_cpus = _process_cpus or frozenset(cpus)
    gomp.GOMP_parallel(bind, None, threads, 0)
    if errors or len(bound) != threads:
        unbind_team(bound)
        log.warning("compute threads not bound to cores: %s",
                    errors[0] if errors else f"a team of {len(bound)}, not {threads}")
        return None
    log.info("compute threads bound one per core: %s", sorted(bound.values()))
    return bound


def unbind_team(bound: dict[int, int]) -> None:
    """Let the threads of a team :func:`bind_team` bound run on every CPU of the process again
    (the engine's loop ends; its thread may go on to other work)."""
    assert _process_cpus is not None, "no team was bound"
    for tid in bound:
        with contextlib.suppress(OSError):  # the thread has exited
            os.sched_setaffinity(tid, _process_cpus)


def release_thread() -> None:
    """Let the calling thread run on every CPU of the process again, if a bound thread started
    it (threads inherit their creator's CPU mask)."""
    if _process_cpus is not None:
        os.sched_setaffinity(0, _process_cpus)


def set_openmp_threads_here(count: int) -> bool:
    """Make the calling thread's own parallel regions use ``count`` threads (OpenMP's per-thread
    ``nthreads`` setting), leaving torch's process-wide count alone; False where there is no
    GNU OpenMP runtime here (nothing changed). ``threads.use_one_intra_op_thread`` says why."""
    gomp = _libgomp()
    if gomp is None:
        return False
    gomp.omp_set_num_threads(count)
    return True
