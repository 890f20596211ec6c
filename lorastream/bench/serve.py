"""Serving benchmark: a store and a worker started here, driven with Poisson arrivals over cold
adapters, run with overlapped loading on and then off, on the same request trace.

Three parts per mode (the worker is restarted between modes, so every adapter starts cold):

1. **trace**: requests arrive as a Poisson process at ``rate`` per second; each names an
   adapter drawn by ``popularity`` (``distinct``, ``uniform`` or ``zipf:ALPHA``) among more
   adapters than the worker has slots. Reported: TTFT, ITL and end-to-end latency
   (p50/p90/p99) and throughput.
2. **interference**: ``background`` long base-model streams decode; their inter-token latency is
   measured in windows with no loads and windows while adapters are loaded one after another
   (LoadAdapter calls, so the batch itself does not change), taking turns for
   ``interference_rounds`` rounds of ``window_s`` each. Reported: the ITL p99 of running streams
   during loads over their ITL p99 without loads.
3. **cold probe**: what one cold request waits for (:func:`_run_cold_probe`): its TTFT against
   the adapter's link time (its bytes at ``store_link_mbps``) plus the TTFT of the same request
   once resident (goal: within 1.25x, beside the interference goal, overlap on), and the load
   time (store fetch + copy) with the CPU time the loaders (the store and the worker's fetch
   process) spent on it.

Before them, the cold-adapter workloads of issue 57 (``serve_cold.py``): a burst of cold adapters
beside resident ones, and cold adapters one at a time behind the capped link, each overlap on
(at the worker's default ``--load-share`` and at ``cold_shares``) and off. ``parts`` picks which
of ``trace`` (the three parts above and the CPU variants below), ``loads`` (the interference
part and the cold probe per mode, without the trace and the variants), ``burst`` and ``link``
run.

On a mixture-of-experts base (``--model`` a Qwen3-MoE, Mixtral or Qwen2-MoE checkpoint, e.g.
``lorastream bench moe-checkpoint``'s) every adapter adapts q/k/v/o and every routed expert of
every sparse layer (``serve_adapters.py``): hundreds of MB each where a dense
adapter of the same rank takes a few. The result is then ``serve-moe`` (its own file and
section of the benchmark page); ``--parts loads`` gives its figure, the running streams' ITL
p99 while such adapters load cold against none, overlap on and off.

The worker's peak resident memory is sampled and reported against its configured budgets. After
both modes the interference part and the cold probe run once more per variant of the worker's CPU
measures, overlap on (:data:`CPU_VARIANTS`): the CPU load stream's copies beside the decode steps
(``--copy-turn-ms 0``) rather than in turns between them
(``lorastream/worker/device/cpu/step_gate.py``);
the compute threads placed by the kernel rather than bound one per core
(``--no-bind-compute-threads``, ``lorastream/worker/device/cpu/binding.py``); and store fetches
given a turn of the cores before each step while they are in flight (``--fetch-turn-ms 2``,
``step_gate.py``; off by default), which trades the running streams' ITL for load time; and,
not a CPU measure, layer-ordered admission (``--layered-admission``; off by default), whose
cold probe against the defaults' is what it wins.

The store process runs at idle CPU priority (SCHED_IDLE): in a deployment it is another machine,
and on a 2-core benchmark box it would otherwise take the cores the worker decodes on (at
``nice 10`` it still doubled the decode's ITL p50 while it worked; see
``lorastream/worker/device/cpu/priority.py``). For the same reason its egress is capped at
``store_link_mbps`` (default 125 MB/s, a 1 Gb/s link): on loopback the
"network" would otherwise run at memory speed and cost the worker's cores, where a real link
moves the bytes without them. The link banks up to ``store_link_burst_bytes`` (4 MiB, the most
Linux's TCP autotuning gives a socket's send buffer by default, ``net.ipv4.tcp_wmem``) of time
the store, at idle priority, spent off the CPU: a real link drains the send buffer meanwhile,
and without it the store's stalls on this shared box count against the link. The default rate
(1 request/s) is about what the worker sustains with these adapters (every step reads each
distinct rank-64 adapter of the batch once): busy, without a queue that grows through the trace;
at 1.5 requests/s both modes saturate.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from lorastream.bench.harness import (
    PROMPTS,
    RequestResult,
    RssSampler,
    TraceEntry,
    free_port,
    itls,
    make_trace,
    percentiles,
    replay,
    running,
    running_store,
    samples_ms,
    stream,
    summarise,
    warm_up,
)
from lorastream.bench.loader_cpu import LoaderCpu
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.serve_adapters import serving_adapter_nbytes
from lorastream.bench.serve_cold import link_adapters, run_burst, run_link, stage_adapters
from lorastream.bench.synthetic import model_config
from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.worker_client import WorkerClient

if TYPE_CHECKING:
    from lorastream.worker.model.config import ModelConfig

PROBE_ADAPTERS = 3  # extra adapters in the store that only the cold probe asks for


@dataclass(frozen=True)
class ServeConfig:
    model: str = "default"
    adapters: int = 24
    slots: int = 8
    rank: int = 64
    rate: float = 1.0  # requests per second: about what the worker sustains with these adapters
    requests: int = 32
    popularity: str = "zipf:1.2"
    max_tokens: int = 32
    background: int = 4
    background_tokens: int = 2000
    interference_rounds: int = 6  # a window with no loads, then one with loads, this often
    window_s: float = 5.0
    host_cache_bytes: int = 1 << 30
    kv_cache_bytes: int = 512 << 20
    store_link_mbps: float = 125.0  # the store's egress cap: a 1 Gb/s link; 0 = loopback speed
    store_link_burst_bytes: int = 4 << 20  # idle link time it may bank: a TCP send buffer
    seed: int = 0
    # which parts run: "trace" (the trace, interference and cold probe per mode, and the CPU
    # variants), "loads" (the interference and cold probe per mode alone), "burst" and "link"
    # (the cold-adapter workloads, serve_cold.py)
    parts: tuple[str, ...] = ("trace", "burst", "link")
    burst_cold: int = 6  # cold adapters asked for at once in the burst
    burst_resident: int = 4  # requests for the resident adapter in the same burst
    burst_quiet_s: float = 3.0  # the running stream decodes this long before the burst
    link_rounds: int = 6  # cold adapters asked for one at a time from the capped store
    link_quiet_s: float = 2.0  # no loads this long before each round
    cold_shares: tuple[float, ...] = (0.0, 0.15, 0.45)  # --load-share values beside the default


def _run_trace(worker: str, config: ServeConfig) -> dict[str, object]:
    c = config
    trace = make_trace(c.adapters, c.popularity, c.rate, c.requests, c.seed)
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    results, start = replay(worker, trace, params, lambda adapter: f"a{adapter}")
    return {**summarise(results, start), **ttft_by_first_use(trace, results)}


def ttft_by_first_use(trace: list[TraceEntry], results: list[RequestResult]) -> dict[str, object]:
    """TTFT percentiles of the requests that are the first to name their adapter (a cold
    fetch in either mode) and of the rest (adapter asked for before: in a slot, in host
    memory, or still on its way), in trace order."""
    seen: set[int] = set()
    first: list[float] = []
    repeat: list[float] = []
    for (_, adapter, _), result in zip(trace, results, strict=True):
        if result.error is None and result.first_token is not None:
            ttft = result.first_token - result.arrival
            (repeat if adapter in seen else first).append(ttft)
        seen.add(adapter)
    return {"first_use_requests": len(first), "ttft_ms_first_use": percentiles(first),
            "ttft_ms_repeat": percentiles(repeat)}


class _Background:
    """``count`` long base-model streams decoding until :meth:`close` (their calls cancelled)."""

    def __init__(self, worker: str, count: int, tokens: int, prompt: PromptInput) -> None:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True)
        self.results = [RequestResult(arrival=time.perf_counter()) for _ in range(count)]
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=stream, args=(worker, "base", prompt, params, r, self._stop))
            for r in self.results
        ]
        for t in self._threads:
            t.start()
        while any(len(r.token_times) < 3 for r in self.results):  # all decoding
            time.sleep(0.01)

    @property
    def ended(self) -> bool:
        return any(r.end is not None for r in self.results)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def _run_interference(worker: str, config: ServeConfig, prompt: PromptInput) -> dict[str, object]:
    """ITL of ``background`` running streams in windows of ``window_s`` with no loads and with
    adapters loaded one after another, taking turns for ``interference_rounds`` rounds: the
    two sides then see the same stream lengths and the same drift of a shared machine, and
    hold about as many samples (a loading window ends when its last load does)."""
    background = _Background(worker, config.background, config.background_tokens, prompt)
    quiet: list[tuple[float, float]] = []
    loading: list[tuple[float, float]] = []
    loads = 0
    with WorkerClient(worker) as client:
        for _ in range(config.interference_rounds):
            begin = time.perf_counter()
            time.sleep(config.window_s)
            quiet.append((begin, time.perf_counter()))
            # Cycle through the adapters: with more adapters than slots (and than the host
            # budget holds) every load evicts one, and later ones re-fetch.
            begin = time.perf_counter()
            while time.perf_counter() - begin < config.window_s and not background.ended:
                client.load_adapter(f"a{loads % config.adapters}")
                loads += 1
            loading.append((begin, time.perf_counter()))
    background.close()
    quiet_gaps = [g for w in quiet for g in itls(background.results, w)]
    loading_gaps = [g for w in loading for g in itls(background.results, w)]
    quiet_ms, loading_ms = percentiles(quiet_gaps), percentiles(loading_gaps)
    quiet_p99, loading_p99 = quiet_ms["p99"], loading_ms["p99"]
    return {
        "background_streams": config.background,
        "rounds": config.interference_rounds,
        "loads": loads,
        # a stream that ended early ends the loading windows early too: why, if it failed
        "background_errors": [r.error for r in background.results if r.error is not None],
        "quiet_seconds": round(sum(end - begin for begin, end in quiet), 2),
        "load_seconds": round(sum(end - begin for begin, end in loading), 2),
        "itl_ms_no_loads": quiet_ms,
        "itl_ms_during_loads": loading_ms,
        "itl_p99_ms_no_loads": quiet_p99,
        "itl_p99_ms_during_loads": loading_p99,
        "itl_p99_ratio": round(loading_p99 / quiet_p99, 3) if quiet_p99 and loading_p99 else None,
        "samples": {
            "itl_ms_no_loads": samples_ms(quiet_gaps),
            "itl_ms_during_loads": samples_ms(loading_gaps),
        },
    }


def _unload(client: WorkerClient, name: str, timeout_s: float = 30.0) -> None:
    """Unload ``name``, retrying while the worker still counts its load as in flight: with
    layer-ordered admission its requests can finish before the fetch that landed their layers
    has ended (the worker refuses the unload meanwhile, asking for a retry)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.unload_adapter(name)
            return
        except InvalidArgument:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _ttft(worker: str, model: str, prompt: PromptInput) -> float:
    result = RequestResult(arrival=time.perf_counter())
    stream(worker, model, prompt, SamplingParams(max_tokens=2, ignore_eos=True), result)
    if result.error is not None or result.first_token is None:
        raise RuntimeError(f"probe request for {model} failed: {result.error}")
    return result.first_token - result.arrival


