"""The endpoint picker's contract, live on loopback: three pod-shaped lorastream model servers (a
real worker, its metrics server and a one-worker gateway as its OpenAI front, as
``deploy/k8s/inference-pool/model-server.yaml`` runs them) under streamed load with adapters
running, waiting and cold. Each pod's ``/metrics`` is scraped and parsed as llm-d-router's
metrics extractor does (``lorastream.bench.endpoint_picker``, which cites the Go files and the
commit it ports); the picker's view of every pod must equal that pod's true slots and queue at
that moment, read from the engine itself (its slot table and scheduler), and the lora-affinity
scores must be those the protocol promises.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from lorastream.bench.endpoint_picker import EndpointView, extract, lora_affinity
from lorastream.core.store_client import StoreClient
from lorastream.gateway.config import GatewaySettings
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server as create_store
from lorastream.worker.engine.engine import Engine
from lorastream.worker.service.bootstrap import build_engine
from lorastream.worker.service.config import WorkerSettings
from tests.gateway.conftest import Gateway, WorkerHandle, start_gateway, wait_until
from tests.support.models import make_tiny_checkpoint
from tests.worker.conftest import make_tiny_adapters

SLOTS = 2
A, B, C, COLD = "attn-r4", "mlp-r8", "all-r16-rslora", "all-r64"
LONG = 1900  # tokens of a load stream (EOS ignored): it outlives the scrapes
SETTLE_S = 120.0  # how long the pods get to reach the state the test built (not a bound)


@dataclass
class Pod:
    """One model-server pod: the worker, its metrics port and its OpenAI front."""

    worker: WorkerHandle
    metrics_port: int
    front: Gateway
    running: str  # the worker's --picker-running: what running_lora_adapters lists
    streams: list[threading.Thread] = field(default_factory=list)

    @property
    def engine(self) -> Engine:
        return self.worker.engine

    def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return str(response.read().decode())

    def complete(self, model: str, max_tokens: int) -> None:
        self.front.openai().completions.create(
            model=model, prompt="hello there", max_tokens=max_tokens,
            extra_body={"ignore_eos": True},
        )

    def stream(self, model: str, stop: threading.Event) -> None:
        """Start a long streamed completion for ``model`` through the front, read until ``stop``."""
        client = self.front.openai()

        def read() -> None:
            with client.completions.create(
                model=model, prompt="hello there", max_tokens=LONG, stream=True,
                extra_body={"ignore_eos": True},
            ) as chunks:
                for _ in chunks:
                    if stop.is_set():
                        return

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        self.streams.append(thread)


@dataclass(frozen=True)
class Truth:
    """A pod's state read from the engine itself: adapter ids in slots (copy complete) -- or,
    with ``--picker-running held``, in a slot or in host memory --, ids of adapters that waiting
    requests need and no slot holds ready, and the queue."""

    ready: frozenset[str]
    wanted: frozenset[str]
    waiting: int
    running: int


def truth(engine: Engine, running: str) -> Truth:
    in_slots = {info.adapter_id for info in engine.slots.table if info.adapter_id is not None}
    snapshots = [engine.adapters.inspect(name) for name in (A, B, C, COLD)]
    ready = frozenset(  # in the slot table, its copy complete
        s.adapter_id for s in snapshots
        if s is not None and s.adapter_id in in_slots and s.residency == "device"
    )
    held = ready | frozenset(  # or whole in host memory, its weights checked
        s.adapter_id for s in snapshots if s is not None and s.residency == "host"
    )
    waiting = tuple(engine.scheduler.waiting)
    wanted = frozenset(s.adapter_id for s in waiting if s.adapter_id is not None) - ready
    return Truth(held if running == "held" else ready, wanted, engine.waiting, engine.running)


def ids(engine: Engine, names: frozenset[str]) -> frozenset[str]:
    return frozenset(engine.adapters.resolve(name) for name in names)


def scraped_at_a_still_moment(pod: Pod) -> tuple[EndpointView, Truth]:
    """The picker's view from one scrape, with the engine's truth read before and after it
    unchanged (so the scrape saw that state); tries again while the state moves."""
    for _ in range(50):
        before = truth(pod.engine, pod.running)
        view = extract(pod.scrape())
        if truth(pod.engine, pod.running) == before:
            return view, before
    raise AssertionError("the pod's state never held still across a scrape")


@pytest.fixture(scope="module", params=["held", "device"])
def pods(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
         ) -> Iterator[list[Pod]]:
    """Three pods whose workers list ``request.param`` adapters as running (--picker-running)."""
    root = tmp_path_factory.mktemp("pool")
    model = make_tiny_checkpoint(root / "model", max_position_embeddings=2048)
    adapters = make_tiny_adapters(model, root / "adapters")
    store_server, store_port, _ = create_store(StoreSettings(port=0, cache_dir=root / "store"))
    store_server.start()
    store = f"127.0.0.1:{store_port}"
    with StoreClient(store) as client:
        for name, path in adapters.items():
            for _ in client.preload(str(path), name):
                pass
    stoppers: list[Callable[[], None]] = [lambda: store_server.stop(None).wait()]
    made = []
    for i in range(3):
        settings = WorkerSettings(
            model=str(model), served_model_name="tiny", port=0, store=store, max_loras=SLOTS,
            max_lora_rank=64, kv_cache_bytes=16 << 20, model_cache_dir=root / f"models-{i}",
            picker_running=request.param,
        )
        worker = WorkerHandle(settings, build_engine(settings, checkpoint=model))
        worker.start()
        stoppers += [worker.engine.stop, worker.kill]
        metrics_port = worker.engine.adapters.metrics.serve(0)
        front = start_gateway(GatewaySettings(
            workers=[worker.target], store=store, poll_interval_s=0.1, health_timeout_s=0.5,
        ))
        stoppers.append(front.stop)
        made.append(Pod(worker, metrics_port, front, request.param))
    yield made
    for stop in reversed(stoppers):
        stop()


@pytest.fixture(scope="module")
def loaded(pods: list[Pod]) -> Iterator[list[Pod]]:
    """pod 0: A and B running, C waiting for a slot; pod 1: B resident and idle, C running, A
    evicted from its slot (to host memory) to make room for C; pod 2: nothing. COLD is in the
    store only."""
    stop = threading.Event()
    pods[1].complete(A, max_tokens=2)
    pods[1].complete(B, max_tokens=2)  # A and B stay in the slots, unused
    pods[0].stream(A, stop)
    pods[0].stream(B, stop)
    pods[1].stream(C, stop)  # takes A's slot: A was used least recently
    assert wait_until(lambda: pods[0].engine.running == 2 and pods[1].engine.running == 1,
                      SETTLE_S)
    pods[0].stream(C, stop)  # both of pod 0's slots are held by running requests: C waits
    assert wait_until(lambda: pods[0].engine.waiting == 1, SETTLE_S)
    # ... in host memory once its fetch ended (what --picker-running held lists)
    assert wait_until(lambda: pods[0].engine.adapters.status(C).residency == "host", SETTLE_S)
    yield pods
    stop.set()
    for pod in pods:
        for thread in pod.streams:
            thread.join(timeout=60)


EXPECTED = {  # (running, waiting, queue waiting, queue running) as built by ``loaded``
    "device": [({A, B}, {C}, 1, 2), ({B, C}, set(), 0, 1), (set(), set(), 0, 0)],
    # held: pod 0 holds C in host memory while it waits for a slot, pod 1 holds A evicted there
    "held": [({A, B, C}, {C}, 1, 2), ({A, B, C}, set(), 0, 1), (set(), set(), 0, 0)],
}


@pytest.mark.parametrize("index", range(3))
def test_the_pickers_view_of_each_pod_is_its_true_slots_and_queue(
    loaded: list[Pod], index: int
) -> None:
    pod = loaded[index]
    view, true = scraped_at_a_still_moment(pod)
    running, waiting, queued, batch = EXPECTED[pod.running][index]
    # the view against the engine's own state at that moment
    assert ids(pod.engine, view.active_models) == true.ready
    assert ids(pod.engine, view.waiting_models) == true.wanted
    assert (view.waiting_queue_size, view.running_requests_size) == (true.waiting, true.running)
    # and against what the test built
    assert (view.active_models, view.waiting_models) == (running, waiting)
    assert (view.waiting_queue_size, view.running_requests_size) == (queued, batch)
    assert view.max_active_models == SLOTS
    assert COLD not in view.active_models | view.waiting_models
    if index == 1:  # A was evicted to host memory: listed as running only with held
        assert pod.engine.adapters.status(A).residency == "host"
        assert (A in view.active_models) == (pod.running == "held")
    assert view.num_gpu_blocks == pod.engine.kv.num_blocks and view.block_size > 0
    assert view.kv_cache_usage == pod.engine.kv.allocator.used_blocks / pod.engine.kv.num_blocks \
        or batch > 0  # a running pod's KV use moves with every step; an idle one's is exact


def test_lora_affinity_scores_follow_residency_and_queue(loaded: list[Pod]) -> None:
    views = [scraped_at_a_still_moment(pod)[0] for pod in loaded]
    scores = {m: [lora_affinity(v, m) for v in views] for m in (A, B, C, COLD)}
    assert scores == {
        "device": {
            A: [1.0, 0.0, 0.8],  # evicted from pod 1, whose slots are both taken
            B: [1.0, 1.0, 0.8],  # resident on pods 0 and 1 (idle on 1): no load there
            C: [0.6, 1.0, 0.8],  # waiting on pod 0, running on pod 1
            COLD: [0.0, 0.0, 0.8],  # only pod 2 has a free slot
        },
        "held": {
            A: [1.0, 1.0, 0.8],  # pod 1 holds it in host memory: a slot copy away
            B: [1.0, 1.0, 0.8],
            C: [1.0, 1.0, 0.8],  # in pod 0's host memory, waiting for a slot there
            COLD: [0.0, 0.0, 0.8],
        },
    }[loaded[0].running]


def test_the_front_serves_the_adapter_named_in_model(loaded: list[Pod]) -> None:
    before = loaded[2].engine.stats.finished_requests
    loaded[2].complete(COLD, max_tokens=2)
    assert loaded[2].engine.stats.finished_requests == before + 1
    assert COLD in extract(loaded[2].scrape()).active_models
