"""The activated-LoRA benchmark's section and goal rows on the benchmark page."""

from __future__ import annotations

from collections.abc import Mapping

from benchpage.report_format import (
    Result,
    goal_row,
    ms,
    number,
    paragraphs,
    ratio,
    table,
    text,
)


def alora_goals(r: Result) -> list[list[str]]:
    return [
        goal_row("activated LoRA TTFT after a base turn, prefix caching on / off",
                 r.get("alora_ttft_on_over_off"), r.get("goal_ttft"), digits=3),
        goal_row("activated LoRA greedy outputs identical, on and off (1 = yes)",
                 r.get("outputs_identical"), r.get("goal_identical"), digits=0),
    ]


def _rows(r: Result) -> list[list[str]]:
    rows = []
    for i, c in enumerate(r.get("conversations") or []):
        rows.append([
            str(i + 1), text(c.get("first")), number(c.get("prompt_tokens"), 0),
            ms(c.get("base_ttft_off_ms")), ms(c.get("alora_ttft_off_ms")),
            ms(c.get("alora_ttft_on_ms")), number(c.get("alora_cached_on"), 0),
            ratio(c.get("on_over_off"), 3), ms(c.get("lora_ttft_on_ms")),
            number(c.get("lora_cached_on"), 0),
        ])
    return rows


def alora_section(r: Result, plots: Mapping[str, str]) -> str:
    c = r.get("config") or {}
    header = ("conversation", "ran first", "turn-2 prompt tokens", "base turn TTFT (ms)",
              "aLoRA TTFT, off (ms)", "aLoRA TTFT, on (ms)", "aLoRA cached tokens, on",
              "on / off", "plain LoRA TTFT, on (ms)", "plain LoRA cached tokens")
    return paragraphs([
        f"{text(c.get('conversations'))} conversations of {text(c.get('conversation_tokens'))} "
        f"random token ids on model {text(c.get('model'))}. Turn 1 asks the base model (a greedy "
        f"reply of {text(c.get('reply_tokens'))} tokens); turn 2 asks an activated LoRA (rank "
        f"{text(c.get('rank'))}, all linear, PEFT's `alora_invocation_tokens`: "
        f"{text(c.get('invocation_tokens'))} ids) on the conversation, the reply and its "
        "invocation sequence. Both turns run on a worker with prefix caching on and on one "
        "with it off, in alternating order. With caching, turn 2 takes every full KV block "
        "before its invocation from the base model's turn; a plain LoRA of the same weights "
        "after the same base turn (last columns, caching on) can take none: every row of it "
        "takes its delta. TTFT is from submission to the first token, one request at a time; "
        f"the machine's 1-minute load average was {number(r.get('load_average_1m_at_start'), 2)} "
        f"at the start and {number(r.get('load_average_1m_at_end'), 2)} at the end (shared).",
        table(header, _rows(r)),
        f"The activated adapter's TTFT p50 is {ms(r.get('alora_ttft_p50_on_ms'))} ms with "
        f"sharing and {ms(r.get('alora_ttft_p50_off_ms'))} ms without: "
        f"{ratio(r.get('alora_ttft_on_over_off'), 3)} (the median of the conversations' "
        "ratios). Greedy outputs are "
        f"{'identical' if r.get('outputs_identical') == 1 else '**not identical**'} between "
        "the two workers.",
    ])
