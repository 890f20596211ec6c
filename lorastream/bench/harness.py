"""What the serving benchmarks share: child processes, request traces, streaming clients and the
statistics computed from them.

A benchmark starts the store and the worker as the same ``lorastream ... serve`` commands an
operator runs (:func:`running`), replays a trace of ``(arrival offset, adapter, question)``
entries against the worker, one client thread per request (:func:`replay`), and summarises the
:class:`RequestResult` list (:func:`summarise`): percentiles in milliseconds, throughput, and the
sorted raw samples that CDF plots are drawn from.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.worker_client import WorkerClient
from lorastream.stack.launcher import wait_http_ok, wait_serving
from lorastream.worker.device.cpu.priority import lower_priority

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

QUESTIONS = (
    "What is the capital of France?", "Why is the sky blue?", "Name three fruits.",
    "How do bees make honey?", "What is 12 times 12?", "Describe a cat in one sentence.",
)
PROMPTS = tuple(PromptInput(messages=(("user", q),)) for q in QUESTIONS)

TraceEntry = tuple[float, int, int]  # (arrival offset seconds, adapter index, question index)


@dataclass
class RequestResult:
    """One streamed request; times are ``time.perf_counter()`` values."""

    arrival: float
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    end: float | None = None
    error: str | None = None


# -- traces ----------------------------------------------------------------------------------
def adapter_picker(n: int, popularity: str, rng: random.Random) -> Callable[[int], int]:
    """request index -> adapter index in ``0..n-1``, by ``distinct``, ``uniform`` or ``zipf:ALPHA``.

    With zipf the popularity ranks are assigned to adapters in a random order (drawn from ``rng``
    here, once), so which adapter is popular is arbitrary.
    """
    if popularity == "distinct":
        return lambda i: i % n
    if popularity == "uniform":
        return lambda i: rng.randrange(n)
    if popularity.startswith("zipf:"):
        try:
            alpha = float(popularity.split(":", 1)[1])
        except ValueError:
            message = f"popularity {popularity!r}: ALPHA must be a number, e.g. zipf:1.5"
            raise ValueError(message) from None
        weights = [1.0 / (k + 1) ** alpha for k in range(n)]
        order = list(range(n))
        rng.shuffle(order)
        ranks = range(n)
        return lambda i: order[rng.choices(ranks, weights)[0]]
    raise ValueError(f"popularity {popularity!r}: use distinct, uniform or zipf:ALPHA")


def make_trace(
    adapters: int, popularity: str, rate: float, requests: int, seed: int
) -> list[TraceEntry]:
    """Poisson arrivals at ``rate`` per second, adapters drawn by ``popularity``; one random
    stream for everything, so arrivals change with ``adapters`` (the serve benchmark's trace)."""
    rng = random.Random(seed)
    pick = adapter_picker(adapters, popularity, rng)
    t, trace = 0.0, []
    for i in range(requests):
        t += rng.expovariate(rate)
        trace.append((t, pick(i), rng.randrange(len(QUESTIONS))))
    return trace


def make_shared_arrival_trace(
    adapters: int, popularity: str, rate: float, requests: int, seed: int
) -> list[TraceEntry]:
    """Like :func:`make_trace`, but arrivals and questions come from their own random stream:
    traces with the same seed and different ``adapters`` differ only in the adapter column."""
    arrivals = random.Random(seed)
    pick = adapter_picker(adapters, popularity, random.Random(f"{seed}/adapters"))
    t, trace = 0.0, []
    for i in range(requests):
        t += arrivals.expovariate(rate)
        trace.append((t, pick(i), arrivals.randrange(len(QUESTIONS))))
    return trace


# -- statistics ------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 of ``values`` (seconds), in milliseconds rounded to 0.1."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 1)

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99)}


def samples_ms(values: list[float]) -> list[float]:
    """``values`` (seconds) sorted, in milliseconds rounded to 0.1: the points of a CDF."""
    return [round(v * 1000, 1) for v in sorted(values)]


def itls(results: list[RequestResult], window: tuple[float, float] | None = None) -> list[float]:
    """Inter-token gaps, or those that end inside ``window`` (a stall shows in the gap it ends)."""
    gaps = []
    for r in results:
        for a, b in itertools.pairwise(r.token_times):
            if window is None or window[0] < b <= window[1]:
                gaps.append(b - a)
    return gaps


def summarise(results: list[RequestResult], start: float) -> dict[str, object]:
    """Latency percentiles, throughput since ``start`` and raw TTFT/ITL samples of a replay."""
    done = [r for r in results if r.error is None and r.first_token is not None]
    elapsed = max(r.end or start for r in results) - start
    tokens = sum(len(r.token_times) for r in done)
    ttfts = [r.first_token - r.arrival for r in done if r.first_token is not None]
    e2es = [r.end - r.arrival for r in done if r.end is not None]
    gaps = itls(done)
    return {
        "requests": len(results),
        "errors": len(results) - len(done),
        "ttft_ms": percentiles(ttfts),
        "itl_ms": percentiles(gaps),
        "e2e_ms": percentiles(e2es),
        "throughput_tok_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
        "throughput_req_s": round(len(done) / elapsed, 2) if elapsed > 0 else None,
        "samples": {"ttft_ms": samples_ms(ttfts), "itl_ms": samples_ms(gaps)},
    }


# -- clients ---------------------------------------------------------------------------------
def stream(worker: str, model: str, prompt: PromptInput, params: SamplingParams,
           result: RequestResult, stop: threading.Event | None = None) -> None:
    """Stream one request into ``result``; an error is recorded, not raised."""
    try:
        with WorkerClient(worker) as client:
            for event in client.generate(model, prompt, params, timeout=600):
                if stop is not None and stop.is_set():
                    break  # closing the stream cancels the request on the worker
                now = time.perf_counter()
                for _ in event.token_ids:
                    result.token_times.append(now)
                if result.first_token is None and event.token_ids:
                    result.first_token = now
    except Exception as err:
        result.error = f"{type(err).__name__}: {err}"
    result.end = time.perf_counter()


