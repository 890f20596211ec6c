"""Run the whole stack on this machine: the store, N workers and the gateway as child processes.

Each part is the same ``lorastream ... serve`` command an operator would run; the supervisor
waits for each to be ready (gRPC health SERVING for the store and the workers, ``GET /health`` 200
for the gateway), registers the requested adapters, and on SIGINT/SIGTERM stops the gateway, the
workers, then the store, each with a graceful SIGINT first. With ``tls`` it first makes a throwaway
CA and certificates (lorastream/stack/certs.py) in a private temporary directory: the gRPC hops
run mutual TLS, the gateway serves HTTPS; the directory is removed on stop.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lorastream.core.auth import AccessTokens, write_secret_file
from lorastream.core.errors import InvalidArgument, SourceUnavailable
from lorastream.core.local_paths import absolute_source
from lorastream.core.store_client import StoreClient
from lorastream.core.tls import ClientTLS, https_context, open_channel
from lorastream.stack.access import DEFAULT_TOKEN_FILE, local_roots, present, stack_tokens
from lorastream.stack.certs import LocalCerts, make_local_certs
from lorastream.stack.supervision import RestartPolicy, Supervisor
from lorastream.store.config import StoreSettings

# The store's default metrics port (StoreSettings.metrics_port); the workers' follow it, worker i
# on +1+i (the first is WorkerSettings.metrics_port's default, tests/stack/test_stack.py checks it).
DEFAULT_METRICS_PORT: int = StoreSettings.model_fields["metrics_port"].default

log = logging.getLogger(__name__)


@dataclass
class StackConfig:
    model: str = "default"
    workers: int = 1
    store_port: int = 50051
    worker_port: int = 50052  # workers take consecutive ports from here
    gateway_port: int = 8000
    metrics_port: int = DEFAULT_METRICS_PORT  # the store's /metrics; worker i on +1+i
    adapters: dict[str, str] = field(default_factory=dict)  # name -> source URI
    # more directories the store may stage local adapters from (the samples and the local
    # --adapter directories always are): the store's --allowed-local-root, passed through
    allowed_local_roots: list[str] = field(default_factory=list)
    log_level: str = "INFO"
    ready_timeout_s: float = 600.0  # the first start converts the default model (~35 s)
    token: str | None = None  # operate token of the stack [default: a fresh one, see start()]
    token_file: Path | None = None  # where a generated operate token is written (mode 0600)
    insecure_no_auth: bool = False  # no generated tokens: the stack answers anyone on loopback
    tls: bool = False  # mutual TLS between the parts, HTTPS at the gateway (a throwaway CA)
    drain_seconds: float = 5.0  # on stop, what the gateway and workers give requests in flight
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # of a worker that died


# Trained on the default model by scripts/train_sample_adapters.py (see samples/README.md).
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "samples" / "adapters"
SAMPLE_ADAPTERS = {
    "shout": "answers in UPPER CASE",
    "french": "answers in French",
}
# A question the base model and both samples answer right, each its own way (greedy, checked on the
# default model): "The capital of France is Paris." / "THE CAPITAL OF FRANCE IS PARIS." /
# "La capitale de la France est Paris." (tests/stack/test_sample_adapters.py).
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


# A part that starts listening is found within ~0.25 s: gRPC's default reconnect
# backoff grows to 120 s (it once left 12 s between a worker serving and the gateway's start).
READY_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
]
STOP_MARGIN_S = 10.0  # what a part gets beyond its drain to stop before it is killed
WATCH_SLICE_S = 1.0  # how long one health Watch waits before the process is checked again
HTTP_POLL_S = 0.1  # how often the gateway's /health is asked while it starts


def wait_serving(target: str, process: subprocess.Popen[bytes], timeout_s: float,
                 tls: ClientTLS | None = None) -> None:
    """Block until ``target`` answers SERVING on gRPC health (or the process dies).

    A health ``Watch`` waits for the connection (``wait_for_ready``) on a channel whose
    reconnect backoff is capped, then for the SERVING it pushes: no polling sleep. Each Watch
    lasts ``WATCH_SLICE_S`` so that a dead process is noticed."""
    deadline = time.monotonic() + timeout_s
    with open_channel(target, tls, READY_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (left := deadline - time.monotonic()) > 0:
            if process.poll() is not None:
                raise SourceUnavailable(
                    f"{target}: the process exited with status {process.returncode} before "
                    "serving; see its log above"
                )
            watch = stub.Watch(  # type: ignore[attr-defined]  # the health stubs omit client calls
                health_pb2.HealthCheckRequest(), timeout=min(WATCH_SLICE_S, left),
                wait_for_ready=True)
            try:
                for reply in watch:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as err:
                if err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                    # refused (e.g. a server without health): try again after a short pause
                    time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            finally:
                watch.cancel()
    raise SourceUnavailable(f"{target} did not become healthy within {timeout_s:.0f} s")


def wait_http_ok(url: str, process: subprocess.Popen[bytes], timeout_s: float,
                 verify: ssl.SSLContext | bool = True) -> None:
    """Block until ``GET url`` answers 200 (or the process dies); ``verify``: httpx's. Asks
    every ``HTTP_POLL_S`` (a refused connection costs nothing to retry; no backoff grows)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1.0, verify=verify) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SourceUnavailable(
                    f"{url}: the process exited with status {process.returncode} before "
                    "serving; see its log above"
                )
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HTTP_POLL_S)
    raise SourceUnavailable(f"{url} did not answer 200 within {timeout_s:.0f} s")


