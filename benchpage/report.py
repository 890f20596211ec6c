"""``python -m benchpage``: the benchmark page, generated from the result JSONs.

Reads whichever of ``transfer.json``, ``engine*.json``, ``serve.json``, ``scale.json`` and
``registry.json`` exist in a results directory, draws the plots and writes one markdown page:
headline, goals, machine, then one section per benchmark (its exact command, tables, goal
verdicts, plot and explanation). A missing result gives a "not run" section with the command that
produces it. No figure on the page is typed by hand: each is read or computed from the JSONs."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchpage import (
    gpu_report,
    report_alora,
    report_grammar,
    report_moe,
    report_pool,
    report_prefix,
    report_push,
    report_quant,
    report_registry,
    report_saturate,
    report_serve,
    report_serve_moe,
    report_soak,
    report_transfer,
)
from benchpage import plots as plot
from benchpage import report_sections as sections
from benchpage.report_format import (
    GOALS_HEADER,
    MISSING,
    code_block,
    get,
    ms,
    number,
    pct,
    ratio,
    table,
    text,
)

log = logging.getLogger(__name__)

Result = Mapping[str, Any]


@dataclass(frozen=True)
class Bench:
    name: str
    title: str
    command: str  # as in the Makefile's `bench` target; {results} is the results directory
    section: Callable[[Result, Mapping[str, str]], str]
    goals: Callable[[Result], list[list[str]]]
    plots: tuple[tuple[str, Callable[[Result, Path], Path | None]], ...] = ()


BENCHES = (
    Bench("transfer", "Store stream vs bare gRPC (transfer)",
          "lorastream bench transfer --chunk-sizes 64K,256K,1M,4M "
          "--output {results}/transfer.json",
          report_transfer.transfer_section, report_transfer.transfer_goals,
          (("transfer", plot.transfer_plot),)),
    Bench("engine", "Engine: many adapters vs base only vs HF + PEFT (engine)",
          "lorastream bench engine --repeats 2 --output {results}/engine.json",
          sections.engine_section, sections.engine_goals),
    Bench("engine-gemma3-270m",
          "Engine on Gemma 3 270M: many adapters vs base only vs HF + PEFT (engine-gemma3-270m)",
          "lorastream bench engine --model gemma3-270m --repeats 2 "
          "--output {results}/engine-gemma3-270m.json",
          sections.engine_gemma_section, sections.engine_goals),
    Bench("engine-qwen2.5-coder-0.5b",
          "Engine on Qwen2.5-Coder-0.5B: many adapters vs base only vs HF + PEFT "
          "(engine-qwen2.5-coder-0.5b)",
          "lorastream bench engine --model qwen2.5-coder-0.5b --repeats 2 "
          "--output {results}/engine-qwen2.5-coder-0.5b.json",
          sections.engine_qwen_section, sections.engine_goals),
    Bench("engine-int8", "Engine over a quantized base: fp32 vs int8 vs int8-dynamic (engine-int8)",
          "lorastream bench engine --quantization int8,int8-dynamic --repeats 4 "
          "--output {results}/engine-int8.json",
          report_quant.quant_section, report_quant.quant_goals),
    Bench("engine-moe",
          "Engine on a mixture-of-experts base: expert LoRAs vs base only vs HF + PEFT "
          "(engine-moe)",
          "lorastream bench moe-checkpoint /tmp/qwen3moe && lorastream bench engine "
          "--model /tmp/qwen3moe --adapters 32 --prompts 32 --new-tokens 16 --repeats 2 "
          "--output {results}/engine-moe.json",
          report_moe.moe_section, report_moe.moe_goals),
    Bench("serve", "Serving cold adapters: overlapped loading on vs off (serve)",
          "lorastream bench serve --output {results}/serve.json",
          report_serve.serve_section, report_serve.serve_goals,
          (("serve_cdf", plot.ttft_itl_cdf), ("serve_interference", plot.interference_cdf),
           ("serve_cold", plot.cold_ttft_cdf))),
    Bench("serve-moe", "Serving on a MoE base: ITL during cold expert-LoRA loads (serve-moe)",
          "lorastream bench moe-checkpoint /tmp/lorastream-moe-base --experts 32 && "
          "lorastream bench serve --model /tmp/lorastream-moe-base --parts loads --adapters 6 "
          "--slots 2 --rank 128 --background-tokens 4000 --interference-rounds 4 "
          "--output {results}/serve-moe.json",
          report_serve_moe.serve_moe_section, report_serve_moe.serve_moe_goals),
    Bench("saturate", "Saturated serving: CPU busy, and served against the engine (saturate)",
          "lorastream bench saturate --output {results}/saturate.json",
          report_saturate.saturate_section, report_saturate.saturate_goals),
    Bench("scale", "Scale: from ten to ten thousand adapters, and HF + PEFT (scale)",
          "lorastream bench scale --output {results}/scale.json",
          sections.scale_section, sections.scale_goals, (("scale", plot.scale_plot),)),
    Bench("registry", "Store registry: registration cost against the number of names (registry)",
          "lorastream bench registry --output {results}/registry.json",
          report_registry.registry_section, report_registry.registry_goals),
    Bench("push", "Push from memory vs write to S3 then preload, to first token (push)",
          "lorastream bench push --output {results}/push.json",
          report_push.push_section, report_push.push_goals),
    Bench("prefix", "Prefix caching on chat traffic: on vs off, and prompts that share nothing "
          "(prefix)",
          "lorastream bench prefix --output {results}/prefix.json",
          report_prefix.prefix_section, report_prefix.prefix_goals),
    Bench("alora", "Activated LoRA after a base-model turn: KV sharing on vs off (alora)",
          "lorastream bench alora --output {results}/alora.json",
          report_alora.alora_section, report_alora.alora_goals),
    Bench("grammar", "Structured outputs: llguidance vs xgrammar per step (grammar)",
          "lorastream bench grammar --output {results}/grammar.json",
          report_grammar.grammar_section, report_grammar.grammar_goals),
    Bench("fleet", "A fleet in compose: affinity vs random routing, a killed worker (fleet)",
          "lorastream bench fleet --output {results}/fleet.json",
          sections.fleet_section, sections.fleet_goals),
    Bench("pool", "Routing over pods: the endpoint picker vs random vs lorastream's gateway "
          "(pool)",
          "lorastream bench pool --output {results}/pool.json",
          report_pool.pool_section, report_pool.pool_goals),
    Bench("soak", "Soak: two workers at 2x capacity, cancellations, a restart (soak)",
          "lorastream bench soak --output {results}/soak.json",
          report_soak.soak_section, report_soak.soak_goals,
          (("soak_rss", plot.soak_rss), ("soak_latency", plot.soak_latency))),
)
REPORT_COMMAND = "python -m benchpage --results {results} --out {out}"
# Machine fields that must agree for results to be comparable (date and bandwidth may vary).
_SAME_MACHINE = ("cpu", "logical_cores", "usable_cores", "memory_gib", "os", "python", "torch",
                 "torch_threads", "cuda_device")
_MACHINE_ROWS = (
    ("CPU", "cpu"), ("logical cores", "logical_cores"), ("cores usable by the process",
                                                         "usable_cores"),
    ("memory (GiB)", "memory_gib"), ("OS / kernel", "os"), ("Python", "python"),
    ("torch", "torch"), ("torch intra-op threads", "torch_threads"), ("GPU", "cuda_device"),
)


def load_results(results_dir: Path) -> dict[str, Result | None]:
    """benchmark name -> its result JSON, or None when the file is missing or unreadable."""
    results: dict[str, Result | None] = {}
    for name in [*(bench.name for bench in BENCHES), *gpu_report.RESULTS]:
        path = results_dir / f"{name}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            data = None
        except (OSError, ValueError) as err:
            log.warning("ignoring %s: %s", path, err)
            data = None
        results[name] = data if isinstance(data, Mapping) else None
    return results


def write_report(results_dir: Path, out_md: Path, plots_dir: Path | None = None) -> Path:
    """Draw the plots into ``plots_dir`` (default: ``results_dir/../plots``) and write the page."""
    results = load_results(results_dir)
    plots_dir = plots_dir or results_dir.parent / "plots"
    links: dict[str, str] = {}
    for bench in BENCHES:
        result = results[bench.name]
        if result is None:
            continue
        for key, draw in bench.plots:
            try:
                drawn = draw(result, plots_dir / f"{key}.png")
            except Exception:  # a plot must not cost the page; the section says it is missing
                log.exception("plot %s failed", key)
                continue
            if drawn is not None:
                links[key] = Path(os.path.relpath(drawn, out_md.parent)).as_posix()
    page = render_page(results, links, results_dir=_shown(results_dir), out=_shown(out_md))
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(page)
    return out_md


def render_page(
    results: Mapping[str, Result | None],
    plots: Mapping[str, str],
    results_dir: str = "docs/benchmarks/results",
    out: str = "docs/BENCHMARKS.md",
) -> str:
    """The markdown page for ``results`` with ``plots`` (plot key -> link relative to the page)."""
    parts = [
        "# Benchmarks",
        "<!-- Generated by `make bench` / `make bench-report` (python -m benchpage); do not "
        "edit by hand. -->",
        "> **Generated file — do not edit by hand.** `make bench` runs every benchmark below and "
        f"regenerates this page (`{REPORT_COMMAND.format(results=results_dir, out=out)}`; "
        "`make bench-report` only regenerates it from the existing results). Every figure, "
        "table and plot comes from the result JSONs in "
        f"[`{results_dir}`]({_rel(results_dir, out)}).",
        "## Headline",
        _headline(results),
        "## Goals",
        _goals(results),
        "## Machine",
        _machine(results),
        "## How to reproduce",
        _commands(results, results_dir, out),
    ]
    for bench in BENCHES:
        parts.append(f"## {bench.title}")
        result = results.get(bench.name)
        if result is None:
            command = code_block(bench.command.format(results=results_dir))
            parts.append(f"Not run: no `{bench.name}.json` in the results. Produce it with:\n\n"
                         + command)
            continue
        parts.append(code_block(text(result.get("command") or
                                     bench.command.format(results=results_dir))))
        parts.append(bench.section(result, plots))
    parts += ["## GPU figures", gpu_report.gpu_section(results)]
    return "\n\n".join(p for p in parts if p) + "\n"


ENGINE_MODELS = (("engine", "the default model (SmolLM2-135M)"),
                 ("engine-gemma3-270m", "Gemma 3 270M"),
                 ("engine-qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B"))


def _headline(results: Mapping[str, Result | None]) -> str:
    engines = [_engine_headline(results.get(name), shown) for name, shown in ENGINE_MODELS]
    scale = results.get("scale")
    if scale is None:
        return "\n".join([
            "- The scale benchmark (lorastream against HF transformers + PEFT, and throughput "
            "as adapters multiply) has not been run; see its section below.",
            *(line for line in engines if line),
        ])
    runs = sorted((r for r in scale.get("runs") or [] if isinstance(r, Mapping)),
                  key=lambda r: r.get("adapters") or 0)
    low, high = (runs[0], runs[-1]) if runs else ({}, {})
    lines = []
    vs_peft = scale.get("lorastream_vs_peft")
    if vs_peft is not None:
        lines.append(
            f"- **{ratio(vs_peft)} the throughput of HF transformers + PEFT** on the same "
            f"requests and adapters ({text(get(scale, 'peft', 'adapters'))} adapters, "
            "mixed-adapter batches), measured in the same run: "
            f"{number(high.get('throughput_tok_s'))} vs "
            f"{number(get(scale, 'peft', 'throughput_tok_s'))} tok/s."
        )
    else:
        why = " (scale ran with `--no-peft`)" if not scale.get("peft") else ""
        lines.append(f"- lorastream vs HF transformers + PEFT: not measured{why}.")
    goal = sections.scale_goals(scale)[0]
    lines.append(
        f"- **Throughput loss from {text(low.get('adapters'))} to {text(high.get('adapters'))} "
        f"adapters: {pct(scale.get('throughput_loss_max_vs_min'))}** (goal {goal[2]}: "
        f"{goal[3]}); {number(low.get('throughput_req_s'), 2)} → "
        f"{number(high.get('throughput_req_s'), 2)} req/s, TTFT p50 "
        f"{ms(get(low, 'ttft_ms', 'p50'))} → {ms(get(high, 'ttft_ms', 'p50'))} ms."
    )
    return "\n".join(lines + [line for line in engines if line])


def _engine_headline(r: Result | None, model: str) -> str:
    """One line of the engine benchmark on ``model``; empty when it has not run."""
    if r is None:
        return ""
    peft = (f", **{ratio(r.get('multi_vs_peft'))} HF transformers + PEFT** "
            f"({number(r.get('peft_mixed_batch_decode_tok_s'))} tok/s)"
            if "multi_vs_peft" in r else "")
    return (
        f"- Decode on {model} with {text(r.get('distinct_adapters_per_step', r.get('adapters')))} "
        f"distinct adapters in the batch: {number(r.get('engine_multi_adapter_decode_tok_s'))} "
        f"tok/s, **{ratio(r.get('multi_vs_base'))} the base model alone** "
        f"({number(r.get('engine_base_only_decode_tok_s'))} tok/s){peft}."
    )


def _goals(results: Mapping[str, Result | None]) -> str:
    rows: list[list[str]] = []
    for bench in BENCHES:
        result = results.get(bench.name)
        if result is None:
            rows.append([f"{bench.name}", MISSING, MISSING, "not run"])
        else:
            rows.extend(bench.goals(result))
    return table(GOALS_HEADER, rows)


def _machine(results: Mapping[str, Result | None]) -> str:
    machines = {name: r["machine"] for name, r in results.items()
                if r is not None and isinstance(r.get("machine"), Mapping)}
    if not machines:
        return "No result records its machine."
    first = next(iter(machines.values()))
    rows = [[label, text(first.get(key))] for label, key in _MACHINE_ROWS]
    runs = [[name, text(m.get("date_utc")), _commit(m), number(m.get("memory_bandwidth_gbs")),
             text(m.get("openmp_spin_count"))] for name, m in machines.items()]
    parts = [
        table(["", "value"], rows, numeric_from=2),
        "Each run, with its lorastream commit, the memory read bandwidth measured then "
        "(GB/s, best of five `torch.sum` over a float32 tensor far larger than the caches) and "
        "the rounds OpenMP's idle workers spun before sleeping (`GOMP_SPINCOUNT`; a run that "
        "does not record it spun 3,000, lorastream's setting before 30,000):",
        table(["benchmark", "date (UTC)", "commit", "memory bandwidth (GB/s)",
               "OpenMP spin rounds"], runs),
    ]
    differing = [key for key in _SAME_MACHINE
                 if len({json.dumps(m.get(key)) for m in machines.values()}) > 1]
    commits = {_commit(m) for m in machines.values()}
    if differing:
        parts.append(f"**Note:** the results come from different machines or software (differing: "
                     f"{', '.join(differing)}); the table above shows the first one's.")
    if len(commits) > 1:
        parts.append("**Note:** the results come from different lorastream commits.")
    return "\n\n".join(parts)


def _commit(machine: Mapping[str, Any]) -> str:
    commit = machine.get("commit")
    if not commit:
        return "unknown"
    return f"{commit} (with uncommitted changes)" if machine.get("dirty") else str(commit)


def _commands(results: Mapping[str, Result | None], results_dir: str, out: str) -> str:
    commands = [text((results.get(b.name) or {}).get("command")
                     or b.command.format(results=results_dir)) for b in BENCHES]
    commands.append(REPORT_COMMAND.format(results=results_dir, out=out))
    return (
        "`make bench` runs, in this order, on one CPU machine (the commands recorded in the "
        "results; a benchmark that has not run shows the command that would produce it):\n\n"
        + code_block("\n".join(commands))
    )


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when below it (as typed), else absolute."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def _rel(target: str, page: str) -> str:
    return Path(os.path.relpath(target, Path(page).parent)).as_posix()
