"""Whether a text is a JSON document or the start of one: what a JSON-constrained output cut at
``max_tokens`` must be. ``json.loads`` only tells whole from broken; a cut output is neither.

A recursive-descent reader of RFC 8259 that stops without error where the text ends inside a
value (``{"a": [1, tr`` is a prefix) and fails at the first character no JSON could hold there
(``{"a" 1``, ``{"a": [1,]``, ``{}x``).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?((0|[1-9][0-9]*)(\.[0-9]*)?([eE][+-]?[0-9]*)?)?")
_WHITESPACE = " \t\n\r"
_ESCAPES = '"\\/bfnrtu'
_HEX = "0123456789abcdefABCDEF"


class _Ended(Exception):
    """The text ended inside a value: a prefix so far."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def peek(self) -> str:
        self.skip_whitespace()
        if self.at == len(self.text):
            raise _Ended
        return self.text[self.at]

    def skip_whitespace(self) -> None:
        while self.at < len(self.text) and self.text[self.at] in _WHITESPACE:
            self.at += 1

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"expected {char!r} at {self.at}")
        self.at += 1

    def value(self) -> None:
        char = self.peek()
        if char == "{":
            self.sequence("}", member=True)
        elif char == "[":
            self.sequence("]", member=False)
        elif char == '"':
            self.string()
        elif char in "tfn":
            self.literal()
        else:
            self.number()

    def sequence(self, close: str, member: bool) -> None:
        self.at += 1  # the opening bracket
        if self.peek() == close:
            self.at += 1
            return
        while True:
            if member:
                if self.peek() != '"':
                    raise ValueError(f"expected a key at {self.at}")
                self.string()
                self.expect(":")
            self.value()
            if self.peek() == close:
                self.at += 1
                return
            self.expect(",")

    def string(self) -> None:
        self.at += 1  # the opening quote
        while self.at < len(self.text):
            char = self.text[self.at]
            if char == '"':
                self.at += 1
                return
            if char == "\\":
                escape = self.text[self.at + 1 : self.at + 2]
                if escape and escape not in _ESCAPES:
                    raise ValueError(f"bad escape at {self.at}")
                digits = self.text[self.at + 2 : self.at + 6] if escape == "u" else ""
                if any(d not in _HEX for d in digits):
                    raise ValueError(f"bad \\u escape at {self.at}")
                self.at += 2 + len(digits)
                continue
            if ord(char) < 0x20:
                raise ValueError(f"control character in a string at {self.at}")
            self.at += 1
        raise _Ended

    def literal(self) -> None:
        for word in ("true", "false", "null"):
            rest = self.text[self.at : self.at + len(word)]
            if word.startswith(rest) and rest[:1] == word[0]:
                if len(rest) < len(word):
                    raise _Ended
                self.at += len(word)
                return
        raise ValueError(f"bad literal at {self.at}")

    def number(self) -> None:
        whole = _NUMBER.match(self.text, self.at)
        start = _NUMBER_PREFIX.match(self.text, self.at)
        assert start is not None  # the pattern matches the empty string
        if start.end() == len(self.text) and start.end() > self.at:
            raise _Ended  # "-", "1.", "1e": more digits may follow
        if whole is None or whole.end() != start.end():
            raise ValueError(f"bad number at {self.at}")
        self.at = whole.end()


def is_json_prefix(text: str) -> bool:
    """Whether ``text`` is one JSON value (whitespace around it allowed) or a start of one."""
    reader = _Reader(text)
    try:
        reader.value()
    except _Ended:
        return True
    except ValueError:
        return False
    reader.skip_whitespace()
    return reader.at == len(text)
