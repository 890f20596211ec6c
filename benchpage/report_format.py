"""Figures, goals and tables for the generated benchmark page.

Every number on the page passes through ``number`` (or a wrapper of it): a value missing from a
result, or not finite, prints as an en dash, never as ``None`` or ``nan``."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MISSING = "–"
GOALS_HEADER = ("goal", "result", "target", "verdict")
Result = Mapping[str, Any]  # one benchmark's result JSON
_GOAL = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\s*)?(<=|>=|<|>|==)\s*([-+]?\d+(?:\.\d+)?)\s*$")
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq,
}
_SHOWN = {"<=": "≤", ">=": "≥", "<": "<", ">": ">", "==": "="}


@dataclass(frozen=True)
class Goal:
    """A goal as the result JSONs state it: ``"<= 0.5"`` or ``"store_vs_bare >= 0.8"``."""

    op: str
    threshold: float
    text: str  # the threshold as written in the JSON, e.g. "0.10"

    @classmethod
    def parse(cls, text: object) -> Goal | None:
        match = _GOAL.match(text) if isinstance(text, str) else None
        if match is None:
            return None
        return cls(match.group(1), float(match.group(2)), match.group(2))

    def met(self, value: object) -> bool | None:
        """Whether ``value`` meets the goal; None when it was not measured."""
        v = as_number(value)
        return None if v is None else _OPS[self.op](v, self.threshold)

    def shown(self, percent: bool = False) -> str:
        threshold = f"{self.threshold * 100:g}%" if percent else self.text
        return f"{_SHOWN[self.op]} {threshold}"


def goal_row(label: str, value: object, goal_text: object, *, percent: bool = False,
             digits: int = 2) -> list[str]:
    """``[label, value, goal, verdict]`` for a goals table."""
    goal = Goal.parse(goal_text)
    shown_value = pct(value) if percent else ratio(value, digits)
    if goal is None:
        return [label, shown_value, MISSING, "no goal"]
    return [label, shown_value, goal.shown(percent), verdict(goal.met(value))]


def verdict(met: bool | None) -> str:
    if met is None:
        return "not measured"
    return "met" if met else "**not met**"


def as_number(value: object) -> float | None:
    """``value`` as a float if it is a finite number (bools excluded), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def number(value: object, digits: int = 1, suffix: str = "") -> str:
    v = as_number(value)
    return MISSING if v is None else f"{v:,.{digits}f}{suffix}"


def ms(value: object) -> str:
    return number(value, 1)


def ratio(value: object, digits: int = 2) -> str:
    return number(value, digits, "×")


def pct(value: object) -> str:
    v = as_number(value)
    return MISSING if v is None else f"{v * 100:.1f}%"


def text(value: object) -> str:
    """A non-numeric field (model name, popularity, ...) for prose or a table cell."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    if isinstance(value, list | tuple):
        return ", ".join(text(v) for v in value)
    return str(value)


def get(data: object, *keys: str) -> Any:
    """``data[k1][k2]...`` or None if any level is missing."""
    for key in keys:
        if not isinstance(data, Mapping):
            return None
        data = data.get(key)
    return data


def table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1) -> str:
    """A markdown table; columns from ``numeric_from`` on are right-aligned."""
    align = ["---" if i < numeric_from else "---:" for i in range(len(header))]
    lines = [_row(header), _row(align), *(_row(r) for r in rows)]
    return "\n".join(lines)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def code_block(command: str) -> str:
    return f"```bash\n{command}\n```"


def plot_image(plots: Mapping[str, str], key: str, alt: str) -> str:
    """The markdown image of plot ``key`` if it was drawn, else nothing."""
    return f"![{alt}]({plots[key]})" if key in plots else ""


def paragraphs(parts: Sequence[str]) -> str:
    """The non-empty ``parts``, a blank line apart."""
    return "\n\n".join(p for p in parts if p)
