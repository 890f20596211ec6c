"""Routing a zipf trace over pod-shaped workers: llm-d-router's endpoint picker against random
and against lorastream's own gateway, on the same trace in one run (``lorastream bench pool``;
docs/deploy.md, "Under an InferencePool").

1. **setup**: a store holding ``adapters`` synthetic adapters (attention projections, rank
   ``rank``, fp16); ``workers`` pods (``lorastream.bench.pool_pods``: a worker process with
   ``slots`` device slots and a small host cache, its metrics port, a one-worker gateway as its
   OpenAI front) and one gateway over all the workers. More adapters than slots in all: where a
   request lands decides whether its adapter must be fetched and copied.
2. **per policy**, every worker restarted first (each run starts cold), then the same trace of
   ``requests`` streamed completions (zipf(``zipf_s``) over the adapters, ``max_tokens`` tokens,
   EOS ignored, ``concurrency`` in flight):

   - **picker**: each pod's ``/metrics`` scraped every ``refresh_ms`` (the picker's refresh
     interval, one scraper per pod) and parsed by ``endpoint_picker.extract``; each request goes
     to the front of the pod ``endpoint_picker.pick`` chooses from the latest views (lora-affinity
     x2, queue x1, kv-cache x1, as deploy/k8s/inference-pool/epp-config.yaml weighs them);
   - **random**: to the front of a pod drawn uniformly (seeded);
   - **gateway**: to lorastream's gateway over all the workers (its residency routing,
     ``lorastream.gateway.routing``, from its own polls).

   **held share** (``fleet.held_share``): of the requests the workers counted (their own
   ``lorastream_worker_adapter_{hits,misses}_total``, before and after), those whose adapter was
   in a device slot or in host memory of the worker that served it. Tokens/s and TTFT p50 are
   context.
3. **/metrics under saturation**: ``saturate_streams`` long streams at once to pod 0's front
   (several times its batch), its ``/metrics`` scraped every ``refresh_ms`` meanwhile by a
   process of its own (``lorastream.bench.pool_scrape``: as the picker is, and away from this
   process's streaming clients); latency p50/p99 of the scrapes that saw requests waiting (the
   worker saturated). The same from a thread of this process beside it, for comparison.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from lorastream.bench.endpoint_picker import EndpointView, PickerWeights, extract, pick
from lorastream.bench.fleet import (
    Result,
    completion,
    held_share,
    summarise,
    worker_counters,
    zipf_trace,
)
from lorastream.bench.harness import free_port, percentiles, running_store
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.pool_pods import Pods, PodSettings
from lorastream.bench.scale import ScaleConfig, adapter_name, register_adapters
from lorastream.bench.synthetic import ATTENTION, checkpoint_shape

# picker: the workers list held adapters (slot or host memory) as running, the default;
# picker-device: only those ready in a slot (--picker-running device), the protocol's wording
POLICIES = ("picker", "picker-device", "random", "gateway")
WEIGHTS = PickerWeights()  # as deploy/k8s/inference-pool/epp-config.yaml weighs the scorers


@dataclass(frozen=True)
class PoolConfig:
    model: str = "default"
    workers: int = 3
    adapters: int = 32
    slots: int = 2
    rank: int = 8
    host_cache_bytes: int = 16 << 20
    requests: int = 200
    concurrency: int = 6
    zipf_s: float = 1.1
    max_tokens: int = 8
    refresh_ms: float = 50.0  # the picker's scrape interval
    saturate_streams: int = 24
    saturate_tokens: int = 160  # long enough for a few hundred scrapes: p99 is not the max
    seed: int = 0

    def pod_settings(self) -> PodSettings:
        return PodSettings(model=self.model, slots=self.slots, max_lora_rank=self.rank,
                           host_cache_bytes=self.host_cache_bytes)


# -- the picker's side -----------------------------------------------------------------------------
class PickerRouter:
    """The endpoint picker over ``pods`` pods: the latest view of each (every scrape
    updates it as the extractor does: a family missing from a scrape leaves its part as it
    was), and the choice for a request from those views."""

    def __init__(self, pods: int, rng: random.Random, weights: PickerWeights = WEIGHTS) -> None:
        self.views = [EndpointView() for _ in range(pods)]
        self.weights = weights
        self._rng = rng
        self._lock = threading.Lock()

    def update(self, pod: int, metrics_text: str) -> EndpointView:
        with self._lock:
            self.views[pod] = extract(metrics_text, self.views[pod])
            return self.views[pod]

    def choose(self, model: str) -> int:
        with self._lock:
            return pick(self.views, model, self._rng, self.weights)


class Scraper:
    """Scrapes ``url`` every ``interval_s`` on a thread until stopped, each text handed to
    ``seen`` (which returns the view it gave); the latency of every scrape is kept with whether
    the worker had requests waiting then."""

    def __init__(self, url: str, interval_s: float,
                 seen: Callable[[str], EndpointView] = extract) -> None:
        self.url, self.interval_s, self.seen = url, interval_s, seen
        self.samples: list[tuple[float, bool]] = []  # (seconds, requests waiting)
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"scrape {url}", daemon=True)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            next_at = time.perf_counter()
            while not self._stop.is_set():
                started = time.perf_counter()
                try:
                    text = client.get(self.url).text
                except httpx.HTTPError:
                    self.errors += 1
                else:
                    took = time.perf_counter() - started
                    self.samples.append((took, self.seen(text).waiting_queue_size > 0))
                next_at += self.interval_s  # a fixed rate, as a ticker: a slow scrape is not
                self._stop.wait(max(0.0, next_at - time.perf_counter()))  # followed by a gap


class ChildScraper:
    """:class:`Scraper`'s timing in a process of its own (``lorastream.bench.pool_scrape``),
    started on enter and stopped on exit, when its samples are read."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.args = [sys.executable, "-m", "lorastream.bench.pool_scrape", url, str(interval_s)]
        self.samples: list[tuple[float, bool]] = []
        self.errors = 0

    def __enter__(self) -> ChildScraper:
        self._process = subprocess.Popen(self.args, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE)
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self._process.communicate(b"", timeout=120)  # stdin closed: it stops, prints
        if self._process.returncode != 0:
            raise RuntimeError(f"the scraper exited with status {self._process.returncode}")
        result = json.loads(out)
        self.samples = [(float(s), bool(w)) for s, w in result["samples"]]
        self.errors = int(result["errors"])