def _run_cold_probe(worker: str, config: ServeConfig, prompt: PromptInput,
                    loader_cpu: LoaderCpu) -> dict[str, object]:
    """What a cold request waits for, while ``background`` base-model streams decode.

    Per probe adapter (one no trace request names, so cold): the TTFT of a request for it; the
    TTFT of a second request, now that it is resident (a step boundary and a prefill step); and,
    after unloading it, how long LoadAdapter takes (store fetch + copy into a slot) and the CPU
    time the loaders spent meanwhile. With overlap, cold TTFT ~= load + warm TTFT: the load is
    the only wait added, and nothing of it is left to hide behind the running batch. The goal
    compares the cold TTFT with what no scheduling can remove: the adapter's link time plus the
    warm TTFT.
    """
    background = _Background(worker, config.background, config.background_tokens, prompt)
    cold, warm, load, cpu = [], [], [], []
    with WorkerClient(worker) as client:
        for i in range(PROBE_ADAPTERS):
            name = f"probe{i}"
            cold.append(_ttft(worker, name, prompt))
            warm.append(_ttft(worker, name, prompt))
            _unload(client, name)
            began, cpu_began = time.perf_counter(), loader_cpu.seconds()
            client.load_adapter(name)
            load.append(time.perf_counter() - began)
            cpu.append(loader_cpu.seconds() - cpu_began)
    background.close()

    def median_ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1000, 1)

    link_s = _link_seconds(config)
    cold_ms, warm_ms = median_ms(cold), median_ms(warm)
    return {
        "probes": PROBE_ADAPTERS,
        "cold_ttft_ms": cold_ms,
        "warm_ttft_ms": warm_ms,
        "load_ms": median_ms(load),
        "link_ms": round(link_s * 1000, 1) if link_s is not None else None,
        "cold_vs_link_plus_warm": (round(cold_ms / (link_s * 1000 + warm_ms), 3)
                                   if link_s is not None else None),
        "loader_cpu_ms_per_load": median_ms(cpu),
        "samples": {"cold_ttft_ms": samples_ms(cold), "warm_ttft_ms": samples_ms(warm),
                    "load_ms": samples_ms(load), "loader_cpu_ms": samples_ms(cpu)},
    }


