"""Where the engine computes: its loop on the calling thread (as in the worker process), one
multi-threaded torch pool (the loop's), and a graceful stop of `lorastream worker serve` on a
signal while a stream is in flight."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.grpc_service import serve_until_signalled
from lorastream.core.worker_client import WorkerClient
from lorastream.stack.launcher import wait_serving
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import PROMPTS, EngineFactory


def _prompt(i: int = 0) -> PromptInput:
    return PromptInput(token_ids=tuple(PROMPTS[i]))


def _record_step_threads(engine: Engine) -> list[tuple[threading.Thread, int]]:
    """(thread, torch intra-op threads) of every step the engine runs from now on."""
    seen: list[tuple[threading.Thread, int]] = []
    step = engine._step

    def recording(plan):
        seen.append((threading.current_thread(), torch.get_num_threads()))
        step(plan)

    engine._step = recording  # type: ignore[method-assign]  # a recording wrapper around the method
    return seen


@pytest.fixture
def torch_threads() -> Iterator[Callable[[int], None]]:
    """Set this thread's torch intra-op threads for the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_run_while_runs_the_loop_on_the_calling_thread_and_stops_after_the_work(
    engine_factory: EngineFactory, tiny_adapters: dict[str, Path]
) -> None:
    engine = engine_factory(start=False)
    steps = _record_step_threads(engine)

    def work() -> list[int]:
        WorkerOperations(engine).load_adapter("mlp-r8", str(tiny_adapters["mlp-r8"]))
        stream = engine.submit("mlp-r8", _prompt(), SamplingParams(max_tokens=5, ignore_eos=True))
        return [t for event in stream for t in event.token_ids]

    tokens = engine.run_while(work)
    assert len(tokens) == 5
    assert steps and {thread for thread, _ in steps} == {threading.current_thread()}
    assert not engine.started
    with pytest.raises(errors.SourceUnavailable, match="shutting down"):
        engine.submit("tiny", _prompt(), SamplingParams(max_tokens=2))


def test_run_while_raises_what_the_work_raised_and_ends_its_requests(
    engine_factory: EngineFactory,
) -> None:
    engine = engine_factory(start=False)
    left: list[object] = []

    def work() -> None:
        stream = engine.submit("tiny", _prompt(), SamplingParams(max_tokens=1000, ignore_eos=True))
        next(stream)  # decoding
        left.append(stream)
        raise ValueError("the driver failed")

    with pytest.raises(ValueError, match="the driver failed"):
        engine.run_while(work)
    with pytest.raises(errors.SourceUnavailable, match="shutting down"):
        list(left[0])  # type: ignore[call-overload]  # left is list[object]: it holds a stream
    assert engine.healthy_after_stop()


@pytest.mark.parametrize("start", ["own thread", "calling thread"])
def test_only_the_engine_loop_computes_with_several_torch_threads(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    torch_threads: Callable[[int], None],
    start: str,
) -> None:
    torch_threads(2)
    engine = engine_factory(start=False)
    assert engine.compute_threads == 2  # the builder's count
    steps = _record_step_threads(engine)
    torch_threads(1)  # whatever this thread does later, the loop keeps the builder's count
    # torch's default for threads that first use it from now on: 2 (set from a thread of its own)
    default = threading.Thread(target=torch.set_num_threads, args=(2,))
    default.start()
    default.join()
    loader_threads: list[int] = []
    loader = engine.device.load_stream.submit(
        [lambda: loader_threads.append(torch.get_num_threads())]
    )

    def work() -> int:
        loader.wait(10)
        WorkerOperations(engine).load_adapter("mlp-r8", str(tiny_adapters["mlp-r8"]))
        stream = engine.submit("mlp-r8", _prompt(), SamplingParams(max_tokens=3, ignore_eos=True))
        assert len([t for event in stream for t in event.token_ids]) == 3
        return engine.adapters._pool.submit(torch.get_num_threads).result(10)

    if start == "own thread":
        engine.start()
        fetch_threads = work()
    else:
        fetch_threads = engine.run_while(work)
    assert steps and {count for _, count in steps} == {2}
    assert loader_threads == [1] and fetch_threads == 1


def test_a_signal_stops_the_server_gracefully_before_the_main_loop() -> None:
    """serve_until_signalled with run=: the loop runs on this (main) thread; on SIGTERM the
    server stops first (its calls in flight get the grace), then stop() ends the loop."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_insecure_port("127.0.0.1:0")
    server.start()
    order: list[str] = []
    ended = threading.Event()

    def run() -> None:
        order.append(f"run on {threading.current_thread().name}")
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert ended.wait(10)
        order.append("run returned")

    def stop() -> None:
        order.append(f"stop on {threading.current_thread().name}")
        ended.set()

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve_until_signalled(server, "test", grace=1.0, run=run, stop=stop)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert order == ["run on MainThread", "stop on shutdown", "run returned"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_serve_finishes_a_stream_in_flight_on_sigterm_and_exits_cleanly(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", "worker", "serve", "--model",
         str(tiny_model), "--served-model-name", "tiny", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    try:
        wait_serving(f"127.0.0.1:{port}", proc, 120)
        with WorkerClient(f"127.0.0.1:{port}") as client:
            stream = client.generate(
                "tiny", _prompt(), SamplingParams(max_tokens=200, ignore_eos=True)
            )
            tokens = list(next(stream).token_ids)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
            for event in stream:  # the grace period lets the stream run to its end
                tokens.extend(event.token_ids)
        assert len(tokens) == 200
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0].decode()
    assert "SIGTERM received, stopping" in output, output
