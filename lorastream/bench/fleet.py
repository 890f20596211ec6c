"""A fleet in compose: three CPU worker containers behind the gateway, 100 adapters with zipf
popularity, the gateway's routing policies compared in one run, then one worker killed under
traffic (``lorastream bench fleet``; docs/deploy.md, "A fleet in compose").

1. **up**: docker-compose.yml + docker-compose.fleet.yml (three workers, each ``--worker-cpus`` of
   the host's CPUs) + tests/compose_live/docker-compose.moto.yml (moto's S3 server in place of
   MinIO, whose image needs a registry), CPU profile, ports chosen free on the host.
2. **adapters**: ``--adapters`` PEFT LoRAs of the default model (rank ``--rank`` on q_proj and
   v_proj), one generated and the others that one with a single float of one lora_B changed:
   distinct files and names at no cost. Uploaded to the S3 service's ``adapters`` bucket and
   registered through the gateway's operator API (``POST /v1/adapters``, s3:// source).
3. **per policy** (random, then affinity): every worker container restarted (nothing resident:
   both runs start cold), the gateway recreated with ``LORASTREAM_GATEWAY_ROUTING``, then the same
   zipf trace (``--requests`` streamed completions of ``--max-tokens`` tokens, ``--concurrency``
   in flight). Measured from each worker's own counters (/metrics, before and after): a request
   whose adapter was in a device slot is a device hit, else in host memory a host hit, else a
   fetch from the store. **held share** = (device + host hits) / requests the workers counted: the
   share served by a worker that already held the adapter. Tokens/s and TTFT are context.
4. **failure** (affinity, warm from step 3): the worker holding the most adapters (the gateway's
   last poll, ``GET /v1/adapters``) has its processes killed while a second zipf trace runs. For
   each adapter it held and that is requested again: seconds from the kill to the first
   successful response (served by another worker while it is down); the failed requests; and
   when the container is back (restart policy) and healthy.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from lorastream.bench.compose import ComposeProject, health, inspect, kill_processes, wait_until
from lorastream.bench.harness import adapter_picker, free_port, percentiles, sse_chunk
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.synthetic import SMOLLM2_135M, synthetic_lora
from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE

log = logging.getLogger(__name__)

COMPOSE_FILES = ["docker-compose.yml", "docker-compose.fleet.yml",
                 "tests/compose_live/docker-compose.moto.yml"]
WORKERS = ("fleet-worker-1", "fleet-worker-2", "fleet-worker-3")
HELD = ("device", "host", "loading")  # residencies that count as holding an adapter
UP_TIMEOUT_S = 900  # the first start converts the default model (35 s on an idle core)


@dataclass
class FleetConfig:
    adapters: int = 100
    requests: int = 300
    concurrency: int = 8
    zipf_s: float = 1.1
    max_tokens: int = 4
    rank: int = 4
    worker_cpus: float = 0.6  # per worker container; 3 x 0.6 on a 2-core machine
    kill_requests: int = 200  # the trace the worker is killed under
    kill_after_s: float = 5.0  # seconds into that trace
    policies: tuple[str, ...] = ("random", "affinity")  # the last one runs the failure part
    seed: int = 0
    build: bool = True


@dataclass
class Result:
    """One streamed completion, times in ``time.monotonic()`` seconds."""

    adapter: str
    started: float
    ended: float
    ttft: float | None  # seconds to the first token
    tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# -- pure parts ------------------------------------------------------------------------------------
def adapter_name(index: int) -> str:
    return f"fleet-{index:03d}"


def zipf_trace(adapters: int, s: float, requests: int, seed: int) -> list[int]:
    """Adapter indices of ``requests`` requests, zipf(``s``) popularity over ``adapters`` (which
    adapter is popular drawn from ``seed``: harness.adapter_picker)."""
    picker = adapter_picker(adapters, f"zipf:{s}", random.Random(seed))
    return [picker(i) for i in range(requests)]


def worker_counters(metrics_text: str) -> dict[str, float]:
    """The worker's adapter counters from its /metrics text: ``hits:device``, ``misses:host``..."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.startswith("lorastream_worker_adapter_") and "tier" in sample.labels:
                kind = sample.name.removeprefix("lorastream_worker_adapter_").removesuffix("_total")
                values[f"{kind}:{sample.labels['tier']}"] = sample.value
    return values


