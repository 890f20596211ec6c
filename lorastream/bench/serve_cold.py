"""``bench serve``'s cold-adapter workloads (issue 57): what a request for an adapter that is not
on the device waits for on a busy CPU worker, overlapped loading on against off, in one run.

**Burst** (a store at loopback speed): one stream decodes on a resident adapter; then
``burst_cold`` requests for cold rank-``rank`` adapters and ``burst_resident`` requests for the
resident one arrive at once. Reported: the resident and the cold requests' TTFT (p50 and every
sample), and the running stream's worst inter-token gap while the cold requests wait against its
worst gap in as long a window before the burst, and against its worst gap in the same burst sent
again once every adapter is resident (the burst's prefills alone, no load); the resident
requests' TTFT in that second burst is their control too. Goals: resident
TTFT on / off <= 0.5; cold TTFT on / off <= 1.5; worst gap during / before <= 1.2 (overlap on).

**Link-limited** (the benchmark's store, its egress capped at ``store_link_mbps``): ``background``
base-model streams decode while cold adapters are asked for one round at a time (a quiet window,
then a request for a new cold adapter and one more for it once resident). Reported per round: the
cold request's first token against the adapter's link time plus its resident TTFT (goal p50 <=
1.25), and the streams' ITL p99 in the loading windows against the quiet ones (goal <= 1.2) and
against the windows of the second request (its adapter resident: its prefill alone, no load).

Both controls prefill what the cold requests prefilled: the worker's prefix cache is reset
before them (a cold request finds nothing cached, the cache being keyed by adapter content, and
its control would otherwise prefill a few tokens: the prefill step, not the load, is what sets
the streams' worst gaps). Each control against the windows with no request arriving is a floor
(``worst_gap_resident_burst_vs_before``, ``itl_p99_resident_requests_vs_none``): what the
requests cost the running streams with no load at all, under which no load schedule can go.

Each workload runs its worker once per mode (:func:`modes`: overlap on with the worker's
defaults, overlap on with each ``--load-share`` of ``cold_shares`` -- by default 0 (the share
of the cores a cold request's load gets, off), 0.15 and 0.45 -- and overlap off), restarted between
modes so every adapter starts cold. Each mode also reports where its cold loads' time went
(``load_phases``: the per-load mean wall and CPU time of each phase, from the worker's
``lorastream_worker_cold_load_phase_seconds``, ``lorastream/worker/loading/load_timeline.py``).
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from lorastream.bench.harness import (
    PROMPTS,
    RequestResult,
    free_port,
    itls,
    percentiles,
    running,
    running_store,
    samples_ms,
    stream,
    warm_up,
)
from lorastream.bench.serve_adapters import make_serving_adapter, serving_adapter_nbytes
from lorastream.bench.synthetic import model_config
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.core.store_client import StoreClient
from lorastream.core.worker_client import WorkerClient

if TYPE_CHECKING:
    from lorastream.bench.serve import ServeConfig

def modes(shares: tuple[float, ...]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{mode: (overlap, extra worker flags)}``: overlap on with the worker's defaults, on with
    each ``--load-share`` of ``shares`` (``overlap_on_share_0``: the share off), and off."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {"overlap_on": ("on", ())}
    for share in shares:
        out[f"overlap_on_share_{share:g}"] = ("on", ("--load-share", f"{share:g}"))
    out["overlap_off"] = ("off", ())
    return out

RESIDENT = "resident"
WorkerArgs = Callable[[str, str, int], list[str]]  # (overlap, store, port) -> worker args


def stage_adapters(target: str, root: Path, config: ServeConfig, names: list[str],
                   seed: int) -> None:
    """Make and preload ``names`` (synthetic, rank ``config.rank``: all linear, and every routed
    expert on a MoE base, ``serve_adapters.py``) into the store."""
    base = model_config(config.model)
    with StoreClient(target) as client:
        for i, name in enumerate(names):
            path = make_serving_adapter(root / name, base, config.rank, seed + i)
            for _ in client.preload(str(path), name):
                pass
            (path / "adapter_model.safetensors").unlink()  # staged: free the disk


def run_burst(config: ServeConfig, root: Path, worker_args: WorkerArgs) -> dict[str, object]:
    """The burst workload, on a store of its own at loopback speed, once per mode."""
    port = free_port()
    cold = [f"burst{i}" for i in range(config.burst_cold)]
    with running_store(root / "burst-store", port, 0.0, "idle"):
        target = f"127.0.0.1:{port}"
        stage_adapters(target, root, config, [RESIDENT, *cold], seed=1000)
        results = {mode: _in_worker(worker_args(overlap, target, free_port()), flags,
                                    lambda worker, _: _burst(worker, config, cold))
                   for mode, (overlap, flags) in modes(config.cold_shares).items()}
    on, off = results["overlap_on"], results["overlap_off"]
    return {
        **results,
        "resident_ttft_p50_on_vs_off": _ratio(on["resident_ttft_ms"]["p50"],
                                              off["resident_ttft_ms"]["p50"]),
        "goal_resident_ttft_p50_on_vs_off": "<= 0.5",
        "cold_ttft_p50_on_vs_off": _ratio(on["cold_ttft_ms"]["p50"], off["cold_ttft_ms"]["p50"]),
        "goal_cold_ttft_p50_on_vs_off": "<= 1.5",
        "worst_gap_during_vs_before_on": on["worst_gap_ratio"],
        "goal_worst_gap_ratio": "<= 1.2",
        # what the burst's prefills alone cost the stream (no load): no load schedule gets
        # the ratio above under this floor
        "worst_gap_resident_burst_vs_before_on": on["worst_gap_resident_burst_vs_before"],
        "worst_gap_during_vs_resident_burst_on": on["worst_gap_during_vs_resident_burst"],
        "goal_worst_gap_vs_resident_burst": "<= 1.2",
        "resident_ttft_p50_vs_resident_burst_on": on["resident_ttft_p50_vs_resident_burst"],
    }


def run_link(config: ServeConfig, store: str, worker_args: WorkerArgs) -> dict[str, object]:
    """The link-limited workload on the benchmark's (capped) store, once per mode; its cold
    adapters (``cold{i}``) are staged there already (:func:`link_adapters`)."""
    link_s = (serving_adapter_nbytes(model_config(config.model), config.rank)
              / (config.store_link_mbps * 1e6)) if config.store_link_mbps else 0.0
    results = {mode: _in_worker(worker_args(overlap, store, free_port()), flags,
                                lambda worker, _: _link(worker, config, link_s))
               for mode, (overlap, flags) in modes(config.cold_shares).items()}
    on = results["overlap_on"]
    return {
        "link_ms": round(link_s * 1000, 1),
        **results,
        "cold_vs_link_plus_resident_p50_on": on["cold_vs_link_plus_resident_p50"],
        "goal_cold_vs_link_plus_resident": "<= 1.25",
        "itl_p99_ratio_on": on["itl_p99_ratio"],
        "goal_itl_p99_ratio": "<= 1.2",
        "itl_p99_during_loads_vs_resident_requests_on":
            on["itl_p99_during_loads_vs_resident_requests"],
        "goal_itl_p99_vs_resident_requests": "<= 1.2",
        # what the same request costs the streams with its adapter resident (its prefill, no
        # load): no load schedule gets itl_p99_ratio_on under this floor
        "itl_p99_resident_requests_vs_none_on": on["itl_p99_resident_requests_vs_none"],
    }


def link_adapters(config: ServeConfig) -> list[str]:
    return [f"cold{i}" for i in range(config.link_rounds)]


def _in_worker(args: list[str], flags: tuple[str, ...],
               work: Callable[[str, str], dict[str, Any]]) -> dict[str, Any]:
    """Start a worker (its metrics on a free port), run ``work(worker, metrics_url)``, and add
    where the cold loads' time went meanwhile."""
    metrics_port = free_port()
    port = int(args[args.index("--port") + 1])
    worker = f"127.0.0.1:{port}"
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with running([*args, *flags, "--metrics-port", str(metrics_port)], port):
        warm_up(worker)
        before = _phase_totals(url)
        result = work(worker, url)
        after = _phase_totals(url)
    return {"worker_flags": " ".join(flags), **result, "load_phases": _phase_means(before, after)}


