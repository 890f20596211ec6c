"""The serving figures on a GPU: the engine over a random-weight model of real shapes
(``gpu_model.py``; Llama-3.1-8B-shaped in bf16 by default), rank-16 adapters of that shape.

The shape decides the adapters and the counts: all-linear LoRAs on a dense shape (32 streams,
8 cold adapters by default); on a mixture of experts (``--shape qwen3-30b-a3b``), expert LoRAs on
q/k/v/o and every expert's gate_up and down, 1.29 GB each in bf16 at rank 16, so the files made
on the host decide the run's time and disk: 8 streams and 6 cold adapters by default (the cold
ones must outnumber the ``SPARE_SLOTS``), recorded in the result with each adapter's and each
slot's MB.

UNMEASURED until a GPU runs it (``scripts/gpu_check.sh``): it refuses to run without CUDA
(exit status 2), and no number from a CPU stands in for its figures on the page.

- **decode**: tokens/s of ``streams`` prompts with as many distinct adapters against the base
  model alone on the same prompts (``bench/engine.py``'s paired method): goal >= 0.85x
  (MoE: >= 0.7x, the goal of ``engine_moe.py``: an adapter's expert weights are a larger share
  of a step's reads);
- **ITL under loads**: ``streams`` running streams, each with its own resident adapter; their
  inter-token latency p99 while one-token requests for device-cold adapters (held in host memory,
  so each is a copy into a slot) arrive one after another, against the same streams while the
  same requests arrive for resident adapters (the same prefills, no loads), on an engine with
  overlapped loading: goal <= 1.1x (MoE: <= 1.2x, each load ~1.7 GB into its slot); the same
  on an engine with overlap off, for contrast;
- **cold TTFT**: time to first token of a request whose adapter is device-cold, against the load
  path's own copy of that adapter into a slot (timed on the host, as the request waits for it)
  plus the TTFT of a resident adapter's request of the same length: goal <= 1.25x.

Prompts are random token ids, a fresh one for every TTFT request (no prefix-cache hit), and
every request ignores EOS.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lorastream.bench.gpu_model import (
    SHAPES,
    make_adapters,
    model_config,
    random_engine,
    random_model,
)
from lorastream.bench.machine import command_line
from lorastream.core.generation import PromptInput, SamplingParams
from lorastream.worker.device.device import Device
from lorastream.worker.engine.engine import Engine
from lorastream.worker.loading.adapter import adapter_weights
from lorastream.worker.loading.fetch import AdapterFetcher
from lorastream.worker.lora.slots import LoraSlots
from lorastream.worker.model.config import ModelConfig
from lorastream.worker.service.operations import WorkerOperations

log = logging.getLogger(__name__)

UNMEASURED_NOTE = "the first GPU figures of this benchmark (none have been taken on a CPU)"
SPARE_SLOTS = 4  # slots beyond the running streams' own, which the cold adapters share
GOALS = {"multi_vs_base": ">= 0.85", "itl_p99_on_vs_none": "<= 1.1",
         "cold_vs_h2d_plus_resident": "<= 1.25"}
MOE_GOALS = {**GOALS, "multi_vs_base": ">= 0.7", "itl_p99_on_vs_none": "<= 1.2"}
# (streams, cold adapters) by default: a dense shape's adapters are MB, a MoE shape's GB
DENSE_COUNTS, MOE_COUNTS = (32, 2 * SPARE_SLOTS), (8, SPARE_SLOTS + 2)


def goals(config: ModelConfig) -> dict[str, str]:
    return MOE_GOALS if config.is_moe else GOALS


def default_counts(config: ModelConfig) -> tuple[int, int]:
    """(streams, cold adapters) of ``config``'s shape when the caller names none."""
    return MOE_COUNTS if config.is_moe else DENSE_COUNTS


class _Prompts:
    """Random prompts of one length; each call draws new ones (no shared prefix)."""

    def __init__(self, vocab: int, length: int, seed: int = 0) -> None:
        self.vocab, self.length = vocab, length
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, count: int) -> list[tuple[int, ...]]:
        ids = torch.randint(1, self.vocab, (count, self.length), generator=self.gen)  # [n, S]
        return [tuple(row) for row in ids.tolist()]


