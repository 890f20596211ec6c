"""``bench engine --quantization MODE[,MODE]``: the engine over an fp32 base and over each int8
mode (``--quantization`` of the worker), and HF transformers + PEFT, in one run.

Per mode: base-only and mixed-adapter decode tok/s (measured as in engine.py: every mode's runs
take turns within each repeat; the best repeat, and the ratio to fp32's run of the same repeat,
repeat by repeat), the same for one stream (one prompt, base-only and with one
adapter: each step reads every weight for a single row, the case the weights' bytes bound, where
the batch of ``prompts`` rows is bound by multiply-adds on a CPU), the resident bytes of the base
model (in a fresh process per mode: RSS after building the model minus before), and the greedy
tokens' agreement with the fp32 engine's (which is PEFT's, token for token:
tests/worker/model/test_families.py) over the same mixed batch, teacher-forced: at every
``FORCED_EVERY``-th position of each fp32 sequence the mode is given the prompt and the fp32
tokens before it and generates one token (one near-tie then
costs one position, not the rest of the sequence). The free-running agreement (each mode's own
sequences compared position by position) is reported beside it, and so is the teacher-forced
agreement over the *decisive* positions only, those whose reference top-2 margin exceeds the
mode's stated logit tolerance (quant_reference.py): the criterion of the tolerance test. The
same teacher-forced tokens are also compared with transformers + PEFT over the mode's own
dequantized weights (``quant_reference.dequantized_base``), the reference the token goal is
stated against: that leaves the mode's arithmetic, not its weight rounding.

Where the time goes: per mode, the milliseconds a decode step of the batch spends in the base
projections alone (every layer's four and the lm_head over [prompts, K] inputs, best of
``PROJECTION_PASSES`` passes taking turns between modes, with the engine's loop stopped, and the
median pass), beside the fp32 step time from its decode rate. The rest of the step is not a
fixed cost: it ran faster over int8 bases than over fp32 (62 vs 88 ms in one run), as 4x fewer
weight bytes stream through the caches each step. The roofline (roofline.py) sets the
projections against the cores' multiply-add peak, measured in the same run.

Decode attention runs on the native CPU kernel where it built (``--cpu-kernels auto``); each
mode's base-only decode is then also measured on torch's attention path (the model's
``native_attention`` switched off for that run, in the same turns): what the kernel is worth.

Every mode runs in ONE engine: between runs, while it is idle, the engine's model is swapped for
the same checkpoint built with the mode's quantization, so the KV cache, the adapter slots and the
adapters are the same for all and a slow spell of the machine hits every mode alike.
"""

from __future__ import annotations

import logging
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lorastream.bench.decode_rate import QUESTIONS, decode_rate_samples, peft_decode_rate
from lorastream.bench.machine import command_line, machine_info
from lorastream.bench.peft_peer import load_mixed_peft
from lorastream.bench.quant_reference import ReferenceRows, dequantized_base, reference_rows
from lorastream.bench.roofline import measure_peaks, multiply_adds_per_row, roofline
from lorastream.bench.synthetic import checkpoint_shape, make_synthetic_adapter
from lorastream.core.generation import PromptInput, SamplingParams

if TYPE_CHECKING:
    from lorastream.worker.model.decoder import DecoderModel

log = logging.getLogger(__name__)

FP32 = "none"
GOAL_BASE_SPEEDUP = 1.6  # int8 base-only decode / fp32's
GOAL_MULTI_SPEEDUP = 1.3  # int8 mixed-adapter decode / fp32's
GOAL_AGREEMENT = 0.99
FORCED_EVERY = 4  # teacher-forced positions: 0, 4, 8, ... of each sequence
PROJECTION_PASSES = 7


def _figures(ms: float) -> float:
    """``ms`` to three significant figures: never 0.0 for a time, however tiny the model."""
    return float(f"{ms:.3g}")


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _model_resident(checkpoint: str, quantization: str, out: multiprocessing.Queue[object]
                    ) -> None:
    """In a fresh process: RSS before and after building the model (weights loaded, quantized)."""
    import gc

    from lorastream.worker.model.config import ModelConfig
    from lorastream.worker.model.decoder import DecoderModel
    from lorastream.worker.model.weights import load_weights

    cpu = torch.device("cpu")
    config = ModelConfig.from_dir(Path(checkpoint))
    before = _rss_bytes()
    model = DecoderModel(config, load_weights(Path(checkpoint), config, torch.float32, cpu), cpu,
                         quantization)  # type: ignore[arg-type]  # mode: a str checked by the CLI's choices
    gc.collect()
    out.put({"rss_mb": round(_rss_bytes() / 1e6, 1),
             "model_rss_mb": round((_rss_bytes() - before) / 1e6, 1)})
    del model


