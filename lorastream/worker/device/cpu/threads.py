"""Thread counts and priorities on the CPU: the engine's thread computes on several intra-op
(OpenMP) threads; every other thread that touches torch (loaders, request handlers) runs its ops on
one, and loader threads run at the loader priority (SCHED_IDLE by default, ``priority.py`` says
why), the CPU counterpart of a low-priority CUDA stream: decoding keeps the cores, loads use the
gaps."""

from __future__ import annotations

import logging
import threading

import torch

from lorastream.worker.device.cpu.binding import release_thread, set_openmp_threads_here
from lorastream.worker.device.cpu.priority import lower_priority

log = logging.getLogger(__name__)


def use_intra_op_threads(count: int) -> None:
    """Make the calling thread the one that computes, on ``count`` intra-op (OpenMP) threads.

    Why the worker cares: GNU OpenMP gives every thread that runs a parallel torch op a pool of
    its own, and once the process holds more OpenMP threads than there are cores it stops
    spin-waiting between parallel regions ("throttled" waits). A decode step runs hundreds of
    small parallel ops (the LoRA matmuls); each then pays a futex wake-up, and the steps slow
    down (measured: docs/notes/engine.md, "One thread computes with OpenMP"). So one thread of the
    process, the engine's, computes with several threads and every other thread that touches torch
    (loaders, request handlers) calls :func:`use_one_intra_op_thread`.

    ``torch.set_num_threads`` also sets torch's process-wide count, which every thread adopts
    lazily at its first parallel op -- and which every C++ extension adopts again on its own
    (``at::parallel_for`` is inline: each shared object keeps its own per-thread "adopted" flag).
    Only the computing thread may set it. ``get_num_threads`` makes this thread's adoption in
    libtorch happen now, before the count is set.
    """
    torch.get_num_threads()
    torch.set_num_threads(count)


def use_one_intra_op_thread() -> None:
    """Run the calling thread's torch CPU ops on one thread, leaving the engine's count alone.

    Only this thread's OpenMP setting changes (``cpu/binding.py``: ``set_openmp_threads_here``),
    never
    torch's process-wide count: a request thread that lowered that to 1 with
    ``torch.set_num_threads(1)`` took the engine's second core away at the engine's first C++ op
    (``lorastream/kernels/cpu/csrc``): the extension adopted the process-wide count on the engine's
    thread (previous paragraph), and every later step ran on one thread with the other core idle.
    """
    torch.get_num_threads()  # libtorch's adoption first: it would undo the setting below
    if not set_openmp_threads_here(1):
        log.debug("no GNU OpenMP runtime: %s keeps torch's thread count",
                  threading.current_thread().name)


def loader_thread_init(priority: str) -> None:
    """Thread initializer of loader threads (store fetch, CPU copies): ``priority`` (``idle`` or
    ``nice:N``), every CPU of the process (an engine thread bound to one core may start it), and
    torch on one intra-op thread so that decoding keeps the only multi-threaded OpenMP pool."""
    release_thread()
    lower_priority(priority)
    use_one_intra_op_thread()