def held_share(before: dict[str, dict[str, float]],
               after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """From each worker's counters before and after a run: requests the workers counted, how
    many found their adapter in a device slot / in host memory / nowhere (a store fetch), and the
    shares. Every request is a device hit or a device miss; a device miss is a host hit or a
    host miss."""
    def delta(key: str) -> int:
        return int(sum(after[w].get(key, 0) - before.get(w, {}).get(key, 0) for w in after))

    device, requests = delta("hits:device"), delta("hits:device") + delta("misses:device")
    host, fetched = delta("hits:host"), delta("misses:host")
    return {
        "requests_counted": requests, "device_hits": device, "host_hits": host,
        "store_fetches": fetched,
        "held_share": round((device + host) / requests, 3) if requests else None,
        "device_share": round(device / requests, 3) if requests else None,
    }


def reserve_times(killed_at: float, held: Sequence[str], results: Sequence[Result],
                  back_at: float | None) -> dict[str, Any]:
    """For each adapter in ``held`` (the killed worker's): seconds from the kill to the end of
    its first successful response after it, and whether that came before the worker was back."""
    first: dict[str, float] = {}
    for r in sorted(results, key=lambda r: r.ended):
        if r.ok and r.ended > killed_at and r.adapter in held and r.adapter not in first:
            first[r.adapter] = r.ended
    seconds = sorted(first[a] - killed_at for a in first)
    before_back = [a for a in first if back_at is None or first[a] < back_at]
    return {
        "held": len(held),
        "requested_after_kill": len({r.adapter for r in results
                                     if r.adapter in held and r.ended > killed_at}),
        "reserved": len(first),
        "reserved_before_worker_back": len(before_back),
        "seconds": {"min": round(seconds[0], 2) if seconds else None,
                    "p50": round(seconds[len(seconds) // 2], 2) if seconds else None,
                    "max": round(seconds[-1], 2) if seconds else None},
        "per_adapter_s": {a: round(t - killed_at, 2) for a, t in sorted(first.items())},
    }


def summarise(results: Sequence[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    wall = (max(r.ended for r in results) - min(r.started for r in results)) if results else 0.0
    tokens = sum(r.tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(results), "ok": len(ok), "errors": errors,
        "distinct_adapters": len({r.adapter for r in results}),
        "wall_s": round(wall, 1), "output_tokens": tokens,
        "output_tok_s": round(tokens / wall, 2) if wall else None,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
    }


# -- traffic ---------------------------------------------------------------------------------------
def completion(client: httpx.Client, gateway: str, adapter: str, index: int,
               max_tokens: int) -> Result:
    """One streamed completion for ``adapter``; any failure is the result's error, not raised."""
    body = {"model": adapter, "prompt": f"Request {index}: tell me about the sea.",
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    started = time.monotonic()
    ttft, tokens, error = None, 0, None
    try:
        with client.stream("POST", f"{gateway}/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                error = f"http {response.status_code}"
            for line in response.iter_lines() if error is None else ():
                event = sse_chunk(line)
                if event is None:
                    continue
                if "error" in event:
                    error = f"stream error: {event['error'].get('type') or 'error'}"
                    break
                if any(c.get("text") for c in event.get("choices", [])):
                    ttft = ttft if ttft is not None else time.monotonic() - started
                    tokens += 1
    except (httpx.HTTPError, ValueError) as err:
        error = f"broken: {type(err).__name__}"
    return Result(adapter, started, time.monotonic(), ttft, tokens, error)


def send_trace(gateway: str, trace: Sequence[int], config: FleetConfig) -> list[Result]:
    with httpx.Client(timeout=300) as client, ThreadPoolExecutor(config.concurrency) as pool:
        return list(pool.map(
            lambda item: completion(client, gateway, adapter_name(item[1]), item[0],
                                    config.max_tokens),
            enumerate(trace)))


# -- the stack -------------------------------------------------------------------------------------
@dataclass
class Fleet:
    compose: ComposeProject
    gateway: str
    metrics_ports: dict[str, int]  # worker service -> its published metrics port
    token: str = ""

    def counters(self) -> dict[str, dict[str, float]]:
        return {w: worker_counters(httpx.get(f"http://127.0.0.1:{p}/metrics", timeout=10).text)
                for w, p in self.metrics_ports.items()}

    def routing_decisions(self) -> dict[str, int]:
        text = httpx.get(f"{self.gateway}/metrics", timeout=10).text
        return {s.labels["reason"]: int(s.value)
                for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "lorastream_gateway_routing_decisions_total"}

    def all_healthy(self) -> bool:
        if any(health(self.compose.container(w)) != "healthy" for w in WORKERS):
            return False
        body = httpx.get(f"{self.gateway}/health", timeout=10).json()
        workers = body.get("workers", {})
        return len(workers) == len(WORKERS) and all(w["healthy"] for w in workers.values())

    def cold_start(self, policy: str, restart: bool) -> float:
        """Every worker restarted (``restart``; else they are fresh from ``up``: nothing
        resident), the gateway recreated with ``policy``; seconds until all three are healthy as
        the gateway sees them."""
        started = time.monotonic()
        self.compose.settings["LORASTREAM_GATEWAY_ROUTING"] = policy
        if restart:
            self.compose.run("restart", "--timeout", "30", *WORKERS)
        self.compose.run("up", "-d", "--no-build", "--no-deps", "--wait", "gateway")
        wait_until(self.all_healthy, timeout_s=UP_TIMEOUT_S, interval_s=2.0)
        return round(time.monotonic() - started, 1)

    def holdings(self) -> dict[str, list[str]]:
        """Worker service -> the adapters it holds (device, host or loading), from the gateway's
        last poll; the gateway names workers by address, mapped back through docker inspect."""
        body = httpx.get(f"{self.gateway}/v1/adapters", timeout=60,
                         headers={"Authorization": f"Bearer {self.token}"}).json()
        items = body.get("adapters") or body.get("data") or []
        names = {}
        for service in WORKERS:
            info = inspect(self.compose.container(service))
            names[f"{service}:50052"] = service
            for net in info["NetworkSettings"]["Networks"].values():
                names[f"{net['IPAddress']}:50052"] = service
        held: dict[str, list[str]] = {w: [] for w in WORKERS}
        for item in items:
            for target, residency in item.get("workers", {}).items():
                if residency in HELD and target in names:
                    held[names[target]].append(item["name"])
        return held


def register_adapters(fleet: Fleet, s3_port: int, config: FleetConfig) -> dict[str, Any]:
    """``config.adapters`` PEFT adapters into the S3 bucket, each registered through the gateway."""
    import boto3

    started = time.monotonic()
    tensors, lora_config = synthetic_lora(SMOLLM2_135M, rank=config.rank,
                                          targets=("q_proj", "v_proj"), seed=config.seed)
    key = next(k for k in sorted(tensors) if k.endswith("lora_B.weight"))
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3_port}", region_name="us-east-1",
                      aws_access_key_id=os.environ.get("LORASTREAM_S3_ACCESS_KEY", "lorastream"),
                      aws_secret_access_key=os.environ.get("LORASTREAM_S3_SECRET_KEY",
                                                           "lorastream-dev-secret"))
    with tempfile.TemporaryDirectory(prefix="lorastream-fleet-") as tmp:
        for i in range(config.adapters):
            changed = dict(tensors)
            changed[key] = tensors[key].clone()
            changed[key][0, 0] += (i + 1) * 1e-3  # one float: a distinct adapter
            directory = Path(tmp) / adapter_name(i)
            directory.mkdir()
            save_file(changed, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
            (directory / CONFIG_FILE).write_text(json.dumps(lora_config))
            for path in (directory / WEIGHTS_FILE, directory / CONFIG_FILE):
                s3.upload_file(str(path), "adapters", f"{adapter_name(i)}/{path.name}")
    uploaded = time.monotonic()

    def register(i: int) -> None:
        response = httpx.post(f"{fleet.gateway}/v1/adapters", timeout=300,
                              headers={"Authorization": f"Bearer {fleet.token}"},
                              json={"name": adapter_name(i),
                                    "source": f"s3://adapters/{adapter_name(i)}"})
        if response.status_code != 201:
            raise RuntimeError(f"{adapter_name(i)}: {response.status_code} {response.text}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(register, range(config.adapters)))
    done = time.monotonic()
    return {"adapters": config.adapters, "rank": config.rank, "targets": ["q_proj", "v_proj"],
            "adapter_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "upload_s": round(uploaded - started, 1), "register_s": round(done - uploaded, 1)}


def run_policy(fleet: Fleet, policy: str, config: FleetConfig, restart: bool) -> dict[str, Any]:
    cold_s = fleet.cold_start(policy, restart)
    before, decisions = fleet.counters(), fleet.routing_decisions()
    results = send_trace(fleet.gateway, zipf_trace(config.adapters, config.zipf_s,
                                                   config.requests, config.seed), config)
    shares = held_share(before, fleet.counters())
    after = fleet.routing_decisions()
    return {"policy": policy, "cold_start_s": cold_s, **shares, **summarise(results),
            "routing_decisions": {r: n - decisions.get(r, 0) for r, n in after.items()
                                  if n - decisions.get(r, 0)},
            "load_avg": os.getloadavg()}


def run_failure(fleet: Fleet, config: FleetConfig) -> dict[str, Any]:
    """Kill the processes of the worker holding the most adapters under a zipf trace."""
    holdings = fleet.holdings()
    victim = max(WORKERS, key=lambda w: len(holdings[w]))
    container = fleet.compose.container(victim)
    restarts = inspect(container)["RestartCount"]
    trace = zipf_trace(config.adapters, config.zipf_s, config.kill_requests, config.seed + 1)
    results: list[Result] = []
    traffic = threading.Thread(
        target=lambda: results.extend(send_trace(fleet.gateway, trace, config)), daemon=True)
    traffic.start()
    time.sleep(config.kill_after_s)
    kill_processes(container)
    killed_at = time.monotonic()
    back_s = wait_until(lambda: inspect(container)["RestartCount"] > restarts
                        and health(container) == "healthy", timeout_s=UP_TIMEOUT_S, interval_s=1.0)
    traffic.join(timeout=1800)
    after_kill = [r for r in results if r.ended > killed_at]
    return {
        "worker": victim, "held_per_worker": {w: len(a) for w, a in holdings.items()},
        "killed_after_s": config.kill_after_s, "traffic": summarise(results),
        "failed_after_kill": sum(not r.ok for r in after_kill),
        "failed_held_adapters": sum(not r.ok for r in after_kill if r.adapter in holdings[victim]),
        "reserved": reserve_times(killed_at, holdings[victim], results, killed_at + back_s),
        "container_back_healthy_s": round(back_s, 1),
    }


def run_fleet_bench(config: FleetConfig) -> dict[str, Any]:
    ports = {name: free_port() for name in ("gateway", "store", "s3", "s3_console",
                                            "store_metrics", "worker_metrics", *WORKERS)}
    settings = {
        "LORASTREAM_GATEWAY_PORT": str(ports["gateway"]),
        "LORASTREAM_STORE_PORT": str(ports["store"]), "MINIO_API_PORT": str(ports["s3"]),
        "MINIO_CONSOLE_PORT": str(ports["s3_console"]),
        "LORASTREAM_STORE_METRICS_PORT": str(ports["store_metrics"]),
        "LORASTREAM_WORKER_METRICS_PORT": str(ports["worker_metrics"]),
        "LORASTREAM_FLEET_WORKER_CPUS": str(config.worker_cpus),
        "LORASTREAM_GATEWAY_ROUTING": config.policies[0],
        **{f"LORASTREAM_FLEET_METRICS_PORT_{i + 1}": str(ports[w]) for i, w in enumerate(WORKERS)},
    }
    compose = ComposeProject(f"lorastream-fleet-{os.getpid()}", COMPOSE_FILES, settings)
    fleet = Fleet(compose, f"http://127.0.0.1:{ports['gateway']}",
                  {w: ports[w] for w in WORKERS})
    load_before = os.getloadavg()
    started = time.monotonic()
    try:
        if config.build:
            compose.run("build", "tokens", "minio", timeout=3600)
        compose.run("up", "-d", "--no-build", "--wait", "--wait-timeout", str(UP_TIMEOUT_S),
                    timeout=UP_TIMEOUT_S + 120)
        up_s = round(time.monotonic() - started, 1)
        fleet.token = compose.operate_token()
        registered = register_adapters(fleet, ports["s3"], config)
        runs = {policy: run_policy(fleet, policy, config, restart=i > 0)
                for i, policy in enumerate(config.policies)}
        failure = run_failure(fleet, config)
    finally:
        compose.down()
    return {
        "benchmark": "fleet",
        "command": command_line(),
        "machine": machine_info(bandwidth=False),
        "config": asdict(config),
        "stack": {"project": compose.project, "workers": len(WORKERS),
                  "worker_cpus": config.worker_cpus,
                  "compose_files": COMPOSE_FILES, "up_s": up_s, "steps": compose.log,
                  "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                  "total_s": round(time.monotonic() - started, 1)},
        "adapters": registered,
        "runs": runs,
        "failure": failure,
    }
