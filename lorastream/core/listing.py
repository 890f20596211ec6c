"""Which adapters a listing returns, and in what pages: shared by the store, its client and CLI."""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAGE_SIZE = 1000
"""The most adapters one ListAdapters reply carries (a larger page_size is capped to it)."""


@dataclass(frozen=True)
class AdapterFilter:
    """Narrows a listing; the default lists every adapter."""

    prefix: str = ""  # names starting with this
    pinned: bool | None = None  # only pinned (True) or only unpinned (False) adapters
    source_prefix: str = ""  # source URIs starting with this (``s3://``, ``hf://org/``)
