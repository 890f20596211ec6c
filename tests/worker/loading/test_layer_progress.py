"""Layer-ordered landing: as a store fetch lands an adapter's tensors, verified,
in layer order, the fetch reports how many leading layers are whole -- through the fetch process
and in the worker alike -- and the adapter's entry follows it. A damaged tensor stops the count
before its layer; a store that dies mid-stream is resumed and the count goes on.

``LayerProgress`` against hand-made manifests; the rest against a real store on loopback and a
real PEFT adapter of a 12-layer tiny Llama (its layers 10 and 11 sort before 2 by name).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorastream.core.adapter_format import WEIGHTS_FILE, parse_lora_key
from lorastream.core.errors import InvalidAdapter, LorastreamError
from lorastream.core.manifest import AdapterManifest, TensorInfo
from lorastream.worker.device.device import Device
from lorastream.worker.loading.adapter import AdapterEntry, AdapterWeights
from lorastream.worker.loading.device_tier import AdmissionCostModel
from lorastream.worker.loading.fetch import (
    AdapterFetcher,
    FetchProcess,
    HostLoader,
    SharedHostMemory,
)
from lorastream.worker.loading.host import HostAdapterBuffer, HostTier
from lorastream.worker.loading.landing import LayerProgress, host_nbytes, manifest_layers
from lorastream.worker.metrics import WorkerMetrics
from lorastream.worker.model.config import ModelConfig
from tests.store.test_fast_verify import _flip_byte
from tests.support.models import ALL_LINEAR, make_peft_adapter, make_tiny_llama
from tests.worker.conftest import StoreStack, staged_store

LAYERS = 12
HOST_BYTES = 4 << 20


# -- LayerProgress ----------------------------------------------------------------------------
def _name(layer: int, module: str = "q_proj", ab: str = "A") -> str:
    group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{group}.{module}.lora_{ab}.weight"


def _manifest(tensors: list[tuple[str, int]]) -> AdapterManifest:
    return AdapterManifest(
        adapter_id="0" * 64, name="a", source_uri="", revision="", base_model="", rank=1,
        alpha=1.0, use_rslora=False, target_modules=(),
        tensors=tuple(TensorInfo(n, "F32", (nbytes // 4,), nbytes, "") for n, nbytes in tensors),
    )


def _pairs(layers: list[int]) -> list[tuple[str, int]]:
    """q_proj's A and B of each of ``layers``, in that order."""
    return [(_name(layer, ab=ab), 16) for layer in layers for ab in "AB"]


_LEXICOGRAPHIC = sorted(range(LAYERS), key=str)  # 0, 1, 10, 11, 2, ..., 9: an old manifest
_NO_LAYER = ("base_model.model.lm_head.lora_A.weight", 16)

# (tensors, order of verify calls, what each call returns)
PROGRESS_CASES = {
    "in-order": (_pairs([0, 1, 2]), [0, 1, 2, 3, 4, 5], [None, 1, None, 2, None, 3]),
    "lexicographic-manifest": (
        [(_name(layer), 16) for layer in _LEXICOGRAPHIC],
        list(range(LAYERS)),
        [1, 2, None, None, 3, 4, 5, 6, 7, 8, 9, 12],  # 10 and 11 wait for 2..9
    ),
    "out-of-order-verifies": (_pairs([0, 1]), [3, 2, 1, 0], [None, None, None, 2]),
    "layers-missing-from-the-adapter": (  # layers 1 and 3 have no tensors: complete at once
        _pairs([0, 2, 4]), [0, 1, 2, 3, 4, 5], [None, 2, None, 4, None, 5],
    ),
    "tensor-without-a-layer-last": (
        [*_pairs([0, 1]), _NO_LAYER], [0, 1, 2, 3, 4], [None, 1, None, None, 2],
    ),
    "tensor-without-a-layer-first": (
        [_NO_LAYER, *_pairs([0, 1])], [0, 1, 2, 3, 4], [None, None, 1, None, 2],
    ),
    "duplicate-verify": (
        _pairs([0, 1]), [0, 1, 1, 0, 2, 3, 3], [None, 1, None, None, None, 2, None],
    ),
    "empty-tensor-needs-no-verify": (
        [(_name(0), 16), (_name(0, ab="B"), 0), *_pairs([1])], [0, 2, 3], [1, None, 2],
    ),
}


@pytest.mark.parametrize(("tensors", "order", "expected"), PROGRESS_CASES.values(),
                         ids=PROGRESS_CASES.keys())
def test_layer_progress_reports_each_growth_of_the_leading_complete_layers(
    tensors: list[tuple[str, int]], order: list[int], expected: list[int | None]
) -> None:
    manifest = _manifest(tensors)
    progress = LayerProgress(manifest)
    assert progress.landed == 0
    assert [progress.verified(i) for i in order] == expected
    assert progress.landed == manifest_layers(manifest)


