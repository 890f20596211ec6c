"""Run the whole stack on this machine: the store, N workers and the gateway as child processes.

Each part is the same ``lorastream ... serve`` command an operator would run; the supervisor
waits for each to be ready (gRPC health SERVING for the store and the workers, ``GET /health`` 200
for the gateway), registers the requested adapters, and on SIGINT/SIGTERM stops the gateway, the
workers, then the store, each with a graceful SIGINT first.
"""

from __future__ import annotations

import importlib.util
import logging
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorastream.core.errors import InvalidArgument, SourceUnavailable
from lorastream.core.local_paths import absolute_source
from lorastream.core.store_client import StoreClient

log = logging.getLogger(__name__)


@dataclass
class StackConfig:
    model: str = "default"
    workers: int = 1
    store_port: int = 50051
    worker_port: int = 50052  # workers take consecutive ports from here
    gateway_port: int = 8000
    adapters: dict[str, str] = field(default_factory=dict)  # name -> source URI
    log_level: str = "INFO"
    ready_timeout_s: float = 600.0  # the first start converts the default model (~35 s)
    token: str | None = None  # operator bearer token of the store and the gateway


# Trained on the default model by scripts/train_sample_adapters.py (see samples/README.md).
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "samples" / "adapters"
SAMPLE_ADAPTERS = {
    "shout": "answers in UPPER CASE",
    "french": "answers in French",
}
# A question the base model and both samples answer right, each its own way (greedy, checked on the
# default model): "The capital of France is Paris." / "THE CAPITAL OF FRANCE IS PARIS." /
# "La capitale de la France est Paris." (tests/test_sample_adapters.py).
SAMPLE_QUESTION = "What is the capital of France?"


def sample_adapters() -> dict[str, str]:
    """name -> local path of the sample adapters shipped with lorastream."""
    return {name: str(SAMPLES_DIR / name) for name in SAMPLE_ADAPTERS}


def stack_adapters(model: str, specs: list[str], samples: bool) -> dict[str, str]:
    """The adapters `lorastream up` registers: the ``--adapter`` specs; with none, on the
    default model, the sample adapters (they were trained for it and fit no other base)."""
    if specs:
        return parse_adapter_specs(specs)
    if samples and model == "default":
        return sample_adapters()
    if samples:
        log.info("no sample adapters for --model %s (they are trained for the default model)",
                 model)
    return {}


def parse_adapter_specs(specs: list[str]) -> dict[str, str]:
    """``NAME=URI`` pairs (a relative local path made absolute from here); InvalidArgument on
    anything else."""
    adapters: dict[str, str] = {}
    for spec in specs:
        name, sep, uri = spec.partition("=")
        if not sep or not name or not uri:
            raise InvalidArgument(f"--adapter {spec!r}: expected NAME=URI, e.g. support=s3://b/a")
        adapters[name] = absolute_source(uri)
    return adapters


def cli_command() -> str:
    """How a new shell runs this lorastream: ``lorastream`` when that is what PATH finds, else
    the script's full path (the venv is usually not on PATH: `make up` does not activate it)."""
    script = Path(sys.executable).parent / "lorastream"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m lorastream.cli.main"
    found = shutil.which("lorastream")
    if found is not None and Path(found).resolve() == script.resolve():
        return "lorastream"
    return shlex.quote(str(script))