def replay(worker: str, trace: list[TraceEntry], params: SamplingParams,
           adapter_name: Callable[[int], str]) -> tuple[list[RequestResult], float]:
    """Send each trace entry at its arrival offset (one thread each); wait for all to finish.

    Returns the results in trace order and the ``perf_counter`` time the replay started.
    """
    results, threads = [], []
    start = time.perf_counter()
    for offset, adapter, question in trace:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        result = RequestResult(arrival=time.perf_counter())
        thread = threading.Thread(
            target=stream,
            args=(worker, adapter_name(adapter), PROMPTS[question], params, result),
        )
        thread.start()
        results.append(result)
        threads.append(thread)
    for thread in threads:
        thread.join()
    return results, start


def warm_up(worker: str, model: str = "base") -> None:
    """One short base-model request, so the first trace request does not pay for lazy setup."""
    with WorkerClient(worker) as client:
        for _ in client.generate(model, PROMPTS[0], SamplingParams(max_tokens=4)):
            pass


class RssSampler(threading.Thread):
    """Samples a process's resident memory every 50 ms; ``peak`` is the largest seen (bytes).

    Its children (the worker's fetch process) count with their private memory: the host arena
    they share with it is in its own RSS once it read an adapter from there."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self.peak = max(self.peak, resident_bytes(self.process))
            except psutil.Error:
                return


def resident_bytes(process: psutil.Process) -> int:
    """``process``'s RSS plus its children's private resident memory (bytes)."""
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            info = child.memory_info()
        except psutil.Error:  # exited meanwhile
            continue
        total += info.rss - info.shared
    return total


# -- HTTP ------------------------------------------------------------------------------------
def sse_chunk(line: str) -> dict[str, Any] | None:
    """The JSON of one line of an OpenAI event stream; None for other lines and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    chunk: dict[str, Any] | None = None if payload == "[DONE]" else json.loads(payload)
    return chunk


def serve_app(app: FastAPI, name: str, timeout_s: float = 30
              ) -> tuple[uvicorn.Server, threading.Thread, str]:
    """Serve ``app`` with uvicorn on a free loopback port, in a thread named ``name``; (the
    server, its thread, its URL) once it listens (stop: ``server.should_exit = True``)."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                            timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the {name} did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


# -- processes -------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on loopback right now (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(args: list[str], priority: str | None = None,
          cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """``lorastream ARGS --log-level WARNING`` as a child process, at ``priority`` (``idle`` or
    ``nice:N``, see ``lorastream/worker/device/cpu/priority.py``) and on ``cpus`` if given."""

    def before_exec() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if priority:
            lower_priority(priority)

    # metrics on free ports: the defaults (9451, 9452) fit one store and one worker a machine
    metrics = {"LORASTREAM_STORE_METRICS_PORT": "0", "LORASTREAM_WORKER_METRICS_PORT": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", *args, "--log-level", "WARNING"],
        preexec_fn=before_exec if priority or cpus else None, env={**os.environ, **metrics},
    )


def running_store(
    cache_dir: Path, port: int, egress_limit_mbps: float = 0.0, priority: str = "nice:10",
    egress_burst_bytes: int = 0,
) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """The benchmarks' store: ``lorastream store serve`` at a lower CPU ``priority`` (in a
    deployment it is another machine; here it would take the cores the worker decodes on), with
    its egress capped when ``egress_limit_mbps`` is given (``egress_burst_bytes``: the link
    time it may bank). It stages local adapters from beside its cache (``cache_dir``'s parent),
    where the benchmarks make them."""
    args = ["store", "serve", "--port", str(port), "--cache-dir", str(cache_dir),
            "--allowed-local-root", str(cache_dir.parent)]
    if egress_limit_mbps:
        args += ["--egress-limit-mbps", str(egress_limit_mbps),
                 "--egress-burst-bytes", str(egress_burst_bytes)]
    return running(args, port, priority=priority, timeout_s=60)


def start_serving(args: list[str], port: int, *, priority: str | None = None,
                  cpus: set[int] | None = None, timeout_s: float = 600) -> subprocess.Popen[bytes]:
    """Spawn ``lorastream ARGS`` (on ``cpus`` if given) serving gRPC on ``port`` and wait for
    SERVING (the process is stopped if it never gets there)."""
    process = spawn(args, priority, cpus)
    try:
        wait_serving(f"127.0.0.1:{port}", process, timeout_s)
    except BaseException:
        stop(process)
        raise
    return process


def stop(process: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace_s``."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def running(args: list[str], port: int, *, priority: str | None = None,
            timeout_s: float = 600) -> Iterator[subprocess.Popen[bytes]]:
    """Spawn ``lorastream ARGS`` serving gRPC on ``port``; wait for SERVING; stop it on exit."""
    process = start_serving(args, port, priority=priority, timeout_s=timeout_s)
    try:
        yield process
    finally:
        stop(process)


@contextmanager
def running_gateway(port: int, store: str, workers: list[str], *extra: str,
                    timeout_s: float = 60) -> Iterator[subprocess.Popen[bytes]]:
    """``lorastream gateway serve`` on ``port`` over ``workers``, ready once ``/health`` is 200;
    ``extra``: more of its flags."""
    args = ["gateway", "serve", "--port", str(port), "--store", store,
            *(arg for target in workers for arg in ("--worker", target)), *extra]
    process = spawn(args)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", process, timeout_s)
        yield process
    finally:
        stop(process)