def _link_seconds(config: ServeConfig) -> float | None:
    """How long the store link takes to carry one of the benchmark's adapters; None on loopback
    speed (no cap)."""
    if not config.store_link_mbps:
        return None
    nbytes = serving_adapter_nbytes(model_config(config.model), config.rank)
    return nbytes / (config.store_link_mbps * 1e6)


def run_serve_bench(config: ServeConfig, store_port: int = 0, worker_port: int = 0) -> dict:
    """Both modes on one store; ports 0 pick free ones. On a mixture-of-experts base the
    result is ``serve-moe`` (its adapters carry LoRA on every routed expert)."""
    store_port = store_port or free_port()
    worker_port = worker_port or free_port()
    base = model_config(config.model)
    load_before = os.getloadavg()[0]  # a shared machine: what else ran, at each end
    with tempfile.TemporaryDirectory(prefix="lorastream-serve-") as tmp:
        root = Path(tmp)
        with running_store(root / "store", store_port, config.store_link_mbps, "idle",
                           config.store_link_burst_bytes) as store:
            target = f"127.0.0.1:{store_port}"
            trace = "trace" in config.parts
            per_mode = trace or "loads" in config.parts  # a worker per mode, on and off
            names = [f"a{i}" for i in range(config.adapters)] if per_mode else []
            names += [f"probe{i}" for i in range(PROBE_ADAPTERS)] if per_mode else []
            stage_adapters(target, root, config, names, seed=0)
            if "link" in config.parts:
                stage_adapters(target, root, config, link_adapters(config), seed=2000)

            def worker_args(overlap: str, store: str, port: int) -> list[str]:
                return _worker_args(config, overlap, store, port)

            cold: dict[str, object] = {}
            if "burst" in config.parts:
                cold["cold_burst"] = run_burst(config, root, worker_args)
            if "link" in config.parts:
                cold["cold_link"] = run_link(config, target, worker_args)
            modes = {}
            for overlap in ("on", "off") if per_mode else ():
                modes[f"overlap_{overlap}"] = _run_mode(config, overlap, target, worker_port,
                                                        store.pid, trace)
            variants = {name: _run_variant(config, target, worker_port, flags, store.pid)
                        for name, flags in CPU_VARIANTS.items()} if trace else {}
    head = {"benchmark": "serve-moe" if base.is_moe else "serve", "command": command_line(),
            "machine": machine_info(), "config": asdict(config), "base": _base(base),
            "adapter_mb": round(serving_adapter_nbytes(base, config.rank) / 1e6, 1),
            "load_average_1m_at_start": round(load_before, 2),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2)}
    if not per_mode:
        return {**head, **cold}
    on, off = modes["overlap_on"], modes["overlap_off"]
    itl_ratio, cold_ratio = on["interference"]["itl_p99_ratio"], on["cold_probe"][
        "cold_vs_link_plus_warm"]
    loads = {
        "itl_p99_during_loads_vs_none_overlap_on": itl_ratio,
        "itl_p99_during_loads_vs_none_overlap_off": off["interference"]["itl_p99_ratio"],
        "goal_itl_p99_ratio": "<= 1.2",
        "cold_ttft_vs_link_plus_resident_overlap_on": cold_ratio,
        "goal_cold_ttft_ratio": "<= 1.25",
    }
    if not trace:
        return {**head, **modes, **loads, **cold}
    ttft_on, ttft_off = on["trace"]["ttft_ms"]["p50"], off["trace"]["ttft_ms"]["p50"]
    return {
        **head,
        **modes,
        "ttft_p50_on_vs_off": round(ttft_on / ttft_off, 3) if ttft_on and ttft_off else None,
        "goal_ttft_p50_on_vs_off": "<= 0.5",
        **loads,
        # the cold-load and ITL goals met in the same run, overlap on, with the worker's defaults
        "cold_and_itl_goals_met_together": (
            None if itl_ratio is None or cold_ratio is None
            else itl_ratio <= 1.2 and cold_ratio <= 1.25),
        **variants,
        **cold,
    }


