"""Structured outputs in the worker: the bitmask, the compiler's errors, and constrained decoding.

Decoding here picks the argmax of random logits under the mask: whatever the model would prefer,
the output must parse as the schema (regex, grammar) and end when the constraint is complete.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from lorastream.core.errors import InvalidArgument
from lorastream.core.structured import (
    JSON_OBJECT_SCHEMA,
    MAX_SPEC_BYTES,
    StructuredKind,
    StructuredOutput,
)
from lorastream.worker.engine.grammar import GrammarCompiler, unpack_bitmask
from lorastream.worker.model.checkpoint import resolve_checkpoint
from tests.support.json_prefix import is_json_prefix
from tests.worker.engine.test_default_model import DEFAULT_MODEL_CACHE

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    checkpoint = resolve_checkpoint("default", cache_dir=DEFAULT_MODEL_CACHE)
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer, vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id]
    )


def reference_unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    rows = []
    for row in bitmask.tolist():
        rows.append(
            [v < 32 * len(row) and bool((row[v // 32] >> (v % 32)) & 1) for v in range(vocab)]
        )
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize("vocab, words", [(31, 1), (32, 1), (33, 2), (100, 4), (70, 2)])
def test_unpack_bitmask_matches_the_bit_layout(vocab: int, words: int) -> None:
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(unpack_bitmask(bitmask, vocab), reference_unpack(bitmask, vocab))


def constrained_greedy(
    compiler: GrammarCompiler, tokenizer, output: StructuredOutput, seed: int, limit: int = 200
) -> tuple[str, bool]:
    """Decode argmax of random logits under the constraint; (text, finished by the grammar)."""
    matcher = compiler.matcher(output)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(limit):
        logits = torch.randn(2, compiler.vocab_size, generator=generator)  # [2, V]; row 1 is free
        free = logits[1].clone()
        compiler.mask_(logits, [(0, matcher)])
        assert torch.equal(logits[1], free), "a row without a constraint was changed"
        token = int(logits[0].argmax())
        matcher.accept(token)
        if token == tokenizer.eos_token_id:
            return tokenizer.decode(tokens), True
        tokens.append(token)
        if matcher.finished:
            return tokenizer.decode(tokens), True
    return tokenizer.decode(tokens), False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_parses_as_the_schema(compiler, tokenizer, seed: int) -> None:
    text, finished = constrained_greedy(
        compiler, tokenizer, StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(PERSON)), seed
    )
    assert finished, text
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_output_is_an_object(compiler, tokenizer) -> None:
    text, finished = constrained_greedy(
        compiler, tokenizer, StructuredOutput(StructuredKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA), 0,
        limit=400,
    )
    assert text.lstrip().startswith("{"), text
    if finished:
        assert isinstance(json.loads(text), dict)
    else:  # random logits may keep an object open; what came so far is an object's prefix
        assert is_json_prefix(text), text


@pytest.mark.parametrize(("text", "prefix"), [
    ('{"a": [1, -2.5e3, "x\\n\\u00e9", true, null]}', True), ("{}", True), (" [] ", True),
    ("", True), ("{", True), ('{"a', True), ('{"a": ', True), ('{"a": [1, tr', True),
    ('{"a": -', True), ('{"a": 1.', True), ('{"a": 1e', True), ('{"a": "\\u00', True),
    ('{"a": "\\', True), ('{"a": fals', True),
    ('{"a" 1', False), ('{"a": [1,]', False), ("{}x", False), ("{} {}", False),
    ('{"a": 01}', False), ('{"a": tru}', False), ('{"a": "\\q"}', False), ("{1: 2}", False),
    ('{"a": 1,}', False), ('{"a": -x}', False), ('{"a": "\\u00zz"}', False), ("}", False),
])
def test_is_json_prefix_tells_a_cut_document_from_a_broken_one(text: str, prefix: bool) -> None:
    assert is_json_prefix(text) is prefix
    if prefix:  # cross-check with the json module where it can judge
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return
    else:
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


@pytest.mark.parametrize(
    "kind, spec, pattern",
    [
        (StructuredKind.REGEX, r"(yes|no), [0-9]{3}", r"(yes|no), [0-9]{3}"),
        (StructuredKind.GRAMMAR, 'start: "colour=" COLOUR\nCOLOUR: "red" | "green" | "blue"',
         r"colour=(red|green|blue)"),
    ],
)
def test_regex_and_grammar_outputs_match(
    compiler, tokenizer, kind, spec: str, pattern: str
) -> None:
    for seed in range(3):
        text, finished = constrained_greedy(compiler, tokenizer, StructuredOutput(kind, spec), seed)
        assert finished and re.fullmatch(pattern, text), text


@pytest.mark.parametrize(
    "output, message",
    [
        (StructuredOutput(StructuredKind.JSON_SCHEMA, "{not json"), "not JSON"),
        (StructuredOutput(StructuredKind.JSON_SCHEMA, "[1, 2]"), "is an object"),
        (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "frob"}'), "frob"),
        (StructuredOutput(StructuredKind.REGEX, "(unclosed"), "response_format"),
        (StructuredOutput(StructuredKind.GRAMMAR, "start: undefined_rule"), "undefined_rule"),
        (StructuredOutput(StructuredKind.JSON_SCHEMA, ""), "empty"),
        (StructuredOutput(StructuredKind.REGEX, "a" * (MAX_SPEC_BYTES + 1)), "at most"),
    ],
)
def test_bad_constraints_are_refused_naming_the_parameter(compiler, output, message: str) -> None:
    with pytest.raises(InvalidArgument, match="response_format") as info:
        compiler.matcher(output)
    assert message in str(info.value)


def test_rows_of_a_batch_follow_their_own_constraints(compiler, tokenizer) -> None:
    yes_no = compiler.matcher(StructuredOutput(StructuredKind.REGEX, "yes|no"))
    digits = compiler.matcher(StructuredOutput(StructuredKind.REGEX, "[0-9]+"))
    logits = torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(5))
    free = logits[1].clone()
    compiler.mask_(logits, [(0, yes_no), (2, digits)])
    allowed_0, allowed_2 = (
        {tokenizer.decode([t]) for t in torch.isfinite(logits[row]).nonzero().flatten().tolist()}
        for row in (0, 2)
    )
    assert allowed_0 and all("yes".startswith(s) or "no".startswith(s) for s in allowed_0)
    assert allowed_2 and all(s.isdigit() for s in allowed_2)
    assert torch.equal(logits[1], free)


def test_compiled_grammars_are_cached_and_bounded(tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), cache_size=2)
    for pattern in ("a+", "b+", "c+", "a+"):
        compiler.matcher(StructuredOutput(StructuredKind.REGEX, pattern))
    assert len(compiler._cache) == 2
