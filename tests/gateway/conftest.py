"""Fixtures for the gateway tests: a real store, real workers on a tiny model (in this process,
on loopback), and the gateway served by a real uvicorn server on port 0 in a thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from lorastream.bench.harness import serve_app
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient
from lorastream.gateway.app import create_app
from lorastream.gateway.config import GatewaySettings
from lorastream.gateway.state import GatewayState
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from lorastream.worker.service.server import create_server as create_worker
from tests.support.models import make_tiny_checkpoint
from tests.worker.conftest import make_tiny_adapters

BASE = "tiny"
CONTEXT = 2048  # long enough that a cancelled generation is visibly cut short
TOKEN = "operator-secret"
STORED_ADAPTERS = ("attn-r4", "mlp-r8", "all-r16-rslora")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worker tests' tiny Llama (same weights, same adapters fit) with a 2048-token context."""
    path = tmp_path_factory.mktemp("gateway-tiny") / "model"
    return make_tiny_checkpoint(path, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The worker tests' adapters, on this tiny_model."""
    return make_tiny_adapters(tiny_model, tmp_path_factory.mktemp("tiny-adapters"))


@dataclass
class WorkerHandle:
    """One worker: an engine and its gRPC server, which a test can stop and start again."""

    settings: WorkerSettings
    engine: Engine
    server: grpc.Server | None = None
    port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        settings = self.settings.model_copy(update={"port": self.port})
        self.server, self.port, _ = create_worker(settings, self.engine)
        self.server.start()

    def kill(self) -> None:
        """Stop the gRPC server at once: streams in flight are cut, new calls are refused."""
        if self.server is not None:
            self.server.stop(None).wait()
            self.server = None

    def finished(self) -> int:
        """Requests this worker has finished (each generation the gateway sent it)."""
        return self.engine.stats.finished_requests

    def generated(self) -> int:
        return self.engine.stats.generated_tokens

    def idle(self) -> bool:
        return self.engine.running == 0 and self.engine.waiting == 0


@dataclass
class Gateway:
    """The gateway app served by uvicorn in a thread."""

    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread
    url: str
    settings: GatewaySettings
    clients: list[openai.OpenAI] = field(default_factory=list)

    @property
    def state(self) -> GatewayState:
        """The running gateway's components (its worker pool, metrics, ...)."""
        state: GatewayState = self.app.state.gateway
        return state

    def openai(self, **kwargs: object) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                               timeout=30, **kwargs)  # type: ignore[arg-type]  # kwargs: OpenAI()'s own keywords
        self.clients.append(client)
        return client

    def http(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.server.should_exit = True
        self.thread.join(timeout=15)


def start_gateway(settings: GatewaySettings) -> Gateway:
    app = create_app(settings)
    server, thread, url = serve_app(app, "gateway", timeout_s=20)
    return Gateway(app, server, thread, url, settings)


@dataclass
class Cluster:
    store: str
    store_server: grpc.Server
    workers: list[WorkerHandle]
    gateway: Gateway

    def worker(self, target: str) -> WorkerHandle:
        return next(w for w in self.workers if w.target == target)

    def serving(self, before: dict[str, int]) -> dict[str, int]:
        """Requests each worker finished since ``before`` (a :meth:`finished_counts`)."""
        return {w.target: w.finished() - before[w.target] for w in self.workers}

    def finished_counts(self) -> dict[str, int]:
        return {w.target: w.finished() for w in self.workers}


ClusterFactory = Callable[..., Cluster]


@pytest.fixture(scope="module")
def cluster_factory(
    tiny_model: Path, tiny_adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterFactory]:
    """Builds clusters (store with adapters, N workers, the gateway); all stopped at the end."""
    stoppers: list[Callable[[], None]] = []

    def make(
        workers: int = 2, worker_overrides: dict[str, Any] | None = None,
        checkpoint: Path | None = None, **gateway_overrides: object,
    ) -> Cluster:
        root = tmp_path_factory.mktemp("cluster")
        store_server, store_port, _ = create_store(StoreSettings(port=0, cache_dir=root / "store"))
        store_server.start()
        stoppers.append(lambda: store_server.stop(None).wait())
        store = f"127.0.0.1:{store_port}"
        with StoreClient(store) as client:
            for name in STORED_ADAPTERS:
                for _ in client.preload(str(tiny_adapters[name]), name):
                    pass
        handles = []
        for i in range(workers):
            model = checkpoint or tiny_model  # another checkpoint of the same weights
            settings = WorkerSettings(
                model=str(model), served_model_name=BASE, port=0, store=store, max_loras=2,
                kv_cache_bytes=16 << 20, model_cache_dir=root / f"models-{i}",
                **(worker_overrides or {}),
            )
            handle = WorkerHandle(settings, build_engine(settings, checkpoint=model))
            handle.start()
            stoppers.append(handle.engine.stop)
            stoppers.append(handle.kill)
            handles.append(handle)
        options: dict[str, Any] = {
            "poll_interval_s": 0.1, "health_timeout_s": 0.5, "max_body_bytes": 1 << 20,
            **gateway_overrides,
        }
        gateway = start_gateway(GatewaySettings(
            workers=[h.target for h in handles], store=store, token=TOKEN, **options
        ))
        stoppers.append(gateway.stop)
        return Cluster(store, store_server, handles, gateway)

    yield make
    for stop in reversed(stoppers):
        stop()


@pytest.fixture(scope="module")
def cluster(cluster_factory: ClusterFactory) -> Cluster:
    """Two workers behind one gateway, shared by the tests of a module (they do not kill it)."""
    return cluster_factory(workers=2)


def worker_greedy(target: str, model: str, prompt: PromptInput, max_tokens: int) -> tuple[str, int]:
    """(text, completion tokens) of a greedy generation asked of the worker directly."""
    with WorkerClient(target) as client:
        events = list(client.generate(model, prompt, SamplingParams(max_tokens=max_tokens)))
    return "".join(e.text for e in events), events[-1].completion_tokens


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
