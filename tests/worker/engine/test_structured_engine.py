"""Structured outputs through the engine: constrained and free rows in one batch, n > 1, errors.

The tiny model is random-weight: its output is shaped only by the constraint, so a constrained
output that parses proves the mask is applied, and a free row beside it that still equals HF +
PEFT proves the mask touches nothing else.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jsonschema
import pytest

from lorastream.core.errors import InvalidArgument
from lorastream.core.generation import FinishReason, GenerationEvent, PromptInput
from lorastream.core.structured import StructuredKind, StructuredOutput
from lorastream.worker.engine.sampling import SamplingParams
from lorastream.worker.service.operations import WorkerOperations
from tests.worker.conftest import NEW_TOKENS, PROMPTS, EngineFactory

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
SCHEMA = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(PERSON))
REGEX = StructuredOutput(StructuredKind.REGEX, r"(yes|no)-[0-9]{2}", "structured_outputs")
GRAMMAR = StructuredOutput(
    StructuredKind.GRAMMAR, 'start: "<" word ">"\nword: /[a-c]{1,4}/', "structured_outputs"
)


def _collect(events: list[GenerationEvent]) -> dict[int, tuple[list[int], str, FinishReason]]:
    """choice -> (tokens, text, finish reason)."""
    out: dict[int, tuple[list[int], str, FinishReason]] = {}
    for e in events:
        tokens, text, _ = out.get(e.index, ([], "", None))
        out[e.index] = (tokens + list(e.token_ids), text + e.text, e.finish_reason)  # type: ignore[assignment]  # finish_reason: None before the last event
    return out


def test_constrained_and_free_rows_share_a_batch_with_different_adapters(
    engine_factory: EngineFactory,
    tiny_adapters: dict[str, Path],
    reference: dict[tuple[str, int], list[int]],
) -> None:
    engine = engine_factory(start=False)  # every request lands in the same first step
    ops = WorkerOperations(engine)
    for name in ("attn-r4", "mlp-r8"):
        ops.load_adapter(name, str(tiny_adapters[name]))
    prompt = PromptInput(token_ids=tuple(PROMPTS[0]))
    free = engine.submit("attn-r4", prompt, SamplingParams(max_tokens=NEW_TOKENS))
    constrained = {
        output.kind: engine.submit("mlp-r8", prompt, SamplingParams(
            max_tokens=80, temperature=1.0, seed=3, structured=output,
        ))
        for output in (SCHEMA, REGEX, GRAMMAR)
    }
    engine.start()
    assert _collect(list(free))[0][0] == reference[("attn-r4", 0)]
    outputs = {kind: _collect(list(stream))[0] for kind, stream in constrained.items()}
    tokens, text, reason = outputs[StructuredKind.JSON_SCHEMA]
    jsonschema.validate(json.loads(text), PERSON)
    assert reason is FinishReason.STOP and len(tokens) < 80  # ended when the object closed
    assert re.fullmatch(REGEX.spec, outputs[StructuredKind.REGEX][1])
    assert re.fullmatch(r"<[a-c]{1,4}>", outputs[StructuredKind.GRAMMAR][1])
    assert engine.stats.peak_running == 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_of_n_choices_walks_the_grammar_on_its_own(
    engine_factory: EngineFactory, temperature: float
) -> None:
    engine = engine_factory()
    stream = engine.submit("tiny", PromptInput(text="Answer:"), SamplingParams(
        max_tokens=20, temperature=temperature, seed=5, n=3, structured=REGEX,
    ))
    choices = _collect(list(stream))
    assert sorted(choices) == [0, 1, 2]
    for tokens, text, reason in choices.values():
        assert re.fullmatch(REGEX.spec, text) and reason is FinishReason.STOP
        assert len(tokens) == len(text)  # one character per token, no EOS needed to end
    if temperature == 0.0:
        assert len({text for _, text, _ in choices.values()}) == 1


def test_logprobs_of_a_constrained_row_see_the_mask(engine_factory: EngineFactory) -> None:
    engine = engine_factory()
    choice = StructuredOutput(StructuredKind.REGEX, "(yes)|(no)", "structured_outputs")
    events = list(engine.submit("tiny", PromptInput(text="Q"), SamplingParams(
        max_tokens=5, logprobs=5, structured=choice,
    )))
    first = events[0].logprobs[0]
    allowed = {"y", "n"}
    assert first.token in allowed and math.isfinite(first.logprob)
    finite = {top.token for top in first.top if math.isfinite(top.logprob)}
    assert finite == allowed  # the other top tokens are -inf: the mask is in the logprobs
    assert math.isclose(sum(math.exp(t.logprob) for t in first.top), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("output, params, match", [
    (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "nope"}'), {}, "response_format"),
    (StructuredOutput(StructuredKind.REGEX, "(a", "structured_outputs"), {},
     "structured_outputs"),
    (StructuredOutput(StructuredKind.GRAMMAR, "start: missing", "structured_outputs"), {},
     "structured_outputs"),
    (SCHEMA, {"ignore_eos": True}, "ignore_eos cannot be combined with response_format"),
])
def test_a_bad_constraint_is_refused_at_submit_and_nothing_is_queued(
    engine_factory: EngineFactory, output: StructuredOutput, params: dict[str, object],
    match: str,
) -> None:
    engine = engine_factory()
    with pytest.raises(InvalidArgument, match=match):
        engine.submit("tiny", PromptInput(text="x"), SamplingParams(
            max_tokens=4, structured=output, **params  # type: ignore[arg-type]  # params: SamplingParams' own fields
        ))
    assert engine.waiting == 0 and engine.running == 0
