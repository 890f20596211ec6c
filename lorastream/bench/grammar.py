"""Structured-output cost per step: llguidance (what the worker uses) against xgrammar.

For each tokenizer (the default model's, and Gemma 3's 262k vocabulary when installed) and each
constraint, both engines walk the same token sequence, a valid output tokenized once: before each
token the engine fills the next-token bitmask (the work a constrained row adds to a decode step),
then accepts the token. Reported per engine: one-off tokenizer setup, compile time of the
constraint (on the request path, uncached), and the bitmask fill per step (p50, p90, mean). Both
run single-threaded with compact JSON whitespace, so they do the same work.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lorastream.bench.machine import command_line, machine_info


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "json_schema" | "regex"
    spec: str
    text: str  # a valid output, walked token by token


_ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name", "email"], "additionalProperties": False},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"},
            "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "status": {"enum": ["open", "paid", "shipped"]},
    },
    "required": ["id", "customer", "items", "status"],
    "additionalProperties": False,
}
_COMPACT = (",", ":")  # both engines emit compact JSON: no blank between items
_ORDER_TEXT = json.dumps({
    "id": 1042, "customer": {"name": "Ada Lovelace", "email": "ada@example.com"},
    "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1, "price": 120.0}],
    "status": "paid",
}, separators=_COMPACT)
CASES = (
    Case("json_schema (order)", "json_schema", json.dumps(_ORDER), _ORDER_TEXT),
    Case("json_schema (flat)", "json_schema", json.dumps({
        "type": "object",
        "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"},
                       "label": {"enum": ["yes", "no", "unsure"]}},
        "required": ["answer", "confidence", "label"], "additionalProperties": False}),
        json.dumps({"answer": "forty-two", "confidence": 0.9, "label": "unsure"},
                   separators=_COMPACT)),
    Case("regex (date list)", "regex", r"\d{4}-\d{2}-\d{2}(, \d{4}-\d{2}-\d{2}){0,9}",
         "2026-11-25, 2026-12-01, 2027-01-15"),
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _walk_llguidance(tokenizer: Any, vocab: int) -> Callable[[Case, list[int]], dict]:
    import llguidance
    import llguidance.hf

    started = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup_s = time.perf_counter() - started
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)  # [1, W]

    def walk(case: Case, ids: list[int]) -> dict:
        started = time.perf_counter()
        if case.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                case.spec, defaults={"whitespace_flexible": False}
            )
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(case.spec)
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        compile_s = time.perf_counter() - started
        fills = []
        for token in ids:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            fills.append(time.perf_counter() - started)
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance rejected the valid output of {case.name}")
        return {"compile_ms": compile_s * 1e3, "fills": fills, "setup_s": setup_s}

    return walk


def _walk_xgrammar(tokenizer: Any, vocab: int) -> Callable[[Case, list[int]], dict]:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    setup_s = time.perf_counter() - started
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)  # [1, W]

    def walk(case: Case, ids: list[int]) -> dict:
        compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        started = time.perf_counter()
        if case.kind == "json_schema":
            compiled = compiler.compile_json_schema(
                case.spec, any_whitespace=False, separators=(",", ":")
            )
        else:
            compiled = compiler.compile_regex(case.spec)
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - started
        fills = []
        for token in ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            fills.append(time.perf_counter() - started)
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar rejected the valid output of {case.name}")
        return {"compile_ms": compile_s * 1e3, "fills": fills, "setup_s": setup_s}

    return walk


ENGINES = {"llguidance": _walk_llguidance, "xgrammar": _walk_xgrammar}


def _tokenizers(models: tuple[str, ...]) -> list[tuple[str, Any, int]]:
    from transformers import AutoTokenizer

    from lorastream.worker.model.checkpoint import resolve_checkpoint
    from lorastream.worker.service.config import WorkerSettings

    cache_dir = WorkerSettings().model_cache_dir
    found: list[tuple[str, Any, int]] = []
    for model in models:
        path: Path = resolve_checkpoint(model, cache_dir=cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(path)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        found.append((model, tokenizer, int(vocab)))
    return found


def available_models(models: tuple[str, ...]) -> tuple[str, ...]:
    """``models`` without gemma3-270m when its weights package is not installed."""
    import importlib.util

    from lorastream.worker.model.embedded import GEMMA3_270M, GEMMA3_PACKAGE

    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return tuple(m for m in models if m != GEMMA3_270M)
    return models


def run_grammar_bench(models: tuple[str, ...] = ("default",), repeats: int = 5) -> dict:
    """Both engines over every (tokenizer, case); ``repeats`` walks each, the first a warm-up."""
    rows = []
    for model, tokenizer, vocab in _tokenizers(models):
        walkers = {name: make(tokenizer, vocab) for name, make in ENGINES.items()}
        for case in CASES:
            ids = tokenizer.encode(case.text, add_special_tokens=False)
            for engine, walk in walkers.items():
                runs = [walk(case, ids) for _ in range(repeats)][1:]
                fills = [f * 1e6 for run in runs for f in run["fills"]]
                rows.append({
                    "model": model, "vocab": vocab, "case": case.name, "engine": engine,
                    "tokens": len(ids), "setup_s": round(runs[0]["setup_s"], 3),
                    "compile_ms": round(statistics.median(r["compile_ms"] for r in runs), 3),
                    "fill_us_p50": round(_percentile(fills, 0.5), 1),
                    "fill_us_p90": round(_percentile(fills, 0.9), 1),
                    "fill_us_mean": round(statistics.fmean(fills), 1),
                })
    return {
        "benchmark": "grammar",
        "machine": machine_info(),
        "command": command_line(),
        "chosen": "llguidance",
        "rows": rows,
        "summary": _summary(rows),
    }


def _summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per engine, the mean over cases of compile ms and of mean fill µs (per tokenizer)."""
    summary: dict[str, dict[str, float]] = {}
    for row in rows:
        key = f"{row['engine']}@{row['model']}"
        entry = summary.setdefault(key, {"compile_ms": 0.0, "fill_us_mean": 0.0, "cases": 0})
        entry["compile_ms"] += row["compile_ms"]
        entry["fill_us_mean"] += row["fill_us_mean"]
        entry["cases"] += 1
    for entry in summary.values():
        cases = entry.pop("cases")
        entry["compile_ms"] = round(entry["compile_ms"] / cases, 3)
        entry["fill_us_mean"] = round(entry["fill_us_mean"] / cases, 1)
    return summary
