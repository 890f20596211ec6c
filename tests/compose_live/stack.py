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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorastream.bench.compose import engine_problem as docker_problem
from tests.support.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [REPO / "docker-compose.yml", REPO / "tests/compose_live/docker-compose.moto.yml"]
TOKENS_DIR = "/run/lorastream/tokens"


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


@dataclass
class Compose:
    """``docker compose -p PROJECT -f ... --profile cpu`` with the test's ports."""

    project: str
    ports: Ports
    files: list[Path] = field(default_factory=lambda: list(COMPOSE_FILES))
    log: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        # The operator's own settings (LORASTREAM_PYTHON_IMAGE, ..._TORCH_INDEX_URL) pass through;
        # tokens do not: the stack must generate its own.
        env = {k: v for k, v in os.environ.items()
               if not k.endswith(("_TOKEN", "_TOKEN_FILE")) and not k.startswith("COMPOSE_")}
        return env | self.ports.env()

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        command = ["docker", "compose", "-p", self.project,
                   *(arg for f in self.files for arg in ("-f", str(f))), "--profile", "cpu",
                   *args]
        started = time.monotonic()
        done = subprocess.run(command, cwd=REPO, env=self.env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
        self.log.append(f"{' '.join(args)}: rc {done.returncode} in "
                        f"{time.monotonic() - started:.0f} s")
        if check and done.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({done.returncode}):\n"
                                 f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done.stdout

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def operate_token(self) -> str:
        return self.run("exec", "-T", "gateway", "cat", f"{TOKENS_DIR}/operate-token").strip()

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes still labelled with the project."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind, command in (("containers", ["docker", "ps", "-a", "-q", "--filter", label]),
                              ("networks", ["docker", "network", "ls", "-q", "--filter", label]),
                              ("volumes", ["docker", "volume", "ls", "-q", "--filter", label])):
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
            found[kind] = out.stdout.split()
        return found


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
