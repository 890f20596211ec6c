"""Graceful drain on SIGTERM, against real processes: `lorastream worker serve` and
`lorastream gateway serve` (the gateway in front of a real worker in this process).

The worker turns its gRPC health NOT_SERVING at once, refuses new generations with UNAVAILABLE,
lets the requests in flight run for ``--drain-seconds``, ends the rest with UNAVAILABLE and exits
0. The gateway turns /health 503 at once, refuses new requests with 503 + Retry-After, lets open
streams run for ``--drain-seconds``, ends each one still open with a ``shutting_down`` error event
and ``[DONE]`` and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorastream.core import errors
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.worker_client import WorkerClient
from lorastream.gateway.drain import Drain
from lorastream.gateway.http_errors import ApiError
from lorastream.stack.launcher import wait_http_ok, wait_serving
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.server import create_server
from tests.support.models import make_tiny_checkpoint

BASE = "tiny"
CONTEXT = 8192
LONG = 8000  # tokens: a stream that outlives a 1 s drain (~1 ms a token here, 2 cores)
MIN_DRAIN_TOKENS = 10  # a stream decodes hundreds in a 1 s drain; 10 tells "during" from "after"
SHORT = 1500  # tokens: a stream that finishes within a long drain, open for ~1 s after SIGTERM
PROMPT = PromptInput(token_ids=(1, 5, 9, 14, 20, 33))
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("drain") / "model", max_position_embeddings=CONTEXT
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: list[str], home: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "lorastream.cli.main", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "HOME": str(home)},
    )


def _output(proc: subprocess.Popen[bytes]) -> str:
    if proc.poll() is None:
        proc.kill()
    return proc.communicate()[0].decode()


# -- the worker ------------------------------------------------------------------------------------
def test_worker_sigterm_goes_not_serving_refuses_new_requests_cuts_what_outlives_the_drain(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = _free_port()
    target = f"127.0.0.1:{port}"
    proc = _spawn(["worker", "serve", "--model", str(tiny_model), "--served-model-name", BASE,
                   "--port", str(port), "--max-seq-len", str(CONTEXT), "--drain-seconds", "1"],
                  tmp_path)
    try:
        wait_serving(target, proc, 120)
        with grpc.insecure_channel(target) as channel, WorkerClient(target) as client:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=30
            )
            assert next(watch).status == SERVING
            stream = client.generate(BASE, PROMPT, SamplingParams(max_tokens=LONG,
                                                                   ignore_eos=True))
            tokens = list(next(stream).token_ids)
            seen: list[str] = []  # what the client observed, in order ("token" once a token)

            def read_stream() -> None:
                try:
                    for event in stream:
                        tokens.extend(event.token_ids)
                        seen.extend(["token"] * len(event.token_ids))
                except errors.SourceUnavailable as err:
                    seen.append("cut" if "shutting down" in str(err) else f"failed: {err}")
                else:
                    seen.append("finished")

            reader = threading.Thread(target=read_stream)
            reader.start()
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING
            seen.append("not serving")
            with pytest.raises(errors.SourceUnavailable, match="draining"):
                next(client.generate(BASE, PROMPT, SamplingParams(max_tokens=2)))
            reader.join(timeout=60)
            cut_after = time.monotonic() - signalled
            watch.cancel()
        assert proc.wait(timeout=30) == 0
        seen.append("exited")
        # NOT_SERVING was pushed at once: the stream kept decoding after it, for the drain
        assert "not serving" in seen and seen[-2:] == ["cut", "exited"], seen[-3:]
        after = seen[seen.index("not serving") + 1:-2]
        assert after.count("token") >= MIN_DRAIN_TOKENS, (
            f"{after.count('token')} tokens between NOT_SERVING and the cut")
        assert 0 < len(tokens) < LONG  # cut before its end ...
        assert cut_after >= 1.0, cut_after  # ... once the drain had run its 1 s
    finally:
        output = _output(proc)
    assert "draining" in output and "end with UNAVAILABLE" in output, output


# -- the gateway -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real worker in this process (engine on a thread); yields its target."""
    settings = WorkerSettings(
        model=str(tiny_model), served_model_name=BASE, port=0, max_seq_len=CONTEXT,
        kv_cache_bytes=16 << 20, model_cache_dir=tmp_path_factory.mktemp("models"),
    )
    server, port, engine = create_server(settings, build_engine(settings, checkpoint=tiny_model))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()
    engine.stop()