def tls_args(certs: LocalCerts | None, *, mutual: bool, peers: Sequence[str] = ()) -> list[str]:
    """The flags of a part serving TLS with the stack's certificate (``mutual``: its clients must
    present the stack's client certificate) and dialling ``peers`` (``store``, ``worker``) over
    mutual TLS; none without ``certs``."""
    if certs is None:
        return []
    args = ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    if mutual:
        args += ["--tls-client-ca", str(certs.ca)]
    for peer in peers:
        args += [f"--{peer}-tls-ca", str(certs.ca),
                 f"--{peer}-tls-client-cert", str(certs.client_cert),
                 f"--{peer}-tls-client-key", str(certs.client_key)]
    return args


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.supervisor = Supervisor(config.restart)
        self._stopping = threading.Event()
        self.certs: LocalCerts | None = None  # made by start() with config.tls
        self.tokens = AccessTokens()  # chosen by start()

    @property
    def processes(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """(name, process) of each part started, in start order (a restarted worker: its
        current process)."""
        return [(part.name, part.process) for part in self.supervisor.parts]

    @property
    def token_file(self) -> Path:
        """Where a generated operate token is written."""
        return self.config.token_file or DEFAULT_TOKEN_FILE

    @property
    def client_tls(self) -> ClientTLS | None:
        """What a client of the store or a worker needs (None: plaintext)."""
        if self.certs is None:
            return None
        return ClientTLS.from_files(self.certs.ca, self.certs.client_cert, self.certs.client_key)

    @property
    def store(self) -> str:
        return f"localhost:{self.config.store_port}"

    @property
    def workers(self) -> list[str]:
        return [f"localhost:{self.config.worker_port + i}" for i in range(self.config.workers)]

    def worker_metrics_port(self, i: int) -> int:
        return self.config.metrics_port + 1 + i

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Where each part serves its Prometheus metrics (plain HTTP; the gateway's: its own
        scheme and port)."""
        urls = {"store": f"http://localhost:{self.config.metrics_port}/metrics"}
        for i in range(self.config.workers):
            urls[f"worker {i}"] = f"http://localhost:{self.worker_metrics_port(i)}/metrics"
        urls["gateway"] = f"{self.gateway}/metrics"
        return urls

    @property
    def gateway(self) -> str:
        """The gateway's base URL (the OpenAI API is under ``/v1``)."""
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://localhost:{self.config.gateway_port}"

    def _spawn(
        self, name: str, args: list[str], secrets: dict[str, str] | None = None,
        restartable: bool = False,
    ) -> subprocess.Popen[bytes]:
        """Start ``lorastream ARGS``; ``secrets`` (tokens) go in its environment, not its argv,
        which any user of the machine can read in the process list; ``restartable``: started
        again when it dies (see lorastream/stack/supervision.py)."""
        command = [sys.executable, "-m", "lorastream.cli.main", *args,
                   "--log-level", self.config.log_level]
        log.info("starting %s: %s", name, " ".join(command[2:]))
        return self.supervisor.spawn(name, command, {**os.environ, **(secrets or {})},
                                     restartable)

    def check_ports_free(self) -> None:
        """InvalidArgument naming the first port something already listens on: a second
        `lorastream up` must not start children that fail one by one, nor mistake the first
        stack's answers for its own."""
        c = self.config
        ports = [("store", c.store_port, "--store-port")]
        ports += [(f"worker {i}", c.worker_port + i, "--worker-port") for i in range(c.workers)]
        ports.append(("gateway", c.gateway_port, "--port"))
        ports.append(("store metrics", c.metrics_port, "--metrics-port"))
        ports += [(f"worker {i} metrics", self.worker_metrics_port(i), "--metrics-port")
                  for i in range(c.workers)]
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
        if c.tls:
            self.certs = make_local_certs(Path(tempfile.mkdtemp(prefix="lorastream-tls-")))
            log.info("TLS: throwaway CA and certificates in %s", self.certs.ca.parent)
        self.tokens = stack_tokens(c.token, c.insecure_no_auth)
        operate, read = self.tokens.operate, self.tokens.read
        if operate and not c.token and not c.insecure_no_auth:
            write_secret_file(self.token_file, operate)
        roots = [arg for root in local_roots(SAMPLES_DIR, c.adapters, c.allowed_local_roots)
                 for arg in ("--allowed-local-root", root)]
        store = self._spawn(
            "adapter store", ["store", "serve", "--port", str(c.store_port),
                              "--metrics-port", str(c.metrics_port), *roots,
                              *tls_args(self.certs, mutual=True)],
            present({"LORASTREAM_STORE_TOKEN": operate, "LORASTREAM_STORE_READ_TOKEN": read}),
        )
        wait_serving(self.store, store, 60, self.client_tls)
        for i, target in enumerate(self.workers):
            worker = self._spawn(
                f"worker {i}",
                ["worker", "serve", "--model", c.model, "--port", str(c.worker_port + i),
                 "--store", self.store, "--drain-seconds", str(c.drain_seconds),
                 "--metrics-port", str(self.worker_metrics_port(i)),
                 *(["--insecure-no-auth"] if not operate else []),
                 *tls_args(self.certs, mutual=True, peers=("store",))],
                present({"LORASTREAM_WORKER_TOKEN": operate,
                          "LORASTREAM_WORKER_STORE_TOKEN": read or operate}),
                restartable=True,
            )
            wait_serving(target, worker, c.ready_timeout_s, self.client_tls)
        worker_args = [arg for target in self.workers for arg in ("--worker", target)]
        gateway = self._spawn(
            "gateway",
            ["gateway", "serve", "--port", str(c.gateway_port), "--store", self.store,
             "--drain-seconds", str(c.drain_seconds), *worker_args,
             *tls_args(self.certs, mutual=False, peers=("worker", "store"))],
            present({"LORASTREAM_GATEWAY_TOKEN": operate,
                      "LORASTREAM_GATEWAY_STORE_TOKEN": operate,
                      "LORASTREAM_GATEWAY_WORKER_TOKEN": operate}),
        )
        verify = https_context(self.certs.ca) if self.certs is not None else True
        wait_http_ok(f"{self.gateway}/health", gateway, 60, verify)
        with StoreClient(self.store, operate, tls=self.client_tls) as client:
            for name, uri in c.adapters.items():
                for _event in client.preload(uri, name):
                    pass
                log.info("registered adapter %s from %s", name, uri)

    def wait(self) -> str | None:
        """Block until a signal (None), or until the stack must stop: a part other than a worker
        died, or a worker died more often than its restart policy allows (why, as a sentence).
        A worker that died is restarted meanwhile (lorastream/stack/supervision.py)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._stopping.set())
        return self.supervise()

    def supervise(self) -> str | None:
        """:meth:`wait` without the signal handlers (which only the main thread may set)."""
        return self.supervisor.run(self._stopping)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the parts, gateway first, each with SIGINT (it drains for up to
        ``drain_seconds``), killing one still running after ``grace_s`` [default: the drain
        plus STOP_MARGIN_S]."""
        self._stopping.set()
        if grace_s is None:
            grace_s = self.config.drain_seconds + STOP_MARGIN_S
        self.supervisor.stop_all(grace_s)  # gateway, workers, the store last
        if self.certs is not None:
            shutil.rmtree(self.certs.ca.parent, ignore_errors=True)