def _token_times(engine: Engine, name: str, prompt: tuple[int, ...], tokens: int,
                 times: list[float]) -> None:
    """Run one request to its end, appending the time of each event that carries tokens."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for event in engine.submit(name, PromptInput(token_ids=prompt), params):
        if event.token_ids:
            times.append(time.perf_counter())


def _ttft_ms(engine: Engine, name: str, prompt: tuple[int, ...]) -> float:
    times: list[float] = []
    began = time.perf_counter()
    _token_times(engine, name, prompt, 1, times)
    return (times[0] - began) * 1000


def _run_all(engine: Engine, models: list[str], prompts: list[tuple[int, ...]],
             tokens: int) -> None:
    """Every request at once, each on its own thread, to their ends."""
    threads = [threading.Thread(target=_token_times, args=(engine, m, p, tokens, []))
               for m, p in zip(models, prompts, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _device_cold(engine: Engine, name: str) -> bool:
    return engine.adapters.status(name).residency != "device"


def _itl_phase(engine: Engine, residents: list[str], prompts: _Prompts, new_tokens: int,
               arrivals: list[str]) -> dict[str, Any]:
    """``residents`` decode together while one-token requests for ``arrivals`` (in turn) follow
    one another, from the moment every stream has its first token until the last stream ends.
    The streams' inter-token gaps in that window, in ms, and how many arrivals found their
    adapter out of a slot (a load)."""
    times: list[list[float]] = [[] for _ in residents]
    threads = [threading.Thread(target=_token_times, args=(engine, name, prompt, new_tokens, t))
               for name, prompt, t in zip(residents, prompts(len(residents)), times, strict=True)]
    for thread in threads:
        thread.start()
    while not all(times) and any(t.is_alive() for t in threads):
        time.sleep(0.001)
    window_start = time.perf_counter()
    loads, requests = 0, 0
    while any(t.is_alive() for t in threads):
        name = arrivals[requests % len(arrivals)]
        loads += _device_cold(engine, name)
        _token_times(engine, name, prompts(1)[0], 1, [])
        requests += 1
    for thread in threads:
        thread.join()
    gaps = [(b - a) * 1000 for t in times for a, b in itertools.pairwise(t)
            if a >= window_start]
    if not gaps:
        raise RuntimeError("no inter-token gap in the window: raise new_tokens")
    gaps.sort()
    return {"itl_p50_ms": round(statistics.median(gaps), 3),
            "itl_p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 3),
            "gaps": len(gaps), "cold_requests": requests, "slot_loads": loads}


def _load_path_ms(engine: Engine, adapter: Path, repeats: int) -> float:
    """The load path's copy of ``adapter`` (landed in host memory) into a slot of its own: the
    load stream's job, timed on the host from its submit to its event (median)."""
    config, device = engine.model.config, engine.model.device
    rank = engine.slots.max_rank
    worker_device = Device(device)
    buffer = AdapterFetcher(worker_device, None).read_local("h2d", adapter)
    weights = adapter_weights(buffer, config, rank)
    slots = LoraSlots(config, 1, rank, engine.model.dtype, device)

    def once() -> float:
        ops = slots.write_ops(0, weights.adapter_id, weights.rank, weights.scaling,
                              list(weights.blocks))
        began = time.perf_counter()
        worker_device.load_stream.submit(ops).wait()
        return (time.perf_counter() - began) * 1000

    once()  # warm-up
    result = statistics.median(once() for _ in range(repeats))
    worker_device.close()
    return result


def _decode_rates(runs: list[Callable[[int], None]], prompts: int, new_tokens: int,
                  repeats: int) -> list[list[float]]:
    """Decode tok/s of each run in every repeat, as ``bench/engine.py`` measures it (prefill
    cancels out): prompts * (new_tokens - 1) / (t(new_tokens) - t(1)); the runs take turns
    within every repeat, so that their ratio is paired."""
    for run in runs:
        run(2)  # warm-up
    rates: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            began = time.perf_counter()
            run(1)
            one = time.perf_counter() - began
            began = time.perf_counter()
            run(new_tokens)
            full = time.perf_counter() - began
            rates[i].append(prompts * (new_tokens - 1) / max(full - one, 1e-9))
    return rates


def _decode(engine: Engine, residents: list[str], prompts: _Prompts, new_tokens: int,
            repeats: int, goal: str) -> dict[str, Any]:
    fixed = prompts(len(residents))

    def run(models: list[str]) -> Callable[[int], None]:
        return lambda n: _run_all(engine, models, fixed, n)

    multi, base = _decode_rates([run(residents), run(["base"] * len(residents))],
                                len(residents), new_tokens, repeats)
    return {"multi_tok_s": round(max(multi), 1), "base_tok_s": round(max(base), 1),
            "multi_vs_base": round(max(multi) / max(base), 3),
            "goal_multi_vs_base": goal}