def _events(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of an SSE body."""
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


@pytest.mark.parametrize(
    ("drain_seconds", "max_tokens", "cut"),
    [(60.0, SHORT, False), (1.0, LONG, True)],
    ids=["stream-finishes-within-the-drain", "stream-cut-when-the-drain-ends"],
)
def test_gateway_sigterm_turns_readiness_off_refuses_new_requests_and_ends_streams_cleanly(
    worker: str, tmp_path: Path, drain_seconds: float, max_tokens: int, cut: bool
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn(["gateway", "serve", "--port", str(port), "--worker", worker,
                   "--store", "127.0.0.1:1", "--resolve-interval", "0",
                   "--drain-seconds", str(drain_seconds)], tmp_path)
    body = {"model": BASE, "prompt": [1, 5, 9], "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    try:
        wait_http_ok(f"{url}/health", proc, 60)
        with httpx.Client(base_url=url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = _events(response.iter_lines())
            first = json.loads(next(events))
            assert first["choices"][0]["text"] is not None
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            with httpx.Client(base_url=url, timeout=5) as other:
                deadline = time.monotonic() + 2
                while (health := other.get("/health")).status_code == 200:
                    assert time.monotonic() < deadline, "readiness stayed on"
                assert (health.status_code, health.json()["status"]) == (503, "draining")
                refused = other.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert refused.json()["error"]["code"] == "shutting_down"
            rest = list(events)
            ended_after = time.monotonic() - signalled
        assert rest[-1] == "[DONE]"
        last = json.loads(rest[-2])
        if cut:
            assert last == {"error": {
                "message": last["error"]["message"], "type": "service_unavailable",
                "param": None, "code": "shutting_down",
            }}
            assert "drain period ended" in last["error"]["message"]
            assert drain_seconds <= ended_after < drain_seconds + 5, ended_after
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            assert not any('"error"' in event for event in rest)
            assert ended_after < drain_seconds
        assert proc.wait(timeout=30) == 0
    finally:
        output = _output(proc)
    assert "draining" in output, output


def test_gateway_sigterm_answers_a_non_streamed_request_cut_by_the_drain_with_503(
    worker: str, tmp_path: Path
) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn(["gateway", "serve", "--port", str(port), "--worker", worker,
                   "--store", "127.0.0.1:1", "--resolve-interval", "0", "--drain-seconds", "1"],
                  tmp_path)
    body = {"model": BASE, "prompt": [1, 5, 9], "max_tokens": LONG, "ignore_eos": True}
    try:
        wait_http_ok(f"{url}/health", proc, 60)
        with futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30)
            time.sleep(0.5)  # the request is generating (LONG tokens take seconds)
            assert not pending.done()
            proc.send_signal(signal.SIGTERM)
            answer = pending.result()
        assert answer.status_code == 503 and answer.headers["Retry-After"]
        assert answer.json()["error"]["code"] == "shutting_down"
        assert "drain period ended" in answer.json()["error"]["message"]
        assert proc.wait(timeout=30) == 0
    finally:
        output = _output(proc)
    assert "ending 1 open generation(s)" in output, output


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT),
     (signal.SIGTERM, signal.SIGINT)],
    ids=["term-term", "int-int", "term-int"],
)
def test_gateway_second_signal_during_the_drain_cuts_open_streams_at_once_and_exits_0(
    worker: str, tmp_path: Path, first: signal.Signals, second: signal.Signals
) -> None:
    """Like uvicorn and vLLM, a second signal means "stop now" — but the open streams still end
    cleanly: within seconds (not the 60 s drain) each gets the shutting_down error event and
    [DONE], and the process exits 0."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn(["gateway", "serve", "--port", str(port), "--worker", worker,
                   "--store", "127.0.0.1:1", "--resolve-interval", "0", "--drain-seconds", "60"],
                  tmp_path)
    body = {"model": BASE, "prompt": [1, 5, 9], "max_tokens": LONG, "ignore_eos": True,
            "stream": True}
    try:
        wait_http_ok(f"{url}/health", proc, 60)
        with httpx.Client(base_url=url, timeout=30) as http, \
                http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            events = _events(response.iter_lines())
            next(events)
            proc.send_signal(first)
            with httpx.Client(base_url=url, timeout=5) as other:
                deadline = time.monotonic() + 2
                while other.get("/health").status_code == 200:
                    assert time.monotonic() < deadline, "readiness stayed on"
            signalled = time.monotonic()
            proc.send_signal(second)
            rest = list(events)
            ended_after = time.monotonic() - signalled
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "shutting_down"
        assert ended_after < 3, ended_after
        assert proc.wait(timeout=10) == 0
        exited_after = time.monotonic() - signalled
        assert exited_after < 8, exited_after
    finally:
        output = _output(proc)
    assert "received again, ending the drain now" in output, output
    assert "ending 1 open generation(s) now" in output, output


@pytest.mark.parametrize("before_run", [True, False], ids=["before-run", "during-run"])
def test_drain_stop_now_cuts_the_open_generations_at_once(before_run: bool) -> None:
    """The second signal's effect in-process: a 60 s drain with a generation open ends at once
    (even when the signal's callback runs before the drain's task has started), and the
    generation gets the shutting_down 503."""

    async def scenario() -> tuple[float, ApiError | None]:
        drain = Drain()
        generation = asyncio.ensure_future(drain.guard(asyncio.sleep(60)))
        await asyncio.sleep(0)
        started = time.monotonic()
        if before_run:
            drain.stop_now()
        else:
            asyncio.get_running_loop().call_later(0.1, drain.stop_now)
        await drain.run(60)
        try:
            await generation
        except ApiError as exc:
            return time.monotonic() - started, exc
        return time.monotonic() - started, None

    took, error = asyncio.run(scenario())
    assert took < 1, took
    assert error is not None and (error.status, error.code) == (503, "shutting_down")