def scrape_latency(samples: Sequence[tuple[float, bool]]) -> dict[str, Any]:
    """p50/p99 (ms) of every scrape and of those that saw requests waiting."""
    saturated = [s for s, waiting in samples if waiting]
    return {"scrapes": len(samples), "all_ms": percentiles([s for s, _ in samples]),
            "saturated_scrapes": len(saturated), "saturated_ms": percentiles(saturated),
            "saturated_max_ms": round(max(saturated) * 1000, 1) if saturated else None}


def random_targets(requests: int, pods: int, seed: int) -> list[int]:
    """The pod of each request under random routing, drawn once (the same for any timing)."""
    rng = random.Random(f"{seed}/random")
    return [rng.randrange(pods) for _ in range(requests)]


# -- runs ------------------------------------------------------------------------------------------
def send(trace: Sequence[int], url_of: Callable[[int, str], str], client: httpx.Client,
         c: PoolConfig) -> list[Result]:
    """Every request of ``trace`` (adapter indices), ``c.concurrency`` at a time, request ``i``
    for adapter ``a`` sent to ``url_of(i, name of a)`` when a client is free."""
    def one(item: tuple[int, int]) -> Result:
        i, adapter = item
        name = adapter_name(adapter)
        return completion(client, url_of(i, name), name, i, c.max_tokens)

    with ThreadPoolExecutor(c.concurrency) as pool:
        return list(pool.map(one, enumerate(trace)))


def counters(pods: Pods) -> dict[str, dict[str, float]]:
    """Each worker's adapter counters (``fleet.worker_counters``), by metrics URL."""
    return {url: worker_counters(httpx.get(url, timeout=10).text) for url in pods.metrics_urls}


def counted_per_worker(before: dict[str, dict[str, float]],
                       after: dict[str, dict[str, float]]) -> list[int]:
    """Requests each worker counted between ``before`` and ``after`` (device hits + misses)."""
    return [int(sum(after[w].get(k, 0) - before.get(w, {}).get(k, 0)
                    for k in ("hits:device", "misses:device"))) for w in after]


def run_policy(policy: str, pods: Pods, trace: Sequence[int], c: PoolConfig) -> dict[str, Any]:
    """One cold run of ``trace`` routed by ``policy``; its figures (module docstring)."""
    restart_s = pods.restart("device" if policy == "picker-device" else "held")
    assert pods.gateway is not None
    fronts = [front.url for front in pods.fronts]
    routed: list[int] = []  # the pod of each request, as the picker or random chose it
    scrapers: list[Scraper] = []
    if policy.startswith("picker"):
        router = PickerRouter(len(fronts), random.Random(f"{c.seed}/picker"))
        scrapers = [Scraper(url, c.refresh_ms / 1000, partial(router.update, p))
                    for p, url in enumerate(pods.metrics_urls)]

        def url_of(i: int, model: str) -> str:
            pod = router.choose(model)
            routed.append(pod)
            return fronts[pod]
    elif policy == "random":
        targets = random_targets(len(trace), len(fronts), c.seed)

        def url_of(i: int, model: str) -> str:
            routed.append(targets[i])
            return fronts[targets[i]]
    else:
        gateway = pods.gateway.url

        def url_of(i: int, model: str) -> str:
            return gateway

    before = counters(pods)
    with ExitStack() as running, pods.http() as client:
        for scraper in scrapers:
            running.enter_context(scraper)
        if scrapers:
            time.sleep(3 * c.refresh_ms / 1000)  # the picker's first views in
        results = send(trace, url_of, client, c)
    after = counters(pods)
    figures: dict[str, Any] = {
        "restart_s": round(restart_s, 1),
        **held_share(before, after),
        "requests_per_worker": counted_per_worker(before, after),
        **summarise(results),
    }
    if policy.startswith("picker"):
        figures["routed_per_pod"] = [routed.count(p) for p in range(len(fronts))]
        figures["metrics"] = scrape_latency([s for sc in scrapers for s in sc.samples])
        figures["scrape_errors"] = sum(sc.errors for sc in scrapers)
    return figures