def _engine_figures(engine: Engine, dirs: list[Path], streams: int, prompts: _Prompts,
                    new_tokens: int, repeats: int, with_decode: bool) -> dict[str, Any]:
    """Register the adapters (the cold ones first: the residents take the slots), then the
    phases; the engine is running."""
    ops = WorkerOperations(engine)
    names = [f"a{i}" for i in range(len(dirs))]
    cold, residents = names[streams:], names[:streams]
    for name in [*cold, *residents]:
        ops.load_adapter(name, str(dirs[names.index(name)]))
    figures: dict[str, Any] = {}
    _run_all(engine, residents, prompts(streams), 2)  # warm-up; every resident in a slot
    figures["resident_on_device"] = sum(not _device_cold(engine, n) for n in residents)
    figures["none"] = _itl_phase(engine, residents, prompts, new_tokens, residents)
    figures["loads"] = _itl_phase(engine, residents, prompts, new_tokens, cold)
    if with_decode:
        figures["decode"] = _decode(engine, residents, prompts, new_tokens, repeats,
                                    goals(engine.model.config)["multi_vs_base"])
        resident_ms = [_ttft_ms(engine, name, prompts(1)[0]) for name in residents[:repeats * 2]]
        cold_ms: list[float] = []
        for i in range(3 * len(cold)):  # the cold adapters not in a slot now, in turn
            name = cold[i % len(cold)]
            if len(cold_ms) < repeats * 2 and _device_cold(engine, name):
                cold_ms.append(_ttft_ms(engine, name, prompts(1)[0]))
        figures["ttft"] = {"resident_ms": round(statistics.median(resident_ms), 3),
                           "cold_ms": round(statistics.median(cold_ms), 3) if cold_ms else None,
                           "cold_requests": len(cold_ms)}
    return figures


def run_gpu_serving_bench(
    shape: str = "llama-3.1-8b",
    streams: int | None = None,
    rank: int = 16,
    new_tokens: int = 64,
    prompt_tokens: int = 128,
    cold_adapters: int | None = None,
    repeats: int = 3,
    lora_backend: str = "triton",
    device: str = "cuda",
) -> dict[str, Any]:
    """Every figure above on ``device`` (``cpu`` only for tests of the code path: its figures
    are never put on the page). ``streams`` / ``cold_adapters``: None for the shape's
    :func:`default_counts`. RuntimeError on ``cuda`` without CUDA."""
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the GPU serving benchmark needs a CUDA GPU (none found); it is "
                           "unmeasured on this project's CPU-only machines")
    config = model_config(shape)
    streams = default_counts(config)[0] if streams is None else streams
    cold_adapters = default_counts(config)[1] if cold_adapters is None else cold_adapters
    if cold_adapters <= SPARE_SLOTS:
        raise ValueError(f"cold_adapters must exceed the {SPARE_SLOTS} spare slots, or some "
                         "stay resident and load nothing")
    dtype = torch.bfloat16 if torch_device.type == "cuda" else torch.float32
    prompts = _Prompts(config.vocab_size, prompt_tokens)
    kv_tokens = 2 * (streams + SPARE_SLOTS) * (prompt_tokens + new_tokens + 16)
    kv_bytes = kv_tokens * 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lorastream-gpu-serving-") as tmp:
        began = time.perf_counter()
        dirs = make_adapters(Path(tmp), config, streams + cold_adapters, rank, dtype)
        adapter_bytes = sum(f.stat().st_size for f in dirs[0].iterdir())
        log.info("%d adapters of %.1f MB made in %.1f s", len(dirs), adapter_bytes / 1e6,
                 time.perf_counter() - began)
        # every adapter stays in host memory (a cold one is a copy into a slot, never a read)
        host_cache_bytes = int(1.25 * len(dirs) * adapter_bytes)
        model = random_model(config, dtype, torch_device)  # made once, shared by both engines
        for overlap in (True, False):
            engine = random_engine(
                model, max_loras=streams + SPARE_SLOTS,
                max_lora_rank=rank, host_cache_bytes=host_cache_bytes,
                kv_cache_bytes=kv_bytes, max_batch_size=streams + SPARE_SLOTS,
                overlap=overlap, lora_backend=lora_backend,
                max_num_tokens=max(4096, (streams + 1) * prompt_tokens),
            )
            slot_bytes = engine.slots.nbytes // engine.slots.num_slots
            engine.start()
            try:
                figures = _engine_figures(engine, dirs, streams, prompts, new_tokens, repeats,
                                          with_decode=overlap)
                if overlap:
                    figures["h2d_ms"] = round(_load_path_ms(engine, dirs[0], repeats * 2), 3)
            finally:
                engine.stop()
            result["overlap_on" if overlap else "overlap_off"] = figures
            del engine
            if torch_device.type == "cuda":
                torch.cuda.empty_cache()
    counts = {"streams": streams, "cold_adapters": cold_adapters, "rank": rank,
              "adapter_mb": round(adapter_bytes / 1e6, 3), "slot_mb": round(slot_bytes / 1e6, 3),
              "host_cache_mb": round(host_cache_bytes / 1e6, 3)}
    return _summary(result, shape, config, torch_device, dtype, counts, new_tokens,
                    prompt_tokens, lora_backend)


