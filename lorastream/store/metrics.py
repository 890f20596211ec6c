"""The adapter store's Prometheus metrics (its own registry, served on ``--metrics-port``).

Labels in brackets; ``source`` is one of ``s3``, ``hf``, ``local``, ``push`` (the URI's scheme):

- ``lorastream_store_adapters_staged``: gauge, adapter contents on disk (two names with the same
  files are one content)
- ``lorastream_store_adapter_names``: gauge, registered names
- ``lorastream_store_staged_bytes`` / ``lorastream_store_cache_budget_bytes``: gauges, disk bytes
  used by staged adapters and the budget (``--cache-bytes``)
- ``lorastream_store_fetch_seconds`` [source]: histogram, one fetch from the source into the
  cache, validation and hashing included (a preload's download, or a push's upload)
- ``lorastream_store_fetched_bytes_total`` [source]: bytes of adapters fetched, as staged (their
  files and the manifest written beside them)
- ``lorastream_store_fetch_failures_total`` [source]: fetches that staged nothing
- ``lorastream_store_cache_hits_total`` / ``lorastream_store_cache_misses_total``: preloads
  answered from the cache (the name already staged from the same URI) / that waited on a fetch
  (their own, or one in progress they joined)
- ``lorastream_store_evictions_total`` / ``lorastream_store_evicted_bytes_total``: adapter
  contents (and their bytes) evicted to make room
- ``lorastream_store_streams_total``, ``lorastream_store_stream_bytes_total``: weight streams
  opened (``StreamAdapterTensors``) and the tensor bytes they sent

Gauges are read from the store at scrape time; the counters are bumped by small hooks in
:class:`~lorastream.store.store.AdapterStore` and its servicer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lorastream.core.metrics_http import serve_registry
from lorastream.core.upload import PUSH_SCHEME

SOURCES = ("s3", "hf", "local", "push")
_SOURCE_OF_SCHEME = {"s3": "s3", "hf": "hf", "file": "local", "": "local", PUSH_SCHEME: "push"}
_FETCH_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)



class _Sized(Protocol):
    @property
    def size_bytes(self) -> int: ...


S = TypeVar("S", bound=_Sized)


class StoreView(Protocol):
    """What the gauges read from the store at scrape time."""

    @property
    def bytes_used(self) -> int: ...

    @property
    def bytes_budget(self) -> int: ...

    @property
    def staged_count(self) -> int: ...

    def count(self) -> int: ...


def source_of(uri: str) -> str:
    """The ``source`` label of ``uri``: ``s3``, ``hf``, ``local``, ``push``."""
    scheme = urlsplit(uri).scheme.lower()
    return _SOURCE_OF_SCHEME.get(scheme, scheme or "local")


class _StoreCollector(Collector):
    def __init__(self, store: StoreView) -> None:
        self._store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        store = self._store
        yield GaugeMetricFamily(
            "lorastream_store_adapters_staged", "Adapter contents staged on disk.",
            value=store.staged_count,
        )
        yield GaugeMetricFamily(
            "lorastream_store_adapter_names", "Registered adapter names.", value=store.count()
        )
        yield GaugeMetricFamily(
            "lorastream_store_staged_bytes", "Disk bytes of staged adapters.",
            value=store.bytes_used,
        )
        yield GaugeMetricFamily(
            "lorastream_store_cache_budget_bytes", "Disk budget for staged adapters.",
            value=store.bytes_budget,
        )


class StoreMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.fetch_seconds = Histogram(
            "lorastream_store_fetch_seconds",
            "One fetch from a source into the cache, validation and hashing included.",
            ["source"], buckets=_FETCH_SECONDS, registry=r,
        )
        self.fetched_bytes = Counter(
            "lorastream_store_fetched_bytes",
            "Bytes of adapters fetched from a source, as staged (files and manifest).",
            ["source"], registry=r,
        )
        self.fetch_failures = Counter(
            "lorastream_store_fetch_failures", "Fetches that staged nothing.", ["source"],
            registry=r,
        )
        self.cache_hits = Counter(
            "lorastream_store_cache_hits",
            "Preloads answered from the cache (name already staged from the same URI).",
            registry=r,
        )
        self.cache_misses = Counter(
            "lorastream_store_cache_misses", "Preloads that waited on a fetch.", registry=r
        )
        self.evictions = Counter(
            "lorastream_store_evictions", "Adapter contents evicted to make room.", registry=r
        )
        self.evicted_bytes = Counter(
            "lorastream_store_evicted_bytes", "Bytes of adapter contents evicted.", registry=r
        )
        self.streams = Counter(
            "lorastream_store_streams", "Weight streams opened (StreamAdapterTensors).",
            registry=r,
        )
        self.stream_bytes = Counter(
            "lorastream_store_stream_bytes", "Tensor bytes sent by weight streams.", registry=r
        )
        for source in SOURCES:  # export zeros from the start
            self.fetch_seconds.labels(source)
            self.fetched_bytes.labels(source)
            self.fetch_failures.labels(source)

    def watch(self, store: StoreView) -> None:
        """Report ``store``'s staged count, names and bytes at every scrape."""
        self.registry.register(_StoreCollector(store))

    # -- hooks ------------------------------------------------------------------------------
    def preload_requested(self, cached: bool) -> None:
        (self.cache_hits if cached else self.cache_misses).inc()

    def timed_fetch(self, uri: str, fetch: Callable[[], S]) -> S:
        """Run ``fetch()`` (it returns what was fetched, with its ``size_bytes``), recording its
        time and bytes under ``uri``'s source, or a failure if it raises."""
        source = source_of(uri)
        started = time.perf_counter()
        try:
            fetched = fetch()
        except BaseException:
            self.fetch_failures.labels(source).inc()
            raise
        self.fetch_seconds.labels(source).observe(time.perf_counter() - started)
        self.fetched_bytes.labels(source).inc(fetched.size_bytes)
        return fetched

    def evicted(self, sizes: Iterable[int]) -> None:
        """Adapter contents of these sizes were evicted."""
        for size in sizes:
            self.evictions.inc()
            self.evicted_bytes.inc(size)

    def stream_opened(self) -> None:
        self.streams.inc()

    def streamed(self, nbytes: int) -> None:
        self.stream_bytes.inc(nbytes)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP; returns the bound port (``port`` 0 picks one)."""
        return serve_registry(self.registry, port, host)