def metrics_under_saturation(pods: Pods, c: PoolConfig) -> dict[str, Any]:
    """``c.saturate_streams`` streams at once at pod 0's front while its /metrics is scraped
    every ``c.refresh_ms`` from a process of its own; the scrapes' latency (module docstring,
    step 3)."""
    url = pods.fronts[0].url
    trace = [i % c.slots for i in range(c.saturate_streams)]  # adapters pod 0 holds after a load
    saturating = PoolConfig(**{**asdict(c), "concurrency": c.saturate_streams,
                               "max_tokens": c.saturate_tokens})
    metrics = pods.metrics_urls[0]
    with pods.http() as client, ChildScraper(metrics, c.refresh_ms / 1000) as scraper, \
            Scraper(metrics, c.refresh_ms / 1000) as beside:  # the same from a thread here
        results = send(trace, lambda i, model: url, client, saturating)
    return {"streams": c.saturate_streams, "max_tokens": c.saturate_tokens,
            "batch": pods.settings.max_batch_size, "ok": sum(r.ok for r in results),
            "scrape_errors": scraper.errors, **scrape_latency(scraper.samples),
            "from_benchmark_thread": scrape_latency(beside.samples)}


def comparison(runs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The headline differences in points (100 x the difference of two shares): of held share
    (device or host), and of device share alone (all the picker can see)."""
    def points(key: str, a: str, b: str) -> float | None:
        x, y = (runs.get(a) or {}).get(key), (runs.get(b) or {}).get(key)
        if not isinstance(x, float | int) or not isinstance(y, float | int):
            return None
        return round(100 * (x - y), 1)

    return {"gateway_minus_picker_points": points("held_share", "gateway", "picker"),
            "gateway_minus_picker_device_points": points("held_share", "gateway",
                                                         "picker-device"),
            "picker_minus_random_points": points("held_share", "picker", "random"),
            "device_gateway_minus_picker_points": points("device_share", "gateway", "picker"),
            "device_picker_minus_random_points": points("device_share", "picker", "random")}


def run_pool_bench(c: PoolConfig) -> dict[str, Any]:
    load_at_start = os.getloadavg()
    trace = zipf_trace(c.adapters, c.zipf_s, c.requests, c.seed)
    store_port = free_port()
    store = f"127.0.0.1:{store_port}"
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lorastream-pool-") as tmp:
        root = Path(tmp)
        with running_store(root / "store", store_port):
            register_adapters(store, ScaleConfig(counts=(c.adapters,), ranks=(c.rank,),
                                                 targets=ATTENTION, seed=c.seed),
                              checkpoint_shape(c.model))
            pods = Pods(c.workers, store, c.pod_settings())
            try:
                for policy in POLICIES:
                    runs[policy] = run_policy(policy, pods, trace, c)
                saturated = metrics_under_saturation(pods, c)
            finally:
                pods.stop()
    saturated_p99 = saturated["saturated_ms"]["p99"]
    return {
        "benchmark": "pool",
        "command": command_line(),
        "machine": machine_info(),
        # the machine is shared: its load before and after (1, 5, 15 min)
        "load_average_at_start": [round(v, 2) for v in load_at_start],
        "load_average_at_end": [round(v, 2) for v in os.getloadavg()],
        "config": asdict(c),
        "picker_weights": asdict(WEIGHTS),
        "trace": {"requests": len(trace), "distinct_adapters": len(set(trace)),
                  "top_adapter_share": round(max(trace.count(a) for a in set(trace))
                                             / len(trace), 3),
                  "total_slots": c.workers * c.slots},
        "runs": runs,
        **comparison(runs),
        "metrics_saturated": saturated,
        "metrics_p99_ms_saturated": saturated_p99,
        "ttft_p50_ms": {p: (runs[p].get("ttft_ms") or {}).get("p50") for p in runs},
        "goal_picker_near_gateway": "gateway_minus_picker_points <= 5",
        "goal_picker_over_random": "picker_minus_random_points >= 20",
        "goal_metrics_p99": "metrics_p99_ms_saturated <= 50",
    }