def _base(config: ModelConfig) -> dict[str, object]:
    """What the result says of the base model: its family and size, and its experts."""
    out: dict[str, object] = {"family": config.family, "layers": config.num_layers,
                              "hidden": config.hidden_size}
    if config.is_moe:
        out.update(experts=config.num_experts, experts_per_token=config.experts_per_token,
                   expert_intermediate=config.moe_intermediate_size)
    return out


def _worker_args(config: ServeConfig, overlap: str, store: str, port: int) -> list[str]:
    return [
        "worker", "serve", "--model", config.model, "--served-model-name", "base",
        "--port", str(port), "--store", store, "--max-loras", str(config.slots),
        "--max-lora-rank", str(config.rank),
        "--lora-overlap-loading" if overlap == "on" else "--no-lora-overlap-loading",
        "--host-cache-bytes", str(config.host_cache_bytes),
        "--kv-cache-bytes", str(config.kv_cache_bytes),
        "--insecure-no-auth",  # the bench loads and unloads with no token, on loopback
    ]


# The interference part and the cold probe run once more per entry, overlap on, with one of the
# worker's CPU measures turned the other way: what each buys or costs, measured in the same run.
CPU_VARIANTS = {
    # slot copies beside the decode steps instead of in turns between them (step_gate.py)
    "copies_beside_steps": ("--copy-turn-ms", "0"),
    # compute threads placed by the kernel instead of bound one per core (device/cpu/binding.py)
    "compute_threads_unbound": ("--no-bind-compute-threads",),
    # fetches get a turn of the cores before each step while in flight (step_gate.py; off by
    # default: faster loads beside decoding, at the running streams' expense)
    "fetch_turns_2ms": ("--fetch-turn-ms", "2"),
    # not a CPU measure: a cold request admitted once its adapter's first layers are in a slot,
    # its prefill run layer by layer as they land (engine/layered_prefill.py; off by default)
    "layered_admission": ("--layered-admission",),
}