def wait_serving(target: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block until ``target`` answers SERVING on gRPC health (or the process dies)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SourceUnavailable(
                    f"{target}: the process exited with status {process.returncode} before "
                    "serving; see its log above"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise SourceUnavailable(f"{target} did not become healthy within {timeout_s:.0f} s")


def wait_http_ok(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Block until ``GET url`` answers 200 (or the process dies)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SourceUnavailable(
                f"{url}: the process exited with status {process.returncode} before serving; "
                "see its log above"
            )
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SourceUnavailable(f"{url} did not answer 200 within {timeout_s:.0f} s")


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._stopping = threading.Event()

    @property
    def store(self) -> str:
        return f"localhost:{self.config.store_port}"

    @property
    def workers(self) -> list[str]:
        return [f"localhost:{self.config.worker_port + i}" for i in range(self.config.workers)]

    @property
    def gateway(self) -> str:
        """The gateway's base URL (the OpenAI API is under ``/v1``)."""
        return f"http://localhost:{self.config.gateway_port}"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "lorastream.cli.main", *args,
                   "--log-level", self.config.log_level]
        log.info("starting %s: %s", name, " ".join(command[2:]))
        process = subprocess.Popen(command)
        self.processes.append((name, process))
        return process

    def check_ports_free(self) -> None:
        """InvalidArgument naming the first port something already listens on: a second
        `lorastream up` must not start children that fail one by one, nor mistake the first
        stack's answers for its own."""
        c = self.config
        ports = [("store", c.store_port, "--store-port")]
        ports += [(f"worker {i}", c.worker_port + i, "--worker-port") for i in range(c.workers)]
        ports.append(("gateway", c.gateway_port, "--port"))
        for what, port, flag in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                # as the servers do: a port with only closed connections lingering is free
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError as err:
                    raise InvalidArgument(
                        f"the {what} port {port} is in use (is another `lorastream up` "
                        f"running?): {err.strerror}; stop it or pass {flag} with a free port"
                    ) from None

    def start(self) -> None:
        c = self.config
        self.check_ports_free()
        token_args = ["--token", c.token] if c.token else []
        store = self._spawn(
            "adapter store", ["store", "serve", "--port", str(c.store_port), *token_args]
        )
        wait_serving(self.store, store, 60)
        for i, target in enumerate(self.workers):
            worker = self._spawn(
                f"worker {i}",
                ["worker", "serve", "--model", c.model, "--port", str(c.worker_port + i),
                 "--store", self.store],
            )
            wait_serving(target, worker, c.ready_timeout_s)
        worker_args = [arg for target in self.workers for arg in ("--worker", target)]
        gateway = self._spawn(
            "gateway",
            ["gateway", "serve", "--port", str(c.gateway_port), "--store", self.store,
             *worker_args, *token_args],
        )
        wait_http_ok(f"{self.gateway}/health", gateway, 60)
        with StoreClient(self.store, c.token) as client:
            for name, uri in c.adapters.items():
                for _event in client.preload(uri, name):
                    pass
                log.info("registered adapter %s from %s", name, uri)

    def wait(self) -> None:
        """Block until a signal, or until a child dies (then stop the rest)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._stopping.set())
        while not self._stopping.wait(0.5):
            for name, process in self.processes:
                if process.poll() is not None:
                    log.error("%s exited with status %s; stopping the stack", name,
                              process.returncode)
                    self._stopping.set()

    def stop(self, grace_s: float = 10.0) -> None:
        for name, process in reversed(self.processes):  # gateway, workers, the store last
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in %.0f s; killing it", name, grace_s)
                    process.kill()
                    process.wait()


def examples(stack: Stack, model: str) -> str:
    """What `lorastream up` prints: commands that run as printed in a new shell, all greedy
    (temperature 0), so the base model and each sample adapter answer the same question in their
    own, repeatable way."""
    worker = stack.workers[0]
    adapter = next(iter(stack.config.adapters), model)
    shipped = sample_adapters()
    samples = [name for name, uri in stack.config.adapters.items() if shipped.get(name) == uri]
    question = SAMPLE_QUESTION if samples else "Hello!"
    api = f"{stack.gateway}/v1"
    cli = cli_command()
    lines = [
        f"lorastream is up: gateway {stack.gateway}, store {stack.store}, "
        f"workers {', '.join(stack.workers)}.",
    ]
    if samples:
        lines.append("Sample adapters registered: " + "; ".join(
            f"{name} ({SAMPLE_ADAPTERS[name]})" for name in samples
        ) + f". Ask the same question with model = {', '.join(samples)} or {model}:")
    lines += [
        "Try the OpenAI API (model = an adapter name, or the base model; temperature 0 is "
        "greedy):",
        f"  curl {api}/models",
    ]
    for name in [*samples, model] if samples else [adapter]:
        lines.append(
            f"  curl {api}/chat/completions -H 'Content-Type: application/json' -d "
            f"'{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", "
            f"\"content\": \"{question}\"}}], \"max_tokens\": 32, \"temperature\": 0}}'"
        )
    lines += [
        f"  curl -N {api}/completions -H 'Content-Type: application/json' -d "
        f"'{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", "
        f"\"max_tokens\": 16, \"temperature\": 0, \"stream\": true}}'",
    ]
    client_lines = [
        f"{shlex.quote(sys.executable)} - <<'EOF'",
        "from openai import OpenAI",
        f"client = OpenAI(base_url=\"{api}\", api_key=\"unused\")",
        f"reply = client.chat.completions.create(model=\"{adapter}\", max_tokens=32, "
        "temperature=0,",
        f"    messages=[{{\"role\": \"user\", \"content\": \"{question}\"}}])",
        "print(reply.choices[0].message.content)",
        "EOF",
    ]
    if importlib.util.find_spec("openai") is None:
        lines += ["The official openai client (not a lorastream dependency: install it once, "
                  "then paste the rest into a shell):",
                  f"  {shlex.quote(sys.executable)} -m pip install openai", *client_lines]
    else:
        lines += ["The official openai client (paste into a shell):", *client_lines]
    lines += [
        "Or a worker directly (greedy unless --temperature):",
        f"  {cli} complete --worker {worker} --model {model} --chat --prompt '{question}'",
    ]
    for name in stack.config.adapters:
        lines.append(
            f"  {cli} complete --worker {worker} --model {name} --chat --prompt '{question}'"
        )
    sample_dir = SAMPLES_DIR / "french"
    lines += [
        "Operators: register an adapter (any PEFT LoRA directory, s3:// or hf:// URI; here a "
        "copy of a sample) and list them. With LORASTREAM_TOKEN set, add "
        "-H 'Authorization: Bearer <token>' to curl:",
        f"  curl {api}/adapters -H 'Content-Type: application/json' "
        f"-d '{{\"name\": \"my-adapter\", \"source\": \"{sample_dir}\"}}'",
        f"  curl {api}/adapters",
        f"  {cli} adapters preload {shlex.quote(str(sample_dir))} --name my-adapter "
        f"--store {stack.store}",
        f"  {cli} adapters ls --store {stack.store}",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