# -- burst -----------------------------------------------------------------------------------
def _burst(worker: str, config: ServeConfig, cold: list[str]) -> dict[str, Any]:
    """The burst, then (a control) the same burst again once every adapter is resident: the
    running stream's worst gap then is what the burst's prefills cost it without any load."""
    prompt = PROMPTS[1]
    with WorkerClient(worker) as client:
        client.load_adapter(RESIDENT)
    _first_token(worker, RESIDENT, prompt, 2)  # its prefill path warm
    runner = RequestResult(arrival=time.perf_counter())
    stop = threading.Event()
    thread = threading.Thread(target=stream, args=(
        worker, RESIDENT, PROMPTS[0],
        SamplingParams(max_tokens=config.background_tokens, ignore_eos=True), runner, stop))
    thread.start()
    while len(runner.token_times) < 3:
        time.sleep(0.01)
    quiet_began = time.perf_counter()
    time.sleep(config.burst_quiet_s)
    names = [*cold, *[RESIDENT] * config.burst_resident]
    requests, burst_began = _fire(worker, names, prompt)
    time.sleep(config.burst_quiet_s)
    # every adapter resident now, and the prompts cached as they were for the first burst: the
    # cold adapters' not at all (their requests prefill in full again), the resident one's
    _forget_prefixes(worker)
    _first_token(worker, RESIDENT, prompt, 2)
    time.sleep(config.burst_quiet_s)
    warm, warm_began = _fire(worker, names, prompt)
    stop.set()
    thread.join()
    errors = [r.error for _, r in [*requests, *warm] if r.error is not None]

    def window(fired: list[tuple[str, RequestResult]], began: float) -> tuple[float, float]:
        """From ``began`` to the last cold request's first token."""
        firsts = [r.first_token for name, r in fired if name != RESIDENT and r.first_token]
        return began, max(firsts, default=began)

    def worst(span: tuple[float, float]) -> float:
        return max(itls([runner], span), default=0.0)

    during = window(requests, burst_began)
    worst_during = worst(during)
    # as long a window just before the burst: the same odds of a slow step on a shared box
    worst_before = worst((max(quiet_began, 2 * burst_began - during[1]), burst_began))
    worst_warm = worst(window(warm, warm_began))
    def ttft(fired: list[tuple[str, RequestResult]], resident: bool) -> list[float]:
        return [r.first_token - r.arrival for n, r in fired
                if (n == RESIDENT) == resident and r.first_token]

    cold_ttft, resident_ttft = ttft(requests, False), ttft(requests, True)
    resident_ms = percentiles(resident_ttft)
    # the same requests for the resident adapter once nothing loads: their prefills alone
    resident_warm_ms = percentiles(ttft(warm, True))
    return {
        "cold_requests": len(cold), "resident_requests": config.burst_resident,
        "errors": len(errors),
        "cold_ttft_ms": percentiles(cold_ttft),
        "resident_ttft_ms": resident_ms,
        "resident_ttft_ms_resident_burst": resident_warm_ms,
        "resident_ttft_p50_vs_resident_burst": _ratio(resident_ms["p50"],
                                                      resident_warm_ms["p50"]),
        "worst_gap_ms_before": round(worst_before * 1000, 1),
        "worst_gap_ms_during": round(worst_during * 1000, 1),
        "worst_gap_ratio": _ratio(worst_during, worst_before),
        # the same burst with every adapter resident: its prefills alone, no load
        "worst_gap_ms_during_resident_burst": round(worst_warm * 1000, 1),
        "worst_gap_during_vs_resident_burst": _ratio(worst_during, worst_warm),
        "worst_gap_resident_burst_vs_before": _ratio(worst_warm, worst_before),
        "samples": {"cold_ttft_ms": samples_ms(cold_ttft),
                    "resident_ttft_ms": samples_ms(resident_ttft)},
    }


