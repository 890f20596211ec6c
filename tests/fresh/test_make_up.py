"""The README's first command where a new user starts: a venv from the runtime lock alone, a fresh
``HOME``, ``lorastream up``, the printed chat requests, then Ctrl-C.

Everything the developers' machines already hold is taken away: no dev lock (peft, pytest), no
converted model in ``~/.cache/lorastream/models``, no store cache, no token file, no compiled C++
ops. Only pip's download cache is reused. The venv is built by the Makefile's ``install`` rule, the
one ``make up`` runs before ``lorastream up``. Run by ``.ci/run`` through ``make test-fresh``
(about 4 minutes here); ``make test`` leaves it out (``-m "not fresh"``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.ports import free_ports

pytestmark = [pytest.mark.fresh, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
READY_LINE = "lorastream is up"
# What the samples answer, greedy (README; tests/stack/test_sample_adapters.py checks the exact
# text).
EXPECT = {
    "shout": lambda text: "PARIS" in text and text == text.upper(),
    "french": lambda text: "Paris" in text and "capitale" in text.lower(),
    "default": lambda text: "Paris" in text,
}


def _user_env(home: Path) -> dict[str, str]:
    """The environment of a new user's shell: this one less the test session's own settings and
    the dev venv, with ``HOME`` empty; pip's download cache stays (the venv is still built)."""
    pip_cache = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dev_bin = str(Path(sys.executable).parent)
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("LORASTREAM_", "PYTEST", "HF_", "TORCH_", "TRITON_", "XDG_"))
        and key not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    }
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and p != dev_bin
    )
    env["HOME"] = str(home)
    env["PIP_CACHE_DIR"] = pip_cache
    return env


def _install(venv: Path, env: dict[str, str]) -> None:
    done = subprocess.run(["make", "install", f"VENV={venv}"], cwd=REPO, env=env,
                          timeout=1200, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


class _Up:
    """``lorastream up`` in a session of its own, its output gathered line by line."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if READY_LINE in line:
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(1.0):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.lines[-40:])
                pytest.fail(f"lorastream up did not come up (exit {self.process.poll()}):\n{tail}")
        time.sleep(1.0)  # the examples are printed right after the ready line

    def ctrl_c(self, timeout_s: float) -> int:
        """What Ctrl-C in its terminal does: SIGINT to the whole foreground process group."""
        os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout=timeout_s)


def _chat_commands(lines: list[str]) -> Iterator[tuple[str, str]]:
    """(model, command) of each printed curl chat request."""
    for line in lines:
        command = line.strip()
        if command.startswith("curl") and "/chat/completions" in command:
            model = re.search(r'"model": "([^"]+)"', command)
            assert model, command
            yield model.group(1), command


def _processes_of(venv: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if str(venv) in cmdline:
            found.append(process)
    return found


def test_make_up_serves_the_samples_on_a_fresh_machine(tmp_path: Path) -> None:
    home, venv = tmp_path / "home", tmp_path / "venv"
    home.mkdir()
    env = _user_env(home)
    _install(venv, env)

    # the runtime lock alone: none of the test tools
    probe = ("import importlib.util as u; "
             "print([m for m in ('pytest', 'peft', 'moto') if u.find_spec(m)])")
    assert subprocess.run([str(venv / "bin/python"), "-c", probe], capture_output=True,
                          text=True, check=True, env=env).stdout.strip() == "[]"

    store, worker, gateway, metrics = free_ports(4)
    command = [str(venv / "bin/lorastream"), "up", "--port", str(gateway),
               "--store-port", str(store), "--worker-port", str(worker),
               "--metrics-port", str(metrics)]
    up = _Up(command, env, cwd=REPO)
    try:
        up.wait_ready(timeout_s=900)
        assert any("converting the embedded default model" in line for line in up.lines), (
            "the fresh HOME held a converted model"
        )
        answers, commands = {}, {}
        for model, chat in _chat_commands(up.lines):
            commands[model] = chat
            reply = subprocess.run(["bash", "-c", chat], capture_output=True, text=True,
                                   env=env, timeout=300)
            assert reply.returncode == 0, (chat, reply.stderr)
            body = json.loads(reply.stdout)
            assert "choices" in body, body
            answers[model] = body["choices"][0]["message"]["content"]
        assert {"shout", "french"} <= answers.keys(), up.lines
        for model, text in answers.items():
            assert EXPECT[model](text), f"{model} answered {text!r} to {commands[model]}"
        exit_code = up.ctrl_c(timeout_s=120)
        assert exit_code == 0, "\n".join(up.lines[-30:])
        deadline = time.monotonic() + 30
        while _processes_of(venv) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _processes_of(venv) == [], "processes outlived Ctrl-C"
    finally:
        if up.process.poll() is None:
            os.killpg(up.process.pid, signal.SIGKILL)
        for process in _processes_of(venv):
            process.kill()
