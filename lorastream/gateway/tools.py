"""Tool calling (OpenAI's ``tools`` / ``tool_choice``): the request checks, the grammar that forces
a call, and the parser that turns the model's text into ``tool_calls``.

The tools reach the model through its chat template (the worker renders ``tools`` with the
messages; a template that never reads ``tools`` is refused with a 400). What the model writes back
is parsed in the Hermes format, the one the chat templates of Qwen2.5, Qwen3, Hermes and SmolLM3
teach (vLLM's ``--tool-call-parser hermes``)::

    optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. Semantics of ``tool_choice``:

=================================  =========================================================
``"none"``                         tools rendered, the output is text (never parsed)
``"auto"`` (the default)           tools rendered; blocks the model writes become tool_calls
``"required"``                     the output is constrained to one or more calls of the tools
                                   (exactly one with ``parallel_tool_calls: false``)
``{"type": "function",             the output is constrained to one call of that function, its
"function": {"name": N}}``         arguments valid against the function's ``parameters``
=================================  =========================================================

A constrained call is a grammar (llguidance's Lark with the call's JSON schema embedded), so it
shares a batch with free requests like any structured output (docs/gateway-api.md).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lorastream.core.errors import InvalidArgument
from lorastream.core.structured import StructuredKind, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NO_WHITESPACE = {"whitespace_flexible": False}  # compact JSON, as structured outputs write it


def check_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tools`` as OpenAI defines them: function tools with a name and a JSON schema."""
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"tools[{i}]: only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"tools[{i}].function is required: {{'name': ..., 'parameters': ...}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name is required (a string)")
        if name in names:
            raise ValueError(f"tools[{i}]: the function name {name!r} is given twice")
        names.add(name)
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def check_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return choice
    raise ValueError(
        "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
    )


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for."""

    tools: tuple[dict[str, Any], ...] = ()
    choice: str | dict[str, Any] | None = None
    parallel: bool = True

    @property
    def rendered(self) -> str:
        """The tools as the worker's chat template receives them (JSON; "" for none)."""
        return json.dumps(list(self.tools)) if self.tools else ""

    @property
    def parses(self) -> bool:
        """True when the output's tool-call blocks become ``tool_calls``."""
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> StructuredOutput | None:
        """The grammar of a forced call (``required`` or a named function), else None."""
        if not self.tools or self.choice in (None, "none", "auto"):
            return None
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        if isinstance(self.choice, dict):
            name = self.choice["function"]["name"]
            if name not in functions:
                raise InvalidArgument(
                    f"tool_choice: the function {name!r} is not among the tools "
                    f"({', '.join(functions)})"
                )
            calls, repeat = [functions[name]], False
        else:  # required
            calls, repeat = list(functions.values()), self.parallel
        body = "|".join(f"call_{i}" for i in range(len(calls)))
        more = ' ("\\n" call)*' if repeat else ""
        rules = [f"start: call{more}", f'call: "{OPEN}\\n" ({body}) "\\n{CLOSE}"']
        rules += [f"call_{i}: %json {json.dumps(_call_schema(f))}" for i, f in enumerate(calls)]
        return StructuredOutput(StructuredKind.GRAMMAR, "\n".join(rules) + "\n", "tool_choice")


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one Hermes call block's body for ``function``."""
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": _NO_WHITESPACE,
    }


def _call(body: str) -> dict[str, Any] | None:
    """An OpenAI ``tool_calls`` entry from one block's JSON, or None if it is not a call."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": parsed["name"], "arguments": json.dumps(arguments)},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a whole output.

    Content is the text before the first block (None when only blanks); a block whose JSON is
    not a call, or an unclosed one at the end, leaves the whole text as content and no calls (as
    vLLM's hermes parser does), so nothing the model wrote is lost.
    """
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls, rest = [], text[start:]
    while rest.strip():
        rest = rest.lstrip()
        end = rest.find(CLOSE)
        if not rest.startswith(OPEN) or end < 0:
            return text, []
        call = _call(rest[len(OPEN):end].strip())
        if call is None:
            return text, []
        calls.append(call)
        rest = rest[end + len(CLOSE):]
    content = text[:start]
    return (content if content.strip() else None), calls


@dataclass
class ToolCallStream:
    """One streamed choice's text through the parser: content as it comes, calls at the end.

    ``feed`` returns the content that is certainly not part of a call: everything before a
    ``<tool_call>``, holding back a tail that may be the start of one. From the first block on,
    the text is held; ``finish`` parses the whole output and returns what is left to send.
    """

    text: str = ""
    sent: int = 0  # characters of ``text`` already sent as content
    calling: bool = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.calling:
            return ""
        start = self.text.find(OPEN, self.sent)
        if start >= 0:
            self.calling = True
            return self._send(start)
        return self._send(len(self.text) - _partial_open(self.text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not sent yet, tool calls) once the choice ended."""
        _, calls = parse_tool_calls(self.text)
        return self._send(self.text.find(OPEN) if calls else len(self.text)), calls

    def _send(self, upto: int) -> str:
        piece = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return piece


def _partial_open(text: str) -> int:
    """Length of the longest tail of ``text`` that begins ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