@pytest.mark.parametrize(
    ("tensors", "layers"),
    [(_pairs([0, 1, 2]), 3), (_pairs([4]), 5), ([_NO_LAYER], 0), ([], 0), (_pairs([2, 0]), 3)],
)
def test_the_manifest_counts_its_layers_up_to_the_highest_one_named(
    tensors: list[tuple[str, int]], layers: int
) -> None:
    assert manifest_layers(_manifest(tensors)) == layers


# -- through the fetch paths, from a real store -----------------------------------------------
@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base checkpoint, PEFT adapter of every projection): 12 layers, 168 tensors, 384 KiB."""
    root = tmp_path_factory.mktemp("deep")
    base = make_tiny_llama(root / "base", num_hidden_layers=LAYERS)
    return base, make_peft_adapter(base, root / "deep", rank=8, targets=ALL_LINEAR)


@pytest.fixture
def deep_store(deep: tuple[Path, Path], tmp_path: Path) -> Iterator[StoreStack]:
    """A store on loopback with the 12-layer adapter staged as "deep"."""
    yield from staged_store(tmp_path / "store", {"deep": deep[1]})


PATHS = ["fetch-process", "in-process"]
FetcherFactory = Callable[[str], AdapterFetcher]


@pytest.fixture
def open_fetcher(deep_store: StoreStack) -> Iterator[FetcherFactory]:
    """AdapterFetchers on the store: landing through a fetch process, or in this process."""
    opened: list[AdapterFetcher] = []

    def open_(path: str) -> AdapterFetcher:
        device = Device("cpu")
        process = None
        if path == "fetch-process":
            process = FetchProcess(SharedHostMemory(device, HOST_BYTES), deep_store.target)
        fetcher = AdapterFetcher(device, deep_store.target, process=process)
        fetcher.chunk_bytes = 4096  # chunks span tensors (1-4 KiB each)
        opened.append(fetcher)
        return fetcher

    yield open_
    for fetcher in opened:
        fetcher.close()


def _storage(fetcher: AdapterFetcher, manifest: AdapterManifest) -> torch.Tensor | None:
    """Where the fetch lands: the fetch process's shared memory, else a new allocation."""
    memory = fetcher.landing_memory
    return None if memory is None else memory[: host_nbytes(manifest)]


