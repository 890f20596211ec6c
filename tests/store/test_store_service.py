"""The adapter store over real gRPC on loopback: operator API, streaming, resume, auth, errors."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from lorastream.core import errors
from lorastream.core.store_client import BytesSink, StoreClient
from lorastream.store.config import StoreSettings
from lorastream.store.server import create_server
from tests.support.models import ALL_LINEAR, ATTENTION, make_peft_adapter, make_tiny_llama

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = make_tiny_llama(root / "base")
    return {
        "attn-r4": make_peft_adapter(base, root / "attn-r4", rank=4, targets=ATTENTION),
        "all-r16": make_peft_adapter(base, root / "all-r16", rank=16, targets=ALL_LINEAR, seed=2),
    }


class Running:
    """A store server on port 0 that a test can stop and restart on the same port."""

    def __init__(self, cache_dir: Path, token: str | None = None, port: int = 0) -> None:
        self.settings = StoreSettings(port=port, cache_dir=cache_dir, token=token)
        self.server, self.port, self.store = create_server(self.settings)
        self.server.start()
        self.target = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None).wait()


@pytest.fixture
def server(tmp_path: Path):
    running = Running(tmp_path / "cache")
    yield running
    running.stop()


def _preload(client: StoreClient, uri: Path | str, name: str, **kw: bool):
    events = list(client.preload(str(uri), name, **kw))
    return events


def test_preload_reports_phases_and_ends_with_the_manifest(server: Running, adapters) -> None:
    with StoreClient(server.target) as client:
        events = _preload(client, adapters["attn-r4"], "attn")
    phases = [e.phase for e in events]
    assert phases[-1] == "done"
    assert "validating" in phases
    manifest = events[-1].manifest
    assert manifest is not None and manifest.name == "attn" and manifest.rank == 4
    assert set(manifest.target_modules) == set(ATTENTION)
    assert len(manifest.adapter_id) == 64


def test_stream_lands_tensors_equal_to_the_source(server: Running, adapters) -> None:
    with StoreClient(server.target) as client:
        _preload(client, adapters["all-r16"], "all")
        sink = BytesSink()
        manifest = client.stream_tensors("all", sink, chunk_bytes=4096)
    original = load_file(str(adapters["all-r16"] / "adapter_model.safetensors"))
    assert [t.name for t in manifest.tensors] == sorted(original) or set(
        t.name for t in manifest.tensors
    ) == set(original)
    for info, buf in zip(manifest.tensors, sink.buffers, strict=True):
        assert bytes(buf) == original[info.name].numpy().tobytes()


def test_operator_calls_list_describe_pin_unpin_delete(server: Running, adapters) -> None:
    with StoreClient(server.target) as client:
        _preload(client, adapters["attn-r4"], "a")
        _preload(client, adapters["all-r16"], "b", pin=True)
        listed, used, budget = client.list()
        assert {m.name for m in listed} == {"a", "b"}
        assert 0 < used <= budget
        assert client.describe("b").pinned
        assert not client.unpin("b").pinned
        assert client.pin("a").pinned
        client.delete("a")
        with pytest.raises(errors.AdapterNotFound):
            client.describe("a")
        assert [m.name for m in client.list()[0]] == ["b"]


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda c: c.describe("nope"), errors.AdapterNotFound),
        (lambda c: list(c.preload("ftp://x/y", "n")), errors.InvalidArgument),
        (lambda c: list(c.preload(f"{tempfile.gettempdir()}/does/not/exist", "n")),
         errors.AdapterNotFound),
        (lambda c: list(c.preload("/tmp", "../escape")), errors.InvalidArgument),
        (lambda c: c.delete("nope"), errors.AdapterNotFound),
        (lambda c: c.stream_tensors("nope", BytesSink()), errors.AdapterNotFound),
    ],
)
def test_errors_map_to_status_codes_and_the_store_keeps_serving(
    server: Running, adapters, call, expected
) -> None:
    with StoreClient(server.target) as client:
        with pytest.raises(expected) as info:
            call(client)
        assert str(info.value)  # a message that says what is wrong
        _preload(client, adapters["attn-r4"], "still-works")
        assert client.describe("still-works").rank == 4


def test_bearer_token_guards_operator_and_read_calls(tmp_path: Path, adapters) -> None:
    running = Running(tmp_path / "cache", token=TOKEN)
    try:
        with StoreClient(running.target) as anonymous:
            with pytest.raises(errors.Unauthenticated, match="token"):
                _preload(anonymous, adapters["attn-r4"], "x")
        with StoreClient(running.target, token="wrong") as wrong:
            with pytest.raises(errors.Unauthenticated, match="wrong"):
                wrong.pin("x")
        with StoreClient(running.target, token=TOKEN) as operator:
            _preload(operator, adapters["attn-r4"], "x")
        with StoreClient(running.target, token=TOKEN) as operator:  # operate may read
            assert operator.describe("x").rank == 4
            assert operator.stream_tensors("x", BytesSink()).name == "x"
        with StoreClient(running.target) as anonymous:  # a store with a token: reads need one
            with pytest.raises(errors.Unauthenticated, match="scope 'read'"):
                anonymous.describe("x")
    finally:
        running.stop()


def test_health_and_reflection_are_served(server: Running) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "lorastream.adapter_store.v1.AdapterStoreService" in names


class _StopAfter(BytesSink):
    """A sink that stops the store once after ``n`` writes, then lets the client resume."""

    def __init__(self, n: int, on_trigger) -> None:
        super().__init__()
        self.n, self.on_trigger, self.writes = n, on_trigger, []

    def write(self, tensor_index: int, offset: int, data: bytes) -> None:
        super().write(tensor_index, offset, data)
        self.writes.append((tensor_index, offset))
        if len(self.writes) == self.n:
            self.on_trigger()


def test_stream_resumes_from_the_last_verified_offset_after_the_store_restarts(
    tmp_path: Path, adapters
) -> None:
    first = Running(tmp_path / "cache")
    with StoreClient(first.target) as client:
        _preload(client, adapters["all-r16"], "all")
    holder: dict[str, Running] = {}

    def restart() -> None:
        first.stop()
        # Bring the store back on the same port, with the same cache, a moment later.
        timer = threading.Timer(
            0.3, lambda: holder.setdefault("second", Running(tmp_path / "cache", port=first.port))
        )
        timer.start()

    sink = _StopAfter(5, restart)
    try:
        with StoreClient(first.target) as client:
            manifest = client.stream_tensors("all", sink, chunk_bytes=1024, retry_backoff=0.2)
    finally:
        if "second" in holder:
            holder["second"].stop()
    assert "second" in holder, "the store never restarted: the test proved nothing"
    assert len(sink.writes) == len(set(sink.writes)), "a resumed stream re-sent landed bytes"
    original = load_file(str(adapters["all-r16"] / "adapter_model.safetensors"))
    for info, buf in zip(manifest.tensors, sink.buffers, strict=True):
        assert bytes(buf) == original[info.name].numpy().tobytes()


def test_stream_gives_up_with_a_clear_error_when_the_store_stays_dead(
    tmp_path: Path, adapters
) -> None:
    running = Running(tmp_path / "cache")
    with StoreClient(running.target) as client:
        _preload(client, adapters["all-r16"], "all")
        sink = _StopAfter(3, running.stop)
        with pytest.raises(errors.SourceUnavailable, match="gave up"):
            client.stream_tensors("all", sink, chunk_bytes=1024, max_retries=2, retry_backoff=0.05)