def _run_variant(config: ServeConfig, store: str, port: int, flags: tuple[str, ...],
                 store_pid: int) -> dict:
    """The interference part and the cold probe, overlap on, the worker started with ``flags``
    too."""
    args = [*_worker_args(config, "on", store, port), *flags]
    target = f"127.0.0.1:{port}"
    with running(args, port) as worker:
        warm_up(target)
        loader_cpu = LoaderCpu(store_pid, worker.pid)
        return {"worker_flags": " ".join(flags),
                "interference": _run_interference(target, config, PROMPTS[0]),
                "cold_probe": _run_cold_probe(target, config, PROMPTS[1], loader_cpu)}


def _run_mode(config: ServeConfig, overlap: str, store: str, port: int, store_pid: int,
              trace: bool = True) -> dict:
    """One worker, overlap ``overlap``: the trace (when ``trace``), the interference part and the
    cold probe, its peak memory and its budgets (the device slots' bytes as the worker counts
    them: expert storage included on a MoE base)."""
    metrics_port = free_port()
    args = [*_worker_args(config, overlap, store, port), "--metrics-port", str(metrics_port)]
    target = f"127.0.0.1:{port}"
    with running(args, port) as worker:
        sampler = RssSampler(worker.pid)
        sampler.start()
        warm_up(target)
        traced = {"trace": _run_trace(target, config)} if trace else {}
        interference = _run_interference(target, config, PROMPTS[0])
        cold_probe = _run_cold_probe(target, config, PROMPTS[1],
                                     LoaderCpu(store_pid, worker.pid))
        with WorkerClient(target) as client:
            stats = client.stats()
        slots = _slot_bytes(f"http://127.0.0.1:{metrics_port}/metrics")
        sampler.stop.set()
    return {
        **traced,
        "interference": interference,
        "cold_probe": cold_probe,
        "worker_peak_rss_mb": round(sampler.peak / 1e6),
        "worker_budgets_mb": {
            "host_adapters": round(stats.host_bytes_budget / 1e6),
            "device_slots": round(sum(slots.values()) / 1e6),
            "kv_cache": round(config.kv_cache_bytes / 1e6),
        },
        "device_slot_mb_by_part": {part: round(n / 1e6) for part, n in slots.items()},
    }


def _slot_bytes(url: str) -> dict[str, int]:
    """The worker's ``lorastream_worker_slot_bytes``: part -> bytes every slot reserves."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {sample.labels["part"]: int(sample.value)
            for family in text_string_to_metric_families(text)
            if family.name == "lorastream_worker_slot_bytes" for sample in family.samples}