class _Reports:
    """The counts a fetch reported, and when."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.times: list[float] = []

    def __call__(self, count: int) -> None:
        self.counts.append(count)
        self.times.append(time.perf_counter())


def _assert_source_bytes(buffer: HostAdapterBuffer, adapter: Path) -> None:
    original = load_file(str(adapter / WEIGHTS_FILE))
    landed = buffer.tensors()
    assert set(landed) == set(original)
    for name, tensor in original.items():
        assert torch.equal(landed[name], tensor), name


@pytest.mark.parametrize("path", PATHS)
def test_a_fetch_reports_each_layer_as_it_lands_before_the_fetch_returns(
    open_fetcher: FetcherFactory, deep: tuple[Path, Path], path: str
) -> None:
    fetcher = open_fetcher(path)
    fetcher.chunk_delay_s = 0.005  # 96 chunks of 4 KiB: about 0.5 s, layer by layer
    manifest = fetcher.describe("deep")
    reports = _Reports()
    buffer = fetcher.fetch("deep", manifest.adapter_id, _storage(fetcher, manifest), reports)
    returned = time.perf_counter()
    assert reports.counts == list(range(1, LAYERS + 1))  # one report per layer, in order
    assert buffer.manifest is not None and manifest_layers(buffer.manifest) == LAYERS
    assert reports.times[-1] <= returned
    # Layers 2..12 (11 x 8 chunks, 5 ms each at least) landed after layer 1 was reported.
    assert reports.times[-1] - reports.times[0] > 0.3
    _assert_source_bytes(buffer, deep[1])


def _tensor_of_layer(manifest: AdapterManifest, layer: int, which: str) -> int:
    indices = [i for i, t in enumerate(manifest.tensors)
               if (key := parse_lora_key(t.name)) is not None and key.layer == layer]
    return indices[0] if which == "first" else indices[-1]


@pytest.mark.parametrize(("layer", "which"), [(0, "first"), (5, "first"), (5, "last"),
                                              (11, "last")])
@pytest.mark.parametrize("path", PATHS)
def test_a_damaged_tensor_stops_the_count_before_its_layer_and_fails_the_fetch(
    open_fetcher: FetcherFactory, deep_store: StoreStack, path: str, layer: int, which: str
) -> None:
    fetcher = open_fetcher(path)
    manifest = fetcher.describe("deep")
    _flip_byte(deep_store.cache, manifest, _tensor_of_layer(manifest, layer, which))
    reports = _Reports()
    with pytest.raises(InvalidAdapter, match="mismatch for deep"):
        fetcher.fetch("deep", manifest.adapter_id, _storage(fetcher, manifest), reports)
    assert reports.counts == list(range(1, layer + 1))


@pytest.mark.parametrize("path", PATHS)
def test_a_stream_resumed_after_the_store_died_reports_every_layer_once(
    open_fetcher: FetcherFactory, deep_store: StoreStack, deep: tuple[Path, Path], path: str
) -> None:
    deep_store.restart(chunk_delay_s=0.01)  # a slow store: about 1 s for the adapter
    fetcher = open_fetcher(path)
    manifest = fetcher.describe("deep")
    reports = _Reports()
    result: dict[str, HostAdapterBuffer] = {}

    def fetch() -> None:
        result["buffer"] = fetcher.fetch("deep", manifest.adapter_id, _storage(fetcher, manifest),
                                         reports)

    thread = threading.Thread(target=fetch)
    thread.start()
    deadline = time.monotonic() + 30
    while len(reports.counts) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    deep_store.server.stop(None).wait()  # the store dies mid-stream ...
    stopped_at = len(reports.counts)
    deep_store.restart()  # ... and comes back: the stream resumes where it stopped
    thread.join(timeout=60)
    assert 3 <= stopped_at < LAYERS - 3, "the stream was not cut in the middle"
    assert reports.counts == list(range(1, LAYERS + 1))
    _assert_source_bytes(result["buffer"], deep[1])


def test_a_failing_layers_callback_leaves_the_fetch_process_serving(
    open_fetcher: FetcherFactory, deep: tuple[Path, Path]
) -> None:
    fetcher = open_fetcher("fetch-process")
    process = fetcher.process
    assert process is not None
    manifest = fetcher.describe("deep")
    calls: list[int] = []

    def failing(count: int) -> None:
        calls.append(count)
        raise RuntimeError("a broken listener")

    storage = _storage(fetcher, manifest)
    assert storage is not None
    landed, _ = process.fetch("deep", storage, 4096, 0.0, failing)
    assert landed.adapter_id == manifest.adapter_id
    assert calls == list(range(1, LAYERS + 1))  # each report reached it, the reader lived on
    reports = _Reports()
    buffer = fetcher.fetch("deep", manifest.adapter_id, storage, reports)
    assert reports.counts == list(range(1, LAYERS + 1))
    _assert_source_bytes(buffer, deep[1])


# -- the entry ----------------------------------------------------------------------------------
@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged-layer-5"])
@pytest.mark.parametrize("path", PATHS)
def test_the_entry_follows_the_layers_landed_and_holds_all_or_none_at_the_end(
    open_fetcher: FetcherFactory, deep_store: StoreStack, deep: tuple[Path, Path], path: str,
    damaged: bool,
) -> None:
    fetcher = open_fetcher(path)
    fetcher.chunk_delay_s = 0.005
    manifest = fetcher.describe("deep")
    if damaged:
        _flip_byte(deep_store.cache, manifest, _tensor_of_layer(manifest, 5, "last"))
    metrics = WorkerMetrics()
    changed = threading.Condition(threading.RLock())
    entry = AdapterEntry(manifest.adapter_id, "deep", manifest)
    host = HostTier(Device("cpu"), HOST_BYTES, metrics, fetcher.landing_memory)
    loader = HostLoader(host, fetcher, ModelConfig.from_dir(deep[0]), 8, metrics,
                        AdmissionCostModel())
    seen: list[int] = []  # layers_landed at each notification during the fetch
    done = threading.Event()

    def watch() -> None:
        with changed:
            while not done.is_set():
                changed.wait(0.01)
                if entry.fetching:
                    seen.append(entry.layers_landed)

    watcher = threading.Thread(target=watch)
    watcher.start()

    def on_layers(count: int) -> None:  # as the manager records a fetch's reports
        with changed:
            if entry.land_layers(count):
                changed.notify_all()

    with changed:  # the manager's load path: begin, fetch (without the lock), end
        assert loader.begin([entry], entry)
        storage = host.storage(entry)
    try:
        landed: AdapterWeights | LorastreamError = loader.fetch(entry, storage, on_layers)
    except LorastreamError as err:
        landed = err
    with changed:
        loader.end(entry, landed)
    done.set()
    watcher.join()
    assert seen == sorted(seen)
    if damaged:
        assert isinstance(entry.error, InvalidAdapter)
        assert entry.weights is None and entry.layers_landed == 0
        assert max(seen) <= 5 and max(seen) > 0
    else:
        assert entry.error is None and entry.weights is not None
        assert entry.layers_landed == LAYERS
        assert any(0 < count < LAYERS for count in seen)  # seen while the later layers landed
