"""What a request constrains its output to: a JSON schema, any JSON object, a regex or a grammar.

Part of the worker's API (carried in :class:`~lorastream.core.generation.SamplingParams`). The
worker compiles it for its tokenizer (lorastream.worker.engine.grammar) and masks every step's
logits with it, so a constrained request and a free one share a batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from lorastream.core.errors import InvalidArgument

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""The schema of ``response_format: {"type": "json_object"}``: any JSON object."""

MAX_SPEC_BYTES = 64 * 1024
"""Longest schema, regex or grammar a request may carry (compiling is on the request path)."""


class StructuredKind(StrEnum):
    """The language of :attr:`StructuredOutput.spec`."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema document (json_object is {"type": "object"})
    REGEX = "regex"  # a regular expression the whole output matches
    GRAMMAR = "grammar"  # a Lark grammar (llguidance's dialect), start rule ``start``


@dataclass(frozen=True)
class StructuredOutput:
    """An output constraint; ``param`` names the request field it came from (for errors)."""

    kind: StructuredKind
    spec: str
    param: str = "response_format"

    def validate(self) -> None:
        """Raise :class:`InvalidArgument` for a spec that cannot be a constraint of its kind.

        What the grammar engine rejects (an unknown JSON Schema keyword value, a regex it cannot
        compile) is found when the worker compiles it, with the engine's message.
        """
        if not self.spec:
            raise InvalidArgument(f"{self.param} has an empty {self.kind.value}")
        if len(self.spec.encode()) > MAX_SPEC_BYTES:
            raise InvalidArgument(
                f"{self.param}: the {self.kind.value} is {len(self.spec.encode())} bytes; at most "
                f"{MAX_SPEC_BYTES} are accepted"
            )
        if self.kind is StructuredKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise InvalidArgument(f"{self.param}: the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidArgument(
                    f"{self.param}: a JSON schema is an object (or true/false), got "
                    f"{type(schema).__name__}"
                )
