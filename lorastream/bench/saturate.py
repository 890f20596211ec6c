"""Saturating benchmark: does serving keep the CPU busy, and how close does it come to the engine?

The stack is started the way ``lorastream up`` starts it (:class:`~lorastream.stack.launcher.Stack`:
the store, one worker, the gateway, each its own ``lorastream ... serve`` process), and driven
through the gateway's OpenAI API as a user would: ``requests`` streaming ``POST /v1/completions``,
``concurrency`` of them in flight at any time, prompts of ``prompt_tokens`` random token ids,
``new_tokens`` generated each with ``ignore_eos``, greedy. Each workload runs base-only and with
``adapters`` synthetic adapters (registered in the store at start, named round-robin).

Reported per workload:

* served output tok/s and TTFT p50/p99;
* the CPU seconds the store, the worker (its fetch process included) and the gateway used during
  the load, against the CPU available (wall time x the CPUs this process may run on): the
  **utilisation**, goal >= 90%; the machine's idle share over the same window (``/proc/stat``),
  which other processes on a shared box lower but never raise; the worker's busiest threads;
* the engine's own rate on the same requests at the same concurrency, in the same run (the
  worker's engine built in a child process as ``bench engine`` builds it, requests submitted
  straight to it, no gRPC or HTTP), and **served / engine**, goal >= 0.8.

What this guards against: a request thread's ``torch.set_num_threads(1)`` left the engine
computing on one of two cores (``lorastream/worker/device/device.py``), which ``bench engine``
never saw: it has no request threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from lorastream.bench.harness import free_port, percentiles, sse_chunk
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.synthetic import checkpoint_shape, make_synthetic_adapter

log = logging.getLogger(__name__)

UTILISATION_GOAL = 0.9  # CPU busy at saturation
ENGINE_RATIO_GOAL = 0.8  # served tok/s against the engine's at the same concurrency
IDLE_LIMIT = 1 / 3  # the slow test's guard: a saturated machine idle more than this fails


@dataclass
class SaturateConfig:
    model: str = "default"
    requests: int = 128
    concurrency: int = 16
    prompt_tokens: tuple[int, int] = (32, 64)  # inclusive range of prompt lengths
    new_tokens: int = 32
    adapters: tuple[int, ...] = (0, 8)  # one workload per entry: 0 = base only
    rank: int = 16
    seed: int = 0
    warm_up: int = 4  # requests before the measured window (lazy setup, first adapter loads)
    engine: bool = True  # also measure the engine alone on the same requests


@dataclass
class Request:
    model: str  # "" = the base model
    prompt: list[int]
    ttft: float | None = None
    tokens: int = 0
    error: str | None = None


def make_requests(config: SaturateConfig, names: list[str], vocab: int) -> list[Request]:
    """The workload: random token ids below ``vocab`` (one seed for every run), adapters
    round-robin."""
    rng = random.Random(config.seed)
    low, high = config.prompt_tokens
    top = min(vocab, 30000)
    return [
        Request(names[i % len(names)] if names else "",
                [rng.randrange(min(100, top // 2), top) for _ in range(rng.randint(low, high))])
        for i in range(config.requests)
    ]


def vocab_size(model: str) -> int:
    """The vocabulary of a worker ``--model`` (resolved as the worker does)."""
    from lorastream.bench.synthetic import resolve_model_checkpoint
    from lorastream.worker.model.config import ModelConfig

    return ModelConfig.from_dir(resolve_model_checkpoint(model)).vocab_size


# -- CPU accounting -------------------------------------------------------------------------
def _cpu_seconds(process: psutil.Process) -> float:
    """CPU seconds of ``process`` and its children (the worker's fetch process)."""
    total = 0.0
    for p in [process, *process.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _machine_times() -> tuple[float, float]:
    """(idle, total) seconds of every CPU of the machine so far (``/proc/stat``)."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return idle, sum(t)


def _thread_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` so far."""
    out = {}
    for thread in psutil.Process(pid).threads():
        out[thread.id] = thread.user_time + thread.system_time
    return out


class CpuWindow:
    """CPU used by named processes, the machine's idle time and one process's threads over a
    window: ``with CpuWindow(...) as w: ...`` then ``w.result()``."""

    def __init__(self, processes: dict[str, int], threads_of: int | None = None) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in processes.items()}
        self.threads_of = threads_of
        self.cpus = len(os.sched_getaffinity(0))

    def __enter__(self) -> CpuWindow:
        # the benchmark's own CPU (its HTTP client), unless it is one of the measured processes
        measured = {p.pid for p in self.processes.values()}
        self._me = None if os.getpid() in measured else psutil.Process()
        self._start = {n: _cpu_seconds(p) for n, p in self.processes.items()}
        self._client = sum(self._me.cpu_times()[:2]) if self._me else 0.0
        self._threads = _thread_seconds(self.threads_of) if self.threads_of else {}
        self._machine = _machine_times()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self._end = {n: _cpu_seconds(p) for n, p in self.processes.items()}
        self._client_end = sum(self._me.cpu_times()[:2]) if self._me else 0.0
        self._threads_end = _thread_seconds(self.threads_of) if self.threads_of else {}
        self._machine_end = _machine_times()

    def result(self) -> dict[str, object]:
        used = {n: round(self._end[n] - self._start[n], 2) for n in self.processes}
        total = sum(used.values())
        available = self.wall * self.cpus
        idle = self._machine_end[0] - self._machine[0]
        machine_total = self._machine_end[1] - self._machine[1]
        client = self._client_end - self._client
        busiest = sorted((self._threads_end[t] - self._threads.get(t, 0.0)
                          for t in self._threads_end), reverse=True)[:3]
        return {
            "wall_s": round(self.wall, 2),
            "cpu_s": used,
            "cpu_used_s": round(total, 2),
            "cpu_available_s": round(available, 2),
            "utilisation": round(total / available, 3) if available else None,
            "client_cpu_s": round(client, 2),
            # what the rest of the machine took meanwhile (other work on a shared box)
            "other_cpu_s": round(max(0.0, machine_total - idle - total - client), 2),
            "machine_idle_share": round(idle / machine_total, 3) if machine_total else None,
            "busiest_threads_cpu_s": [round(s, 2) for s in busiest],
        }


def _warm_up_requests(config: SaturateConfig, names: list[str], vocab: int) -> list[Request]:
    """Before the window: lazy setup, and every adapter loaded once."""
    warm = SaturateConfig(requests=max(config.warm_up, len(names)), seed=config.seed + 1,
                          prompt_tokens=config.prompt_tokens)
    return make_requests(warm, names, vocab)


# -- the served workload --------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, request: Request, base: str,
               new_tokens: int) -> None:
    body = {"model": request.model or base, "prompt": request.prompt,
            "max_tokens": new_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                request.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return
            async for line in reply.aiter_lines():
                chunk = sse_chunk(line)
                if chunk is None:
                    continue
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    request.tokens += 1
                    if request.ttft is None:
                        request.ttft = time.perf_counter() - start
    except httpx.HTTPError as err:
        request.error = f"{type(err).__name__}: {err}"


async def _drive(url: str, requests: list[Request], base: str, concurrency: int,
                 new_tokens: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def go(request: Request) -> None:
            async with gate:
                await _one(client, url, request, base, new_tokens)

        await asyncio.gather(*(go(r) for r in requests))


def summarise(requests: list[Request], wall: float, new_tokens: int) -> dict[str, object]:
    """Output tok/s (tokens streamed with text; the first chunk of a stream may carry none),
    TTFT percentiles (ms), errors."""
    tokens = sum(r.tokens for r in requests)
    errors = [r.error for r in requests if r.error]
    return {
        "requests": len(requests), "tokens": tokens,
        "expected_tokens": len(requests) * new_tokens,
        "output_tok_s": round(tokens / wall, 1) if wall else None,
        "ttft_ms": percentiles([r.ttft for r in requests if r.ttft is not None]),
        "errors": len(errors), "first_error": errors[0] if errors else None,
    }


def _rate(run: dict[str, object]) -> float:
    """A run's output tokens per second."""
    rate = run["output_tok_s"]
    assert isinstance(rate, int | float), rate
    return float(rate)


def run_served(config: SaturateConfig, adapter_dirs: dict[str, Path]) -> dict[str, object]:
    """One stack as ``lorastream up`` starts it; the workload of ``adapter_dirs`` (empty: base)."""
    from lorastream.stack.launcher import Stack, StackConfig

    ports = [free_port() for _ in range(3)]
    store_cache = Path(tempfile.mkdtemp(prefix="lorastream-saturate-store-"))
    stack = Stack(StackConfig(
        model=config.model, store_port=ports[0], worker_port=ports[1], gateway_port=ports[2],
        metrics_port=free_port(), adapters={n: str(p) for n, p in adapter_dirs.items()},
        insecure_no_auth=True, log_level="WARNING",
    ))
    try:
        with _store_cache(store_cache):
            stack.start()
        url = stack.gateway
        roles = {"adapter store": "store", "worker 0": "worker", "gateway": "gateway"}
        pids = {roles[name]: p.pid for name, p in stack.processes}
        names, vocab = sorted(adapter_dirs), vocab_size(config.model)
        asyncio.run(_drive(url, _warm_up_requests(config, names, vocab), config.model,
                           config.concurrency, 4))
        requests = make_requests(config, names, vocab)
        with CpuWindow(pids, threads_of=pids["worker"]) as window:
            asyncio.run(_drive(url, requests, config.model, config.concurrency,
                               config.new_tokens))
        return {**summarise(requests, window.wall, config.new_tokens), **window.result()}
    finally:
        stack.stop()
        shutil.rmtree(store_cache, ignore_errors=True)


@contextmanager
def _store_cache(path: Path) -> Iterator[None]:
    """The store the stack starts meanwhile stages into ``path`` (removed when the stack is done
    with it), not the user's cache: a run's adapters never meet another run's registrations."""
    name = "LORASTREAM_STORE_CACHE_DIR"  # the store's setting (lorastream/store/config.py)
    before = os.environ.get(name)
    os.environ[name] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# -- the engine alone -----------------------------------------------------------------------
def run_engine(config: SaturateConfig, adapter_dirs: dict[str, Path]) -> dict[str, object]:
    """The same requests straight to the worker's engine, in a child process (OpenMP reads its
    settings when torch loads, and the child has the cores to itself as the worker had)."""
    job = {"config": asdict(config), "adapters": {n: str(p) for n, p in adapter_dirs.items()}}
    done = subprocess.run(
        [sys.executable, "-c", f"from {__name__} import engine_child; engine_child()"],
        input=json.dumps(job), capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the engine measurement failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def engine_child() -> None:
    """Entry of :func:`run_engine`'s child: reads the job on stdin, prints the result JSON."""
    from lorastream.worker.device.cpu.native_env import tune_native_libraries

    tune_native_libraries()  # before torch loads, as `worker serve` does
    from lorastream.core.generation import PromptInput, SamplingParams
    from lorastream.worker.device.cpu.threads import use_one_intra_op_thread
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.operations import WorkerOperations

    job = json.loads(sys.stdin.read())
    given = job["config"]
    config = SaturateConfig(**{**given, "prompt_tokens": tuple(given["prompt_tokens"]),
                               "adapters": tuple(given["adapters"])})
    adapters: dict[str, str] = job["adapters"]
    engine = build_engine(WorkerSettings(model=config.model))
    ops = WorkerOperations(engine)

    def submit_all(requests: list[Request], new_tokens: int) -> None:
        pending = list(reversed(requests))
        lock = threading.Lock()

        def client() -> None:  # one of `concurrency` clients, each one request at a time
            use_one_intra_op_thread()  # as the worker's request threads do
            while True:
                with lock:
                    if not pending:
                        return
                    request = pending.pop()
                start = time.perf_counter()
                params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
                stream = engine.submit(request.model, PromptInput(token_ids=tuple(request.prompt)),
                                       params)
                for event in stream:
                    if request.ttft is None:
                        request.ttft = time.perf_counter() - start
                    request.tokens += len(event.token_ids)

        threads = [threading.Thread(target=client) for _ in range(config.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def work() -> dict[str, object]:
        for name, path in adapters.items():
            ops.load_adapter(name, path)
        names, vocab = sorted(adapters), engine.model.config.vocab_size
        submit_all(_warm_up_requests(config, names, vocab), 4)
        requests = make_requests(config, names, vocab)
        with CpuWindow({"engine": os.getpid()}, threads_of=os.getpid()) as window:
            submit_all(requests, config.new_tokens)
        return {**summarise(requests, window.wall, config.new_tokens), **window.result()}

    print(json.dumps(engine.run_while(work)))


# -- the benchmark --------------------------------------------------------------------------
def _adapter_dirs(config: SaturateConfig, count: int, root: Path) -> dict[str, Path]:
    if count == 0:
        return {}
    shape = checkpoint_shape(config.model)
    return {f"sat{i}": make_synthetic_adapter(root / f"sat{i}", shape, rank=config.rank, seed=i)
            for i in range(count)}


def run_saturate_bench(config: SaturateConfig,
                       report: Callable[[str], None] = log.info) -> dict[str, object]:
    """Every workload of ``config``; ``report`` gets one line per workload (utilisation and
    served/engine, printed every run)."""
    workloads = []
    with tempfile.TemporaryDirectory(prefix="lorastream-saturate-") as tmp:
        for count in config.adapters:
            dirs = _adapter_dirs(config, count, Path(tmp))
            served = run_served(config, dirs)
            engine = run_engine(config, dirs) if config.engine else None
            ratio = (round(_rate(served) / _rate(engine), 3)
                     if engine and engine["output_tok_s"] else None)
            workloads.append({"adapters": count, "served": served, "engine": engine,
                              "served_over_engine": ratio})
            report(
                f"saturate, {count or 'no'} adapters: served {served['output_tok_s']} tok/s, "
                f"CPU busy {served['utilisation']:.0%} of {served['cpu_available_s']} CPU-s "
                f"(machine idle {served['machine_idle_share']:.0%}), engine "
                f"{engine['output_tok_s'] if engine else '-'} tok/s, served/engine {ratio}"
            )
    return {
        "benchmark": "saturate",
        "command": command_line(),
        "machine": machine_info(bandwidth=False),
        "config": asdict(config),
        "goals": {"utilisation": f">= {UTILISATION_GOAL}",
                  "served_over_engine": f">= {ENGINE_RATIO_GOAL}"},
        "workloads": workloads,
        "met": goals_met(workloads),
    }


def goals_met(workloads: list[dict[str, Any]]) -> dict[str, bool]:
    """Both goals, over every workload."""
    util = all((w["served"]["utilisation"] or 0) >= UTILISATION_GOAL for w in workloads)
    ratios = [w["served_over_engine"] for w in workloads]  # None: the engine was not measured
    return {"utilisation": util,
            "served_over_engine": all(r is not None and r >= ENGINE_RATIO_GOAL for r in ratios)}
