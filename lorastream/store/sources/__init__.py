"""Adapter sources: one class per location kind behind :class:`AdapterSource`.

:class:`SourceRegistry` picks the source for a URI by its scheme. The S3 and Hub sources are wired
in by the store's configuration; importing this package imports neither boto3 nor huggingface_hub.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from lorastream.core.errors import InvalidArgument
from lorastream.store.sources.base import AdapterSource


def _describe(scheme: str) -> str:
    return f"{scheme}://" if scheme else "plain absolute paths"


class SourceRegistry:
    """Scheme -> source. A plain path has the empty scheme."""

    def __init__(self, sources: list[AdapterSource]) -> None:
        self._by_scheme: dict[str, AdapterSource] = {}
        for source in sources:
            for scheme in source.schemes:
                if scheme in self._by_scheme:
                    raise ValueError(f"two sources claim the URI scheme {scheme!r}")
                self._by_scheme[scheme] = source

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(sorted(self._by_scheme))

    def for_uri(self, uri: str) -> AdapterSource:
        """The source for ``uri``; InvalidArgument naming the supported schemes otherwise."""
        if not uri or not uri.strip():
            raise InvalidArgument("the adapter source URI is empty")
        scheme = urlsplit(uri).scheme.lower()
        source = self._by_scheme.get(scheme)
        if source is None:
            supported = ", ".join(_describe(s) for s in self.schemes) or "none configured"
            what = f"URI scheme {scheme!r}" if scheme else "plain paths"
            raise InvalidArgument(f"{uri}: {what} not supported; supported: {supported}")
        return source


__all__ = ["AdapterSource", "SourceRegistry"]