def _fire(worker: str, names: list[str], prompt: PromptInput
          ) -> tuple[list[tuple[str, RequestResult]], float]:
    """One request per name, all at once (8 tokens each); when they are done, the results and
    the time they were sent."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    requests = [(name, RequestResult(arrival=0.0)) for name in names]
    began = time.perf_counter()
    threads = []
    for name, result in requests:
        result.arrival = time.perf_counter()
        threads.append(threading.Thread(target=stream, args=(worker, name, prompt, params,
                                                             result)))
        threads[-1].start()
    for t in threads:
        t.join()
    return requests, began


# -- link-limited ------------------------------------------------------------------------------
def _link(worker: str, config: ServeConfig, link_s: float) -> dict[str, object]:
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=config.background_tokens, ignore_eos=True)
    background = [RequestResult(arrival=time.perf_counter()) for _ in range(config.background)]
    stop = threading.Event()
    threads = [threading.Thread(target=stream, args=(worker, "base", PROMPTS[0], params, r, stop))
               for r in background]
    for t in threads:
        t.start()
    while any(len(r.token_times) < 3 for r in background):
        time.sleep(0.01)
    quiet: list[tuple[float, float]] = []
    loading: list[tuple[float, float]] = []
    admitting: list[tuple[float, float]] = []  # a request for a resident adapter: no load
    cold, resident = [], []
    for name in link_adapters(config):
        began = time.perf_counter()
        time.sleep(config.link_quiet_s)
        quiet.append((began, time.perf_counter()))
        began = time.perf_counter()
        cold.append(_first_token(worker, name, prompt, 2))
        loading.append((began, time.perf_counter()))
        _forget_prefixes(worker)  # the control prefills in full, as the cold request did
        began = time.perf_counter()
        resident.append(_first_token(worker, name, prompt, 2))
        admitting.append((began, time.perf_counter()))
    stop.set()
    for t in threads:
        t.join()

    def gaps(windows: list[tuple[float, float]]) -> dict[str, float | None]:
        return percentiles([g for w in windows for g in itls(background, w)])

    spread = {"no_loads": gaps(quiet), "during_loads": gaps(loading),
              "resident_requests": gaps(admitting)}
    quiet_p99, loading_p99, admitting_p99 = (
        spread["no_loads"]["p99"], spread["during_loads"]["p99"],
        spread["resident_requests"]["p99"])
    ratios = [c / (link_s + r) for c, r in zip(cold, resident, strict=True)]
    return {
        "rounds": len(cold),
        "cold_ttft_ms": percentiles(cold),
        "resident_ttft_ms": percentiles(resident),
        "cold_vs_link_plus_resident": [round(x, 3) for x in ratios],
        "cold_vs_link_plus_resident_p50": round(statistics.median(ratios), 3) if ratios else None,
        "itl_p99_ms_no_loads": quiet_p99,
        "itl_p99_ms_during_loads": loading_p99,
        "itl_p99_ratio": _ratio(loading_p99, quiet_p99),
        # the same request once its adapter is resident: its prefill alone, no load
        "itl_p99_ms_resident_requests": admitting_p99,
        "itl_p99_during_loads_vs_resident_requests": _ratio(loading_p99, admitting_p99),
        "itl_p99_resident_requests_vs_none": _ratio(admitting_p99, quiet_p99),
        "itl_ms": spread,  # the streams' gaps in each kind of window: p50, p90, p99
        "samples": {"cold_ttft_ms": samples_ms(cold), "resident_ttft_ms": samples_ms(resident)},
    }


# -- helpers -----------------------------------------------------------------------------------
def _forget_prefixes(worker: str) -> None:
    """Drop the worker's cached prefixes: a control request for an adapter that is resident by
    now then prefills its whole prompt, as its cold request did (a request for a new adapter
    finds nothing cached: the prefix cache is keyed by adapter content). Without it the control
    prefilled a few tokens beside the cold request's whole prompt, and the prefill's cost
    counted against the load."""
    with WorkerClient(worker) as client:
        client.reset_prefix_cache()


def _first_token(worker: str, model: str, prompt: PromptInput, tokens: int) -> float:
    result = RequestResult(arrival=time.perf_counter())
    stream(worker, model, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), result)
    if result.error is not None or result.first_token is None:
        raise RuntimeError(f"request for {model} failed: {result.error}")
    return result.first_token - result.arrival


def _phase_totals(url: str) -> dict[tuple[str, str], tuple[float, float]]:
    """``{(phase, clock): (sum seconds, count)}`` of the worker's cold-load histogram."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    totals: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "lorastream_worker_cold_load_phase_seconds":
            continue
        for sample in family.samples:
            key = (sample.labels["phase"], sample.labels["clock"])
            if sample.name.endswith("_sum"):
                totals.setdefault(key, [0.0, 0.0])[0] = sample.value
            elif sample.name.endswith("_count"):
                totals.setdefault(key, [0.0, 0.0])[1] = sample.value
    return {key: (s, n) for key, (s, n) in totals.items()}


def _phase_means(before: dict[tuple[str, str], tuple[float, float]],
                 after: dict[tuple[str, str], tuple[float, float]]) -> dict[str, object]:
    """Per phase, the mean wall and CPU milliseconds per cold load between two scrapes."""
    out: dict[str, object] = {}
    loads = 0
    for (phase, clock), (total, count) in after.items():
        total -= before.get((phase, clock), (0.0, 0.0))[0]
        count -= before.get((phase, clock), (0.0, 0.0))[1]
        if count <= 0:
            continue
        if phase == "total" and clock == "wall":
            loads = int(count)
        entry = out.setdefault(phase, {})
        assert isinstance(entry, dict)
        entry[f"{clock}_ms"] = round(total / count * 1000, 1)
    return {"loads": loads, **out}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None
