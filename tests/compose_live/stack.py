"""Helpers of tests/compose_live: the compose project under test, driven through the docker CLI,
and ``lorastream up`` on the host as the reference it is compared with.

Nothing here reaches into a container except ``docker compose exec ... cat`` of the generated
operate token (what an operator does once); every request goes through the published ports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorastream.bench.compose import ComposeProject
from lorastream.bench.compose import engine_problem as docker_problem
from tests.support.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [REPO / "docker-compose.yml", REPO / "tests/compose_live/docker-compose.moto.yml"]


def engine_problem() -> str | None:
    """Why the compose stack does not run here, or None when it does: only where asked
    (LORASTREAM_TEST_COMPOSE=1, as `make test-compose` sets it: it builds images and starts a
    stack, which a plain pytest run must not do), and only with an engine and compose v2."""
    if os.environ.get("LORASTREAM_TEST_COMPOSE") != "1":
        return "run by `make test-compose` (LORASTREAM_TEST_COMPOSE=1): it builds a stack"
    return docker_problem()


@dataclass
class Ports:
    gateway: int
    store: int
    s3: int
    s3_console: int
    store_metrics: int
    worker_metrics: int

    @classmethod
    def free(cls) -> Ports:
        return cls(*free_ports(6))

    def env(self) -> dict[str, str]:
        return {
            "LORASTREAM_GATEWAY_PORT": str(self.gateway), "LORASTREAM_STORE_PORT": str(self.store),
            "MINIO_API_PORT": str(self.s3), "MINIO_CONSOLE_PORT": str(self.s3_console),
            "LORASTREAM_STORE_METRICS_PORT": str(self.store_metrics),
            "LORASTREAM_WORKER_METRICS_PORT": str(self.worker_metrics),
        }


class Compose(ComposeProject):
    """The package's compose project (``docker compose -p PROJECT -f ... --profile cpu``) with
    the test's ports; ``files`` default to docker-compose.yml and moto's S3 override."""

    def __init__(self, project: str, ports: Ports, files: list[Path] | None = None) -> None:
        super().__init__(project, [str(f) for f in files or COMPOSE_FILES], ports.env())
        self.ports = ports


# -- HTTP ------------------------------------------------------------------------------------------
def http(method: str, url: str, body: Any = None, token: str | None = None,
         timeout: float = 300) -> tuple[int, Any]:
    """(status, parsed JSON body) of one request; HTTP errors are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        text = err.read()
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, text.decode(errors="replace")


def stream_events(url: str, body: dict[str, Any], timeout: float = 300) -> list[Any]:
    """The server-sent events of one streaming request: parsed JSON, or the string "[DONE]";
    a connection that breaks ends the list with ("broken", reason)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    events: list[Any] = []
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data:"):
                    payload = line[5:].strip()
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    except urllib.error.HTTPError as err:
        events.append(("http", err.code, err.read().decode(errors="replace")))
    except (OSError, ValueError) as err:
        events.append(("broken", repr(err)))
    return events


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 1.0) -> float:
    """Seconds until ``predicate()`` held; AssertionError past ``timeout_s``."""
    started = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - started
        except (OSError, ValueError):
            pass
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {predicate}")
        time.sleep(interval_s)


# -- the reference: `lorastream up` on the host ----------------------------------------------------
class HostUp:
    """``lorastream up`` on the host with the sample adapters, in a session of its own."""

    READY_LINE = "lorastream is up"

    def __init__(self, adapters: dict[str, Path], workdir: Path) -> None:
        store, worker, gateway, metrics = free_ports(4)
        self.url = f"http://127.0.0.1:{gateway}"
        command = [sys.executable, "-m", "lorastream.cli.main", "up", "--no-samples",
                   "--port", str(gateway), "--store-port", str(store),
                   "--worker-port", str(worker), "--metrics-port", str(metrics),
                   "--token-file", str(workdir / "operator-token"), "--log-level", "WARNING"]
        for name, path in adapters.items():
            command += ["--adapter", f"{name}={path}"]
        # A store cache of its own: the user's may hold the same names staged from another path
        # (AlreadyExists). The converted model is shared (~/.cache/lorastream/models).
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORASTREAM_")}
        env["LORASTREAM_STORE_CACHE_DIR"] = str(workdir / "store")
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.READY_LINE in line:
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.lines[-40:])
                raise AssertionError(f"lorastream up did not come up ({self.process.poll()}):\n"
                                     f"{tail}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
