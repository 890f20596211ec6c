"""OpenAI's ``response_format`` and vLLM's ``structured_outputs`` -> one :class:`StructuredOutput`.

Accepted (anything else is a 400 naming the field):

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
  "description"?}}`` (the schema; ``strict`` false or true, it is enforced either way);
* ``structured_outputs`` (vLLM's extra body; exactly one key): ``json`` (a schema, object or
  string), ``regex``, ``choice`` (a list of strings, the output is one of them) or ``grammar``
  (Lark, llguidance's dialect).

A request may carry one of the two, not both.
"""

from __future__ import annotations

import json
from typing import Any

from lorastream.core.errors import InvalidArgument
from lorastream.core.structured import JSON_OBJECT_SCHEMA, StructuredKind, StructuredOutput

_RESPONSE_FORMAT = "response_format"
_STRUCTURED = "structured_outputs"
_VLLM_KEYS = ("json", "regex", "choice", "grammar")
_REGEX_META = set("\\.^$|?*+()[]{}-&~#")


def _escape(text: str) -> str:
    """``text`` as a regex matching exactly it (only metacharacters escaped: the grammar engine's
    regex dialect refuses some escapes Python's ``re.escape`` writes)."""
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


def structured_output(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutput | None:
    """The constraint a request asks for, or None; raises InvalidArgument naming the field."""
    constraint = _from_response_format(response_format) if response_format else None
    if structured_outputs:
        if constraint is not None:
            raise InvalidArgument(
                f"{_STRUCTURED}: give either response_format or structured_outputs, not both"
            )
        constraint = _from_vllm(structured_outputs)
    if constraint is not None:
        constraint.validate()
    return constraint


def _from_response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(StructuredKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA, _RESPONSE_FORMAT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidArgument(
                f"{_RESPONSE_FORMAT}: type json_schema needs json_schema: "
                "{\"name\": ..., \"schema\": {...}}"
            )
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise InvalidArgument(f"{_RESPONSE_FORMAT}: json_schema.name is required (a string)")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{_RESPONSE_FORMAT}: json_schema.schema must be an object")
        if "strict" in spec and not isinstance(spec["strict"], bool | None):
            raise InvalidArgument(f"{_RESPONSE_FORMAT}: json_schema.strict must be a boolean")
        return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema), _RESPONSE_FORMAT)
    raise InvalidArgument(
        f"{_RESPONSE_FORMAT}: type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
    )


def _from_vllm(value: dict[str, Any]) -> StructuredOutput:
    given = [key for key in _VLLM_KEYS if value.get(key) is not None]
    unknown = sorted(set(value) - set(_VLLM_KEYS))
    if unknown or len(given) != 1:
        raise InvalidArgument(
            f"{_STRUCTURED}: give exactly one of {', '.join(_VLLM_KEYS)}"
            + (f" (unsupported: {', '.join(unknown)})" if unknown else "")
        )
    key = given[0]
    spec = value[key]
    if key == "json":
        text = spec if isinstance(spec, str) else json.dumps(spec)
        return StructuredOutput(StructuredKind.JSON_SCHEMA, text, _STRUCTURED)
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
            raise InvalidArgument(f"{_STRUCTURED}: choice must be a non-empty list of strings")
        pattern = "|".join(f"({_escape(choice)})" for choice in spec)
        return StructuredOutput(StructuredKind.REGEX, pattern, _STRUCTURED)
    if not isinstance(spec, str):
        raise InvalidArgument(f"{_STRUCTURED}: {key} must be a string")
    kind = StructuredKind.REGEX if key == "regex" else StructuredKind.GRAMMAR
    return StructuredOutput(kind, spec, _STRUCTURED)
