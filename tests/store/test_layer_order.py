"""Manifests list an adapter's tensors in layer order, so the store streams layer 0 whole first,
then layer 1, ...: numerically (layer 2 before layer 10), not in the file's lexicographic order.
The file still holds them in its own order: chunks that span tensors read each tensor's range.
Manifests staged before layer order (in file order) still stream, resume and verify.

Real store servers on loopback, a real 12-layer PEFT adapter (layer 10 sorts before layer 2 by
name), a store restart mid-stream.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lorastream.core.adapter_format import WEIGHTS_FILE, parse_lora_key
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import BytesSink, StoreClient
from lorastream.store.staging import MANIFEST_FILE
from tests.store.test_store_service import Running
from tests.support.models import ALL_LINEAR, make_peft_adapter, make_tiny_llama

LAYERS = 12


@pytest.fixture(scope="module")
def deep_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter of every projection of a 12-layer tiny Llama (168 tensors, 384 KiB)."""
    root = tmp_path_factory.mktemp("deep-adapter")
    base = make_tiny_llama(root / "base", num_hidden_layers=LAYERS)
    return make_peft_adapter(base, root / "deep", rank=8, targets=ALL_LINEAR)


def _layers(manifest: AdapterManifest) -> list[int]:
    keys = [parse_lora_key(t.name) for t in manifest.tensors]
    assert all(keys)
    return [key.layer for key in keys if key is not None]


def _stage(cache: Path, adapter: Path, order: str) -> tuple[Running, AdapterManifest]:
    """A running store with ``adapter`` staged as "deep"; ``order="file"``: its manifest.json
    rewritten in file order, as a store from before layer order staged it (then restarted)."""
    running = Running(cache)
    with StoreClient(running.target) as client:
        manifest = list(client.preload(str(adapter), "deep"))[-1].manifest
    assert manifest is not None
    if order == "layer":
        return running, manifest
    running.stop()
    path = cache / "adapters" / manifest.adapter_id / MANIFEST_FILE
    doc = json.loads(path.read_text())
    doc["tensors"].sort(key=lambda t: t["file_offset"])
    path.write_text(json.dumps(doc))
    running = Running(cache)
    with StoreClient(running.target) as client:
        return running, client.describe("deep")


class _RecordingSink(BytesSink):
    """A BytesSink that records its writes and verified tensors, and can run ``on_write`` once
    after ``n`` writes (to stop the store mid-stream)."""

    def __init__(self, n: int = 0, on_write=None) -> None:
        super().__init__()
        self.n, self.on_write = n, on_write
        self.writes: list[tuple[int, int]] = []
        self.verified_tensors: list[int] = []

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        super().write(tensor_index, offset, data)
        self.writes.append((tensor_index, offset))
        if self.on_write is not None and len(self.writes) == self.n:
            self.on_write()

    def verified(self, tensor_index: int) -> None:
        self.verified_tensors.append(tensor_index)


def _assert_landed_whole(manifest: AdapterManifest, sink: _RecordingSink, adapter: Path) -> None:
    original = load_file(str(adapter / WEIGHTS_FILE))
    assert {t.name for t in manifest.tensors} == set(original)
    for info, buf in zip(manifest.tensors, sink.buffers, strict=True):
        assert bytes(buf) == original[info.name].numpy().tobytes(), info.name
    assert sink.verified_tensors == list(range(len(manifest.tensors)))  # each once, in order


def test_a_staged_12_layer_adapter_lists_its_tensors_in_numeric_layer_order(
    tmp_path: Path, deep_adapter: Path
) -> None:
    running, manifest = _stage(tmp_path / "cache", deep_adapter, "layer")
    running.stop()
    layers = _layers(manifest)
    assert layers == sorted(layers)
    assert sorted(set(layers)) == list(range(LAYERS))
    third = [t.name for t, layer in zip(manifest.tensors, layers, strict=True) if layer == 3]
    assert third == sorted(third)  # by name within a layer
    file_order = sorted(load_file(str(deep_adapter / WEIGHTS_FILE)))  # safetensors sorts keys
    assert file_order != [t.name for t in manifest.tensors]  # layers 10, 11 before 2 there


@pytest.mark.parametrize("order", ["layer", "file"])
@pytest.mark.parametrize("chunk_bytes", [1000, 4096, 1 << 20])
def test_either_manifest_order_streams_the_source_bytes_tensor_by_tensor(
    tmp_path: Path, deep_adapter: Path, order: str, chunk_bytes: int
) -> None:
    running, staged = _stage(tmp_path / "cache", deep_adapter, order)
    try:
        sink = _RecordingSink()
        with StoreClient(running.target) as client:
            manifest = client.stream_tensors("deep", sink, chunk_bytes=chunk_bytes)
    finally:
        running.stop()
    assert [t.name for t in manifest.tensors] == [t.name for t in staged.tensors]
    layers = _layers(manifest)
    assert (layers == sorted(layers)) == (order == "layer")  # file order: 10 before 2
    _assert_landed_whole(manifest, sink, deep_adapter)


@pytest.mark.parametrize("order", ["layer", "file"])
def test_a_stream_cut_by_a_store_restart_resumes_and_lands_every_tensor_once(
    tmp_path: Path, deep_adapter: Path, order: str
) -> None:
    """The store stops after the n-th chunk landed and starts again 0.3 s later on the same
    port; the stream resumes from its last verified offset. A run whose stream had already been
    handed over whole (the client's buffers held the rest when the store stopped) proves
    nothing, so it is run again cutting earlier, until the stream outlived the store."""
    for attempt, n in enumerate((40, 10, 2)):
        cache = tmp_path / f"cache-{attempt}"
        first, _ = _stage(cache, deep_adapter, order)
        holder: dict[str, Running] = {}
        timers: list[threading.Timer] = []

        def restart(first: Running = first, cache: Path = cache,
                    holder: dict[str, Running] = holder,
                    timers: list[threading.Timer] = timers) -> None:
            first.stop()
            timer = threading.Timer(
                0.3, lambda: holder.setdefault("second", Running(cache, port=first.port))
            )
            timers.append(timer)
            timer.start()

        sink = _RecordingSink(n=n, on_write=restart)  # 1000-byte chunks
        try:
            with StoreClient(first.target) as client:
                manifest = client.stream_tensors("deep", sink, chunk_bytes=1000,
                                                 retry_backoff=0.2)
            outlived = "second" in holder  # the stream ended only once the store was back
        finally:
            for timer in timers:
                timer.join()
            if "second" in holder:
                holder["second"].stop()
        if outlived:
            break
    assert outlived, "the store's stop never cut the stream: the test proved nothing"
    assert len(sink.writes) == len(set(sink.writes)), "a resumed stream re-sent landed bytes"
    _assert_landed_whole(manifest, sink, deep_adapter)
