"""The MoE engine benchmark's section and goal rows on the benchmark page (``engine-moe.json``,
``lorastream/bench/engine_moe.py``): decode with many expert-LoRA adapters against the base
model alone and against HF transformers + PEFT, the shape, and the read ceiling."""

from __future__ import annotations

from collections.abc import Mapping

from benchpage.report_format import (
    MISSING,
    Goal,
    Result,
    get,
    goal_row,
    number,
    paragraphs,
    ratio,
    table,
    text,
)


def moe_goals(r: Result) -> list[list[str]]:
    rows = [goal_row("MoE engine decode, multi-adapter / base only", r.get("multi_vs_base"),
                     r.get("goal_multi_vs_base"))]
    if "multi_vs_peft" in r:
        rows.append(goal_row("MoE engine decode, multi-adapter / HF + PEFT",
                             r.get("multi_vs_peft"), r.get("goal_multi_vs_peft")))
    return rows


def _shape(r: Result) -> str:
    s = r.get("shape") or {}
    return (
        f"a random-weight {text(s.get('family'))} checkpoint of hidden {text(s.get('hidden'))}, "
        f"{text(s.get('layers'))} layers (all sparse), {text(s.get('heads'))} query and "
        f"{text(s.get('kv_heads'))} KV heads of {text(s.get('head_dim'))}, "
        f"{text(s.get('experts'))} experts of which each token takes "
        f"{text(s.get('top_k'))}, expert width (moe_intermediate) "
        f"{text(s.get('moe_intermediate'))}"
    )


def _ceiling(r: Result) -> str:
    c = r.get("read_ceiling")
    if not isinstance(c, Mapping):
        return "*The read ceiling cannot be shown: this result does not record it.*"
    goal = Goal.parse(r.get("goal_multi_vs_base"))
    best = c.get("multi_vs_base_ceiling")
    reach = ""
    if goal is not None and goal.met(best) is not None:
        reach = (f" The goal ({goal.shown()}) lies within this ceiling." if goal.met(best)
                 else f" The goal ({goal.shown()}) lies above this ceiling: no LoRA path "
                 "reaches it at this shape and batch on a memory-bound machine.")
    return (
        "**The read ceiling.** Decode on this CPU is memory-bound, so a step's time follows the "
        "bytes it reads. Computed by the benchmark from the shape (fp32): the base model's "
        f"step reads {number(c.get('base_step_mb'))} MB (attention and router matrices, the "
        f"{number(c.get('experts_visited_per_layer'))} experts per layer that "
        f"{text(r.get('prompts'))} rows visit under uniform routing, the LM head); the "
        f"adapters add {number(c.get('adapter_step_mb'))} MB (each row's adapter: its "
        "attention A and B, and the A and B of each expert the row visits). A LoRA path that "
        "read nothing else would reach "
        f"{number(c.get('base_step_mb'))} / ({number(c.get('base_step_mb'))} + "
        f"{number(c.get('adapter_step_mb'))}) = **{ratio(best, 3)} of base-only "
        f"throughput**; over the decoder layers alone (no LM head), "
        f"{ratio(c.get('layers_multi_vs_base_ceiling'), 3)}. The engine's storage holds "
        "gate_up's shared A once for gate and once for up, so it reads "
        f"{number(c.get('engine_adapter_step_mb'))} MB of adapters per step.{reach}"
    )


def moe_section(r: Result, plots: Mapping[str, str]) -> str:
    rows = [
        [f"engine, {text(r.get('adapters'))} distinct adapters in the batch",
         number(r.get("engine_multi_adapter_decode_tok_s")), MISSING],
        ["engine, base model only", number(r.get("engine_base_only_decode_tok_s")),
         ratio(r.get("multi_vs_base"), 3)],
    ]
    if "peft_by_adapter_decode_tok_s" in r:
        rows.append(["HF transformers + PEFT, adapter by adapter",
                     number(r.get("peft_by_adapter_decode_tok_s")),
                     ratio(r.get("multi_vs_peft"))])
    peft_note = "HF transformers + PEFT was not run (`--no-peft`)."
    if "peft_by_adapter_decode_tok_s" in r:
        peft_note = (
            "PEFT runs each adapter's prompts in one batch after `set_adapter` (it refuses "
            "mixed-adapter batches with LoRA on expert parameters); PEFT generates "
            f"{text(r.get('peft_new_tokens', r.get('new_tokens')))} tokens per prompt.")
    load = r.get("load_avg_1m") or {}
    return paragraphs([
        f"{text(r.get('prompts'))} prompts, {text(r.get('new_tokens'))} new tokens each, on "
        f"{_shape(r)} (`lorastream bench moe-checkpoint` builds it; its default shape scales "
        "Qwen3-30B-A3B's proportions down to fit this machine). "
        f"{text(r.get('adapters'))} adapters of rank {text(r.get('rank'))} on "
        f"{text(r.get('targets'))}, one per prompt. Decode tok/s as in the engine benchmark "
        f"(best of {text(r.get('repeats'))} repeats); {peft_note} The machine's 1-minute load "
        f"average was {number(get(load, 'before'), 2)} before and "
        f"{number(get(load, 'after'), 2)} after (shared).",
        table(["side", "decode tok/s", "multi-adapter engine / this side"], rows),
        f"Multi-adapter / base only: **{ratio(r.get('multi_vs_base'), 3)}** (goal "
        f"{_goal(r.get('goal_multi_vs_base'))}); multi-adapter / HF + PEFT: "
        f"**{ratio(r.get('multi_vs_peft'))}** (goal {_goal(r.get('goal_multi_vs_peft'))}).",
        _ceiling(r),
    ])


def _goal(goal_text: object) -> str:
    goal = Goal.parse(goal_text)
    return MISSING if goal is None else goal.shown()