def resident_mb(checkpoint: Path, quantization: str) -> dict[str, float]:
    """The base model's resident memory under ``quantization``, measured in a fresh process."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[object] = ctx.Queue()
    child = ctx.Process(target=_model_resident, args=(str(checkpoint), quantization, out))
    child.start()
    result = out.get(timeout=600)
    child.join(60)
    assert isinstance(result, dict)
    return result


def projection_ms(models: Mapping[str, DecoderModel], rows: int,
                  passes: int = PROJECTION_PASSES) -> dict[str, list[float]]:
    """Per model: the milliseconds of each of ``passes`` passes of one decode step of ``rows``
    rows through its base projections alone (every layer's four and the lm_head, in the
    forward's order, over random [rows, K] inputs); the models take turns within each pass."""
    times: dict[str, list[float]] = {name: [] for name in models}
    stacks = {
        name: [(p, torch.randn(rows, p.in_features, dtype=model.dtype, device=model.device))
               for p in [*(p for layer in model.proj for p in layer), model.lm_head]]
        for name, model in models.items()
    }
    for _ in range(passes):
        for name, stack in stacks.items():
            start = time.perf_counter()
            for projection, x in stack:
                projection(x)  # [rows, K] -> [rows, N]
            times[name].append((time.perf_counter() - start) * 1000)
    return times


def paired_ratios(rates: list[float], fp32: list[float]) -> dict[str, float]:
    """A mode's decode rate over fp32's, repeat by repeat (the two runs seconds apart in each):
    the median, lowest and highest of those ratios. Beside the ratio of the best repeats, which
    may pair two different minutes of a shared machine."""
    ratios = sorted(r / f for r, f in zip(rates, fp32, strict=True))
    return {"median": round(statistics.median(ratios), 3), "min": round(ratios[0], 3),
            "max": round(ratios[-1], 3)}


def agreement(tokens: dict[int, list[int]], reference: dict[int, list[int]]) -> float:
    """Fraction of reference positions where ``tokens`` holds the same token."""
    same = sum(a == b for i, ref in reference.items() for a, b in zip(tokens[i], ref, strict=False))
    total = sum(len(ref) for ref in reference.values())
    return same / max(total, 1)


def forced_cases(reference: dict[int, list[int]], every: int = FORCED_EVERY
                 ) -> list[tuple[int, int]]:
    """(sequence, position) pairs teacher-forced: every ``every``-th position of each."""
    return [(i, k) for i, ref in reference.items() for k in range(0, len(ref), every)]


def run_quant_bench(
    model: str, quantizations: list[str], adapters: int = 32, rank: int = 16, prompts: int = 32,
    new_tokens: int = 32, repeats: int = 3, include_peft: bool = True,
) -> dict[str, object]:
    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.model.config import ModelConfig
    from lorastream.worker.model.decoder import DecoderModel
    from lorastream.worker.model.quant_linear import LOGIT_TOLERANCE, MODES
    from lorastream.worker.model.weights import load_weights
    from lorastream.worker.service.bootstrap import build_engine
    from lorastream.worker.service.config import WorkerSettings
    from lorastream.worker.service.operations import WorkerOperations

    modes = [FP32, *(q for q in quantizations if q != FP32)]
    settings = WorkerSettings(
        model=model, served_model_name="base", max_loras=adapters, max_lora_rank=rank,
        max_batch_size=prompts, max_num_tokens=max(512, prompts * 64), kv_cache_bytes=1 << 30,
    )
    checkpoint = resolve_checkpoint(model, cache_dir=settings.model_cache_dir)
    resident = {mode: resident_mb(checkpoint, mode) for mode in modes}  # before the big process
    shape = checkpoint_shape(model)
    with tempfile.TemporaryDirectory(prefix="lorastream-bench-") as tmp:
        dirs = [make_synthetic_adapter(Path(tmp) / f"a{i}", shape, rank=rank, seed=i)
                for i in range(adapters)]
        engine = build_engine(settings, checkpoint=checkpoint)
        config = ModelConfig.from_dir(checkpoint, name="base")
        models = {FP32: engine.model} | {
            mode: DecoderModel(config, load_weights(checkpoint, config, torch.float32,
                                                    engine.model.device),
                               engine.model.device, mode)  # type: ignore[arg-type]  # mode: a str checked by the CLI's choices
            for mode in modes[1:]
        }
        chat = getattr(engine.tokenizer, "chat_template", None) is not None
        ids = [
            tuple(engine.tokenize(PromptInput(messages=(("user", q),)) if chat
                                  else PromptInput(text=q)))
            for q in (QUESTIONS[i % len(QUESTIONS)] for i in range(prompts))
        ]
        multi_models = [f"a{i % adapters}" for i in range(prompts)]

        def generate(mode: str, names: list[str], n: int) -> dict[int, list[int]]:
            engine.model = models[mode]  # the engine is idle between runs
            params = SamplingParams(max_tokens=n, ignore_eos=True)
            streams = [engine.submit(m, PromptInput(token_ids=p), params)
                       for m, p in zip(names, ids[: len(names)], strict=True)]
            return {i: [t for event in s for t in event.token_ids] for i, s in enumerate(streams)}

        def forced(mode: str, reference: dict[int, list[int]]) -> list[int]:
            """Per teacher-forced case, the token ``mode`` generates after the ``reference``
            tokens before it (see the docstring)."""
            engine.model = models[mode]
            params = SamplingParams(max_tokens=1, ignore_eos=True)
            cases = forced_cases(reference)
            streams = [engine.submit(multi_models[i], PromptInput(
                token_ids=ids[i] + tuple(reference[i][:k])), params) for i, k in cases]
            got = [[t for event in s for t in event.token_ids] for s in streams]
            assert all(len(g) == 1 for g in got), "one token per teacher-forced case"
            return [g[0] for g in got]

        native = engine.model.native_attention  # the kernel built: compare torch's path too

        def run(mode: str, names: list[str], native_attention: bool = native
                ) -> Callable[[int], None]:
            def go(n: int) -> None:
                models[mode].native_attention = native_attention
                try:
                    generate(mode, names, n)
                finally:
                    models[mode].native_attention = native

            return go

        def measure() -> tuple[list[list[float]], list[list[float]],
                               dict[str, dict[int, list[int]]], dict[str, list[int]]]:
            ops = WorkerOperations(engine)
            for i, path in enumerate(dirs):
                ops.load_adapter(f"a{i}", str(path))
            runs = [run(mode, names) for mode in modes for names in (multi_models,
                                                                       ["base"] * prompts)]
            if native:  # then each mode's base-only decode on torch's attention path too
                runs += [run(mode, ["base"] * prompts, False) for mode in modes]
            samples = decode_rate_samples(runs, prompts, new_tokens, repeats)
            # one stream: a step reads every weight for one row (what the weight bytes bound)
            one = decode_rate_samples([run(mode, names) for mode in modes
                                       for names in (multi_models[:1], ["base"])],
                                      1, new_tokens, repeats)
            tokens = {mode: generate(mode, multi_models, new_tokens) for mode in modes}
            return samples, one, tokens, {mode: forced(mode, tokens[FP32]) for mode in modes}

        samples, one_samples, tokens, forced_tokens = engine.run_while(measure)
        rates = [max(s) for s in samples]  # each run's best repeat
        one_stream = [max(s) for s in one_samples]
        # with the engine's loop stopped: while it runs, even idle, this thread's products
        # share the cores with its OpenMP team (fp32's stack measured 212 ms instead of 122)
        passes = projection_ms(models, prompts)
        projections = {mode: min(ms) for mode, ms in passes.items()}  # the best pass
        projections_median = {mode: statistics.median(ms) for mode, ms in passes.items()}
        # the cores' multiply-add rates, also with the loop stopped (a CPU model's only)
        peaks = measure_peaks(engine.model.device.type)
        macs_per_row = multiply_adds_per_row(
            [*(p for layer in engine.model.proj for p in layer), engine.model.lm_head])
        cases = forced_cases(tokens[FP32])
        # one HF + PEFT model for both: the reference logits and, if asked, PEFT's decode rate
        peft_model = load_mixed_peft(checkpoint, dirs)
        reference = reference_rows(peft_model, ids, multi_models, tokens[FP32], cases)
        dequantized: dict[str, ReferenceRows] = {}  # the same over each mode's int8 weights
        for mode in modes:
            if mode in MODES:
                with dequantized_base(peft_model, mode):
                    dequantized[mode] = reference_rows(peft_model, ids, multi_models,
                                                       tokens[FP32], cases)
        peft = (peft_decode_rate(peft_model, [list(p) for p in ids], new_tokens, repeats)
                if include_peft else None)
    fp32_tokens = torch.tensor([tokens[FP32][i][k] for i, k in cases])  # [C]
    per_mode: dict[str, dict[str, object]] = {}
    for j, mode in enumerate(modes):
        multi, base = rates[2 * j], rates[2 * j + 1]
        got = torch.tensor(forced_tokens[mode])  # [C]
        hits = got == fp32_tokens  # [C] bool
        decisive = reference.decisive(LOGIT_TOLERANCE.get(mode, 0.0))  # [C] bool
        per_mode[mode] = {
            "multi_adapter_decode_tok_s": round(multi, 1),
            "base_only_decode_tok_s": round(base, 1),
            "repeats_decode_tok_s": {  # every repeat's rate, in order (the best above)
                "base_only": [round(v, 1) for v in samples[2 * j + 1]],
                "multi_adapter": [round(v, 1) for v in samples[2 * j]]},
            "base_only_vs_fp32": round(base / rates[1], 3),
            "multi_vs_fp32": round(multi / rates[0], 3),
            "token_agreement_vs_fp32": round(float(hits.float().mean()), 4),
            "decisive_positions": int(decisive.sum()),
            "token_agreement_decisive_vs_fp32": (
                round(float(hits[decisive].float().mean()), 4) if decisive.any() else None),
            "free_running_agreement_vs_fp32": round(agreement(tokens[mode], tokens[FP32]), 4),
            **({"token_agreement_vs_dequantized_reference": round(float(
                (got == dequantized[mode].argmax).float().mean()), 4)}
               if mode in dequantized else {}),
            "one_stream_adapter_decode_tok_s": round(one_stream[2 * j], 1),
            "one_stream_base_decode_tok_s": round(one_stream[2 * j + 1], 1),
            "one_stream_base_vs_fp32": round(one_stream[2 * j + 1] / one_stream[1], 3),
            "one_stream_adapter_vs_fp32": round(one_stream[2 * j] / one_stream[0], 3),
            # the same ratios repeat by repeat, each against fp32's run of that repeat
            "paired_vs_fp32": {
                "base_only": paired_ratios(samples[2 * j + 1], samples[1]),
                "multi_adapter": paired_ratios(samples[2 * j], samples[0]),
                "one_stream_base": paired_ratios(one_samples[2 * j + 1], one_samples[1]),
                "one_stream_adapter": paired_ratios(one_samples[2 * j], one_samples[0]),
            },
            "projections_ms_per_step": _figures(projections[mode]),
            "projections_ms_per_step_median": _figures(projections_median[mode]),
            **resident[mode],
        }
        if native:
            per_mode[mode]["base_only_decode_tok_s_torch_attention"] = round(
                rates[2 * len(modes) + j], 1)
    result: dict[str, object] = {
        "benchmark": "engine-quant",
        "command": command_line(),
        "model": model,
        "adapters": adapters,
        "rank": rank,
        "prompts": prompts,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "forced_positions": len(cases),
        # transformers + PEFT's argmax against the fp32 engine's tokens at those positions: the
        # reference the decisive positions are judged by is the same model (expected 1.0)
        "reference_argmax_vs_fp32": round(float((reference.argmax == fp32_tokens).float()
                                                .mean()), 4),
        "threads": torch.get_num_threads(),
        "attention": "native" if native else "torch",  # the decode path of the figures above
        "modes": per_mode,
        # the fp32 decode step, from its decode rates (beside the modes' projection times)
        "fp32_step_ms": {"base_only": _figures(1000 * prompts / rates[1]),
                         "multi_adapter": _figures(1000 * prompts / rates[0])},
        "goal_base_only_vs_fp32": f">= {GOAL_BASE_SPEEDUP}",
        "goal_multi_vs_fp32": f">= {GOAL_MULTI_SPEEDUP}",
        "goal_token_agreement": f">= {GOAL_AGREEMENT}",
    }
    steps = {mode: {"base_only": 1000 * prompts / statistics.median(samples[2 * j + 1]),
                    "multi_adapter": 1000 * prompts / statistics.median(samples[2 * j])}
             for j, mode in enumerate(modes)}  # the median repeat's step
    machine = machine_info()
    bandwidth = machine.get("memory_bandwidth_gbs")
    result["roofline"] = {  # roofline.py: what the projections at the cores' peak would allow
        "multiply_add_peak_gmac_s": peaks,
        "multiply_adds_per_step": prompts * macs_per_row,
        "modes": ({} if "error" in peaks else roofline(
            prompts, macs_per_row, peaks, steps,  # type: ignore[arg-type]  # peaks: no error key, so numbers only
            projections_median, projections,
            goals={"base_only": GOAL_BASE_SPEEDUP, "multi_adapter": GOAL_MULTI_SPEEDUP},
            bandwidth_gbs=bandwidth if isinstance(bandwidth, float) else None)),
    }
    if peft is not None:
        result["peft_mixed_batch_decode_tok_s"] = round(peft, 1)
    result["machine"] = machine
    return result
