"""The store's Prometheus metrics, scraped over HTTP from a real store server: staged count and
bytes, fetches per source (local, s3, hf, push), cache hits and misses, evictions, stream bytes."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lorastream.core.errors import InvalidArgument
from lorastream.core.store_client import BytesSink, StoreClient
from lorastream.store.config import StoreSettings
from lorastream.store.metrics import source_of
from lorastream.store.server import build_store, create_server
from tests.store.sources.test_hub import adapter_files
from tests.support.hub_server import HubServer
from tests.support.models import make_peft_adapter
from tests.support.s3_server import MotoS3Server, upload_dir

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """GET /metrics and parse it with Prometheus' own text parser."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class Store:
    """A store server on port 0 and its metrics server on another port 0."""

    def __init__(self, settings: StoreSettings) -> None:
        self.server, port, self.core = create_server(settings)
        self.server.start()
        self.target = f"127.0.0.1:{port}"
        self.metrics_port = self.core.metrics.serve(0)

    def scrape(self) -> Samples:
        return scrape(self.metrics_port)


@pytest.fixture
def store(
    tmp_path: Path, moto_s3: MotoS3Server, hub_server: HubServer, aws_env: None, hf_env: None
) -> Iterator[Store]:
    running = Store(StoreSettings(
        port=0, cache_dir=tmp_path / "cache", s3_endpoint_url=moto_s3.endpoint_url,
        hf_endpoint=hub_server.url,
    ))
    yield running
    running.server.stop(grace=None).wait()


@pytest.mark.parametrize("source", ["local", "s3", "hf", "push"])
def test_a_fetch_is_timed_and_counted_under_its_source_and_a_second_preload_is_a_hit(
    store: Store, source: str, peft_dirs: dict[str, Path], moto_s3: MotoS3Server,
    hub_server: HubServer, bucket: str,
) -> None:
    adapter = peft_dirs["r4"]
    before = store.scrape()
    with StoreClient(store.target) as client:
        if source == "push":
            client.push(adapter, "a")
        else:
            uri = {
                "local": lambda: str(adapter),
                "s3": lambda: (upload_dir(moto_s3.client(), adapter, bucket, "a"),
                               f"s3://{bucket}/a")[1],
                "hf": lambda: (hub_server.publish(repo := f"org/a-{uuid.uuid4().hex[:8]}",
                                                  adapter_files(adapter)), f"hf://{repo}")[1],
            }[source]()
            list(client.preload(uri, "a"))
            list(client.preload(uri, "a"))  # already staged from this URI: a cache hit
    after = store.scrape()

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("lorastream_store_fetch_seconds_count", source=source) == 1
    assert grew("lorastream_store_fetch_seconds_sum", source=source) > 0
    # as staged: the adapter's two files and the manifest written beside them
    assert grew("lorastream_store_fetched_bytes_total", source=source) == store.core.bytes_used
    for other in {"local", "s3", "hf", "push"} - {source}:
        assert grew("lorastream_store_fetch_seconds_count", source=other) == 0
    preloads = 0 if source == "push" else 1
    assert grew("lorastream_store_cache_misses_total") == preloads
    assert grew("lorastream_store_cache_hits_total") == preloads
    assert value(after, "lorastream_store_adapters_staged") == 1
    assert value(after, "lorastream_store_adapter_names") == 1
    assert value(after, "lorastream_store_staged_bytes") == store.core.bytes_used > 0
    assert value(after, "lorastream_store_cache_budget_bytes") == store.core.bytes_budget


def test_stream_bytes_are_the_tensor_bytes_sent_and_each_stream_counts_once(
    store: Store, peft_dirs: dict[str, Path]
) -> None:
    with StoreClient(store.target) as client:
        list(client.preload(str(peft_dirs["r8"]), "a"))
        list(client.preload(str(peft_dirs["r8"]), "b"))  # same files: one content, two names
        manifest = client.stream_tensors("a", BytesSink(), chunk_bytes=4096)
        client.stream_tensors("b", BytesSink())
    samples = store.scrape()
    assert value(samples, "lorastream_store_streams_total") == 2
    assert value(samples, "lorastream_store_stream_bytes_total") == 2 * manifest.total_bytes
    assert value(samples, "lorastream_store_adapters_staged") == 1
    assert value(samples, "lorastream_store_adapter_names") == 2


def test_evictions_count_the_contents_and_bytes_evicted_to_make_room(
    tmp_path: Path, peft_dirs: dict[str, Path]
) -> None:
    base = peft_dirs["r4"].parent / "base"
    first, second = (make_peft_adapter(base, tmp_path / f"a{seed}", rank=4, seed=seed,
                                       targets=["q_proj", "v_proj"]) for seed in (1, 2))
    scratch = build_store(StoreSettings(cache_dir=tmp_path / "scratch"))
    scratch.preload(str(first), "probe")
    one = scratch.bytes_used  # either adapter, staged: same shapes, about the same size
    running = Store(StoreSettings(port=0, cache_dir=tmp_path / "cache", cache_bytes=one * 3 // 2))
    try:
        with StoreClient(running.target) as client:
            list(client.preload(str(first), "first"))
            first_bytes = running.core.bytes_used
            list(client.preload(str(second), "second"))  # room for one: "first" goes
        samples = running.scrape()
    finally:
        running.server.stop(grace=None).wait()
    assert value(samples, "lorastream_store_evictions_total") == 1
    assert value(samples, "lorastream_store_evicted_bytes_total") == first_bytes
    assert value(samples, "lorastream_store_adapters_staged") == 1
    assert value(samples, "lorastream_store_staged_bytes") == running.core.bytes_used


def test_a_fetch_that_stages_nothing_counts_as_a_failure_of_its_source(
    store: Store, tmp_path: Path, peft_dirs: dict[str, Path]
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    config = "adapter_config.json"
    (broken / config).write_bytes((peft_dirs["r4"] / config).read_bytes())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with StoreClient(store.target) as client, pytest.raises(InvalidArgument, match="safetensors"):
        list(client.preload(str(broken), "broken"))
    samples = store.scrape()
    assert value(samples, "lorastream_store_fetch_failures_total", source="local") == 1
    assert value(samples, "lorastream_store_fetch_seconds_count", source="local") == 0
    assert value(samples, "lorastream_store_adapters_staged") == 0


@pytest.mark.parametrize(
    ("uri", "source"),
    [("s3://b/k", "s3"), ("hf://org/r@main", "hf"), ("/abs/path", "local"),
     ("file:///abs/path", "local"), ("push://name", "push")],
)
def test_the_source_label_is_the_uri_scheme(uri: str, source: str) -> None:
    assert source_of(uri) == source


def test_a_metrics_port_in_use_is_refused_with_the_flag_to_change(store: Store) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(InvalidArgument, match="--metrics-port"):
            store.core.metrics.serve(taken.getsockname()[1])
