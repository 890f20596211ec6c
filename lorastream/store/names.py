"""Adapter names: the syntax the store accepts for a name (checked before any lookup or change).

A name is ``/``-separated segments of letters, digits, ``.``, ``_`` and ``-`` (``acme/support-v2``),
at most 128 characters, with no ``.`` or ``..`` segment; ``@`` is never part of one, so
``name@<content-id prefix>`` splits unambiguously (``lorastream.core.versions``).
"""

from __future__ import annotations

import re

from lorastream.core.errors import InvalidArgument

__all__ = ["MAX_NAME_LENGTH", "validate_name"]

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")


def validate_name(name: str) -> str:
    """Adapter names: ``/``-separated segments of letters, digits, ``.``, ``_``, ``-``."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument("adapter name is empty")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(f"adapter name is {len(name)} characters; at most {MAX_NAME_LENGTH}")
    if not _NAME.fullmatch(name) or any(set(seg) == {"."} for seg in name.split("/")):
        raise InvalidArgument(
            f"invalid adapter name {name!r}: use segments of letters, digits, '.', '_', '-' "
            "separated by '/', with no leading '/' and no '.' or '..' segments"
        )
    return name
