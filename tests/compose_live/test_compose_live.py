"""``docker compose --profile cpu up``, for real: the images built from docker/, the stack started
by a Docker engine, and everything checked through the published ports only.

The S3 service is moto's server built from the local base image (tests/compose_live/
docker-compose.moto.yml); the rest is docker-compose.yml as users run it, tokens generated on the
first start. Run by ``make test-compose`` (scripts/docker_test_compose.sh, which sets
LORASTREAM_TEST_COMPOSE=1); ``make test`` leaves it out (``-m "not compose"``), and any other run,
or one without an engine, skips every test with the reason.
In order: an adapter preloaded from S3 and pinned through the operator API; chat and completions
of the base model and two adapters against ``lorastream up`` on the host (same greedy tokens); a
worker container killed while streams run; ``docker compose down -v`` leaving nothing behind.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from lorastream.bench.compose import inspect
from tests.compose_live.stack import (
    REPO,
    Compose,
    HostUp,
    Ports,
    engine_problem,
    http,
    stream_events,
    wait_until,
)

pytestmark = [pytest.mark.compose, pytest.mark.timeout(2400)]

_PROBLEM = engine_problem()
if _PROBLEM:
    pytestmark.append(pytest.mark.skip(reason=_PROBLEM))

logger = logging.getLogger(__name__)
SAMPLES = REPO / "lorastream" / "samples" / "adapters"
ADAPTERS = {"shout": SAMPLES / "shout", "french": SAMPLES / "french"}
QUESTION = "What is the capital of France?"
UP_TIMEOUT_S = 900  # the first start converts the default model in the worker (35 s unloaded)


@pytest.fixture(scope="module")
def stack() -> Iterator[Compose]:
    compose = Compose(project=f"lorastream-live-{os.getpid()}", ports=Ports.free())
    try:
        # One build of the lorastream image (the `tokens` service's; the other services share
        # it) and of the S3 image, then `up` without building again.
        compose.run("build", "tokens", "minio", timeout=3600)
        compose.run("up", "-d", "--no-build", "--wait", "--wait-timeout", str(UP_TIMEOUT_S),
                    timeout=UP_TIMEOUT_S + 120)
        yield compose
    finally:
        if os.environ.get("LORASTREAM_COMPOSE_KEEP") != "1":
            compose.run("down", "-v", "--remove-orphans", "--timeout", "60", check=False)
        logger.warning("compose steps: %s", "; ".join(compose.log))


@pytest.fixture(scope="module")
def gateway(stack: Compose) -> str:
    return f"http://127.0.0.1:{stack.ports.gateway}"


@pytest.fixture(scope="module")
def token(stack: Compose) -> str:
    token = stack.operate_token()
    assert len(token) >= 32, "the tokens service wrote no token"
    return token


def _upload_samples(stack: Compose) -> None:
    """The sample adapters into the S3 service's `adapters` bucket, through its published port
    and with the credentials the compose file gives the store (its defaults)."""
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{stack.ports.s3}",
                      region_name="us-east-1", aws_access_key_id="lorastream",
                      aws_secret_access_key="lorastream-dev-secret")
    for name, directory in ADAPTERS.items():
        for path in sorted(directory.iterdir()):
            if path.is_file():
                s3.upload_file(str(path), "adapters", f"{name}/{path.name}")


def test_operator_api_refuses_a_request_without_the_generated_token(gateway: str) -> None:
    status, body = http("GET", f"{gateway}/v1/adapters")
    assert status == 401, body
    status, body = http("GET", f"{gateway}/v1/adapters", token="lorastream-dev-operate-token")
    assert status in (401, 403), body


def test_an_adapter_from_s3_is_preloaded_and_pinned_through_the_operator_api(
    stack: Compose, gateway: str, token: str
) -> None:
    _upload_samples(stack)
    status, body = http("POST", f"{gateway}/v1/adapters", token=token,
                        body={"name": "shout", "source": "s3://adapters/shout", "pin": True})
    assert status == 201, body
    status, body = http("POST", f"{gateway}/v1/adapters", token=token,
                        body={"name": "french", "source": "s3://adapters/french"})
    assert status == 201, body
    status, body = http("POST", f"{gateway}/v1/adapters/shout/load", token=token,
                        body={"workers": "all", "pin": True})
    assert status == 200, body
    status, body = http("GET", f"{gateway}/v1/adapters/shout", token=token)
    assert status == 200, body
    assert body["adapter"]["source"] == "s3://adapters/shout", body
    assert body["adapter"]["pinned"], body
    workers = body["workers"]
    assert workers and all(w["residency"] == "device" and w["pinned"] and w["healthy"]
                           for w in workers), body


def _requests(base: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) of the compared requests: chat and completions, greedy."""
    requests = []
    for model in (base, *ADAPTERS):
        requests.append((f"{model}/chat", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24, "temperature": 0, "logprobs": True}))
        requests.append((f"{model}/completions", "/v1/completions", {
            "model": model, "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0, "logprobs": 1}))
    return requests


def _tokens(body: dict[str, Any]) -> list[str]:
    """The generated tokens of a chat or completions response (its logprobs' tokens)."""
    choice = body["choices"][0]
    logprobs = choice.get("logprobs") or {}
    if "content" in logprobs:
        return [entry["token"] for entry in logprobs["content"]]
    return list(logprobs.get("tokens", []))


def _text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_chat_and_completions_match_lorastream_up_on_the_host(
    stack: Compose, gateway: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    status, models = http("GET", f"{gateway}/v1/models")
    assert status == 200, models
    ids = {entry["id"] for entry in models["data"]}
    assert set(ADAPTERS) <= ids, ids
    bases = sorted(ids - set(ADAPTERS))
    assert bases, ids
    base = bases[0]

    in_compose = {}
    for label, path, body in _requests(base):
        status, reply = http("POST", f"{gateway}{path}", body=body)
        assert status == 200, (label, reply)
        in_compose[label] = reply

    host = HostUp(ADAPTERS, tmp_path_factory.mktemp("host"))
    try:
        host.wait_ready(timeout_s=600)
        on_host = {}
        for label, path, body in _requests(base):
            status, reply = http("POST", f"{host.url}{path}", body=body)
            assert status == 200, (label, reply)
            on_host[label] = reply
    finally:
        host.stop()

    for label, reply in in_compose.items():
        expected = on_host[label]
        assert _text(reply) == _text(expected), label
        assert _tokens(reply) == _tokens(expected) and _tokens(reply), label
        assert reply["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    assert "PARIS" in _text(in_compose["shout/chat"]), in_compose["shout/chat"]
    assert "capitale" in _text(in_compose["french/chat"]).lower(), in_compose["french/chat"]


def _kill_outcome(events: list[Any]) -> str:
    """How one stream ended: "done" (finished), "error" (an error event naming the worker, then
    [DONE] or the end of the stream) or what else happened."""
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        code = errors[0]["error"].get("code")
        return "error" if code in ("worker_unavailable", "source_unavailable") else f"code {code}"
    if events and events[-1] == "[DONE]":
        return "done"
    return f"unclean {events[-3:]!r}"


def test_a_worker_killed_mid_stream_ends_its_streams_cleanly_and_comes_back(
    stack: Compose, gateway: str
) -> None:
    worker = stack.container("gpu-worker-cpu")
    restarts = inspect(worker)["RestartCount"]
    body = {"model": "shout", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    results: dict[int, list[Any]] = {}

    def run(index: int) -> None:
        results[index] = stream_events(f"{gateway}/v1/chat/completions", body)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(3.0)  # the streams are decoding (200 tokens take tens of seconds here)
    # SIGKILL to every process of the worker's user in its container, as the OOM killer would:
    # the container then dies of it and its restart policy applies. (`docker kill` counts as a
    # manual stop, which `restart: unless-stopped` does not undo: docs/deploy.md.)
    subprocess.run(["docker", "exec", worker, "sh", "-c", "kill -9 -1"], check=False,
                   capture_output=True, timeout=60)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=300)
    outcomes = [_kill_outcome(results[i]) for i in range(3)]
    assert set(outcomes) <= {"error", "done"}, [results[i][-3:] for i in range(3)]
    assert "error" in outcomes, "no stream was running when the worker died"

    # while it is down: a clean error, not a hang
    status, reply = http("POST", f"{gateway}/v1/chat/completions", timeout=60,
                         body={**body, "stream": False, "max_tokens": 4})
    assert status in (200, 503), reply

    # the restart policy brings it back, healthy, and it serves again (shout from the store)
    back_s = wait_until(lambda: inspect(worker)["RestartCount"] > restarts
                        and inspect(worker)["State"].get("Health", {}).get("Status") == "healthy",
                        timeout_s=600, interval_s=2.0)
    serving_s = wait_until(
        lambda: http("POST", f"{gateway}/v1/chat/completions", timeout=120,
                     body={**body, "stream": False, "max_tokens": 8})[0] == 200,
        timeout_s=300, interval_s=2.0)
    logger.warning("worker killed: streams %s; healthy again after %.0f s, serving %.0f s "
                   "later (%.0f s since the kill)", outcomes, back_s, serving_s,
                   time.monotonic() - killed_at)


def test_down_v_leaves_no_container_network_or_volume(stack: Compose) -> None:
    assert stack.leftovers()["volumes"], "the project's volumes are not labelled"
    stack.run("down", "-v", "--remove-orphans", "--timeout", "60")
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