def _summary(raw: dict[str, Any], shape: str, config: ModelConfig, device: torch.device,
             dtype: torch.dtype, counts: dict[str, Any], new_tokens: int, prompt_tokens: int,
             lora_backend: str) -> dict[str, Any]:
    """The result JSON; ``counts``: streams, cold adapters, rank and the adapter's, a slot's
    and the host cache's MB."""
    on, off = raw["overlap_on"], raw["overlap_off"]
    goal = goals(config)
    kind = ("q/k/v/o + every expert's gate_up and down (target_parameters)" if config.is_moe
            else "all-linear")
    ttft = on["ttft"]
    cold_ratio = (round(ttft["cold_ms"] / (on["h2d_ms"] + ttft["resident_ms"]), 3)
                  if ttft["cold_ms"] is not None else None)
    return {
        "benchmark": "gpu_serving",
        "command": command_line(),
        "note": UNMEASURED_NOTE,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "model_shape": shape,
        "model": f"random weights of {config.name}'s shapes",
        "moe": config.is_moe,
        "dtype": str(dtype).removeprefix("torch."),
        "lora_backend": lora_backend,
        "adapters": f"{kind}, rank {counts['rank']}, {counts['adapter_mb']:.1f} MB each",
        **counts,
        "counts_note": (f"few streams and cold adapters: each adapter is "
                        f"{counts['adapter_mb']:.0f} MB, so the files made on the host decide "
                        "the run's time and disk" if config.is_moe else None),
        "new_tokens": new_tokens,
        "prompt_tokens": prompt_tokens,
        "decode": on["decode"],
        "itl": {
            "none": on["none"], "overlap_on": on["loads"],
            "overlap_off_none": off["none"], "overlap_off": off["loads"],
            "itl_p99_on_vs_none": round(on["loads"]["itl_p99_ms"] / on["none"]["itl_p99_ms"], 3),
            "itl_p99_off_vs_none": round(off["loads"]["itl_p99_ms"] / off["none"]["itl_p99_ms"],
                                         3),
            "goal_itl_p99_on_vs_none": goal["itl_p99_on_vs_none"],
        },
        "ttft": {**ttft, "h2d_ms": on["h2d_ms"], "cold_vs_h2d_plus_resident": cold_ratio,
                 "goal_cold_vs_h2d_plus_resident": goal["cold_vs_h2d_plus_resident"]},
        "resident_on_device": on["resident_on_device"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print (or write) its JSON; exit status 2 when CUDA is missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES),
                        help="the random-weight model's shapes (tiny*: the code path only)")
    parser.add_argument("--streams", type=int, default=None,
                        help=f"running streams (default: {DENSE_COUNTS[0]}; a MoE shape "
                             f"{MOE_COUNTS[0]})")
    parser.add_argument("--cold-adapters", type=int, default=None,
                        help=f"device-cold adapters, more than the {SPARE_SLOTS} spare slots "
                             f"(default: {DENSE_COUNTS[1]}; a MoE shape {MOE_COUNTS[1]})")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-backend", choices=["triton", "torch"], default="triton")
    parser.add_argument("--output", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    try:
        result = run_gpu_serving_bench(
            args.shape, args.streams, args.rank, args.new_tokens, args.prompt_tokens,
            args.cold_adapters, repeats=args.repeats, lora_backend=args.lora_backend,
        )
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
