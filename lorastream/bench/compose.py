"""A compose project driven through the docker CLI, for benchmarks that run the stack in containers
(``lorastream bench fleet``): ``docker compose -p PROJECT -f ... --profile cpu`` with chosen ports
and settings, container health and restarts from ``docker inspect``, and HTTP through the published
ports only. tests/compose_live drives its stacks with the same class.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
TOKENS_DIR = "/run/lorastream/tokens"
LOCAL_BASE_IMAGE = "lorastream/python:3.11-bookworm"  # scripts/docker_host_prepare.sh makes it


def engine_problem() -> str | None:
    """Why no compose stack can run here (no CLI, no engine, no compose v2), or None."""
    if shutil.which("docker") is None:
        return "no docker CLI (scripts/docker_host_prepare.sh installs one)"
    for command, what in ((["docker", "info"], "no Docker engine answers `docker info`"),
                          (["docker", "compose", "version"], "no compose v2 plugin")):
        try:
            done = subprocess.run(command, capture_output=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return f"{what} (timed out)"
        if done.returncode != 0:
            return f"{what} (scripts/docker_host_prepare.sh sets it up)"
    return None


def build_environment() -> dict[str, str]:
    """The build settings of scripts/docker_test_compose.sh where the operator set none: the local
    base image when it exists, and no torch index when docker/local/wheels holds torch."""
    env: dict[str, str] = {}
    if "LORASTREAM_PYTHON_IMAGE" not in os.environ:
        done = subprocess.run(["docker", "image", "inspect", LOCAL_BASE_IMAGE],
                              capture_output=True, check=False, timeout=60)
        if done.returncode == 0:
            env["LORASTREAM_PYTHON_IMAGE"] = LOCAL_BASE_IMAGE
    if (any((REPO / "docker/local/wheels").glob("torch-*.whl"))
            and "LORASTREAM_TORCH_INDEX_URL" not in os.environ):
        env["LORASTREAM_TORCH_INDEX_URL"] = ""
    return env


@dataclass
class ComposeProject:
    """One compose project: ``files`` (relative to the repository), ``settings`` (variables the
    compose files interpolate: ports, routing) on top of the caller's environment, tokens left
    out so the stack generates its own."""

    project: str
    files: list[str]
    settings: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)  # one line per command: what, rc, seconds

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.endswith(("_TOKEN", "_TOKEN_FILE")) and not k.startswith("COMPOSE_")}
        return env | build_environment() | self.settings

    def run(self, *args: str, timeout: float = 900, check: bool = True) -> str:
        command = ["docker", "compose", "-p", self.project,
                   *(arg for f in self.files for arg in ("-f", f)), "--profile", "cpu", *args]
        started = time.monotonic()
        done = subprocess.run(command, cwd=REPO, env=self.env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
        seconds = time.monotonic() - started
        self.log.append(f"{' '.join(args[:3])}: rc {done.returncode} in {seconds:.0f} s")
        log.info("docker compose %s: rc %d in %.0f s", " ".join(args), done.returncode, seconds)
        if check and done.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)} failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service).split()
        if len(ids) != 1:
            raise RuntimeError(f"{service}: expected one container, found {ids}")
        return ids[0]

    def operate_token(self) -> str:
        return self.run("exec", "-T", "gateway", "cat", f"{TOKENS_DIR}/operate-token").strip()

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "30", check=False)

    def leftovers(self) -> dict[str, list[str]]:
        """Containers, networks and volumes still labelled with the project."""
        label = f"label=com.docker.compose.project={self.project}"
        found = {}
        for kind in ("container", "network", "volume"):
            command = ["docker", kind, "ls", "-q", "--filter", label]
            if kind == "container":
                command.insert(3, "-a")
            out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60)
            found[f"{kind}s"] = out.stdout.split()
        return found


def inspect(container: str) -> dict[str, Any]:
    out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out)[0]


def health(container: str) -> str:
    """The container's health status (healthy, starting, unhealthy) or its state when it has none
    (restarting, exited)."""
    state = inspect(container)["State"]
    return str(state.get("Health", {}).get("Status") or state.get("Status"))


def kill_processes(container: str) -> None:
    """SIGKILL every process of the container's user, as the OOM killer would: the container dies
    of it and its restart policy applies (``docker kill`` counts as a manual stop, which
    ``restart: unless-stopped`` does not undo: docs/deploy.md)."""
    subprocess.run(["docker", "exec", container, "sh", "-c", "kill -9 -1"], check=False,
                   capture_output=True, timeout=60)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 1.0) -> float:
    """Seconds until ``predicate()`` held (errors count as not yet); TimeoutError past
    ``timeout_s``."""
    started = time.monotonic()
    while True:
        try:
            if predicate():
                return time.monotonic() - started
        except (OSError, ValueError, RuntimeError, subprocess.SubprocessError):
            pass
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not within {timeout_s} s: {predicate}")
        time.sleep(interval_s)
