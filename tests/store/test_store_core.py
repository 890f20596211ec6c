"""AdapterStore without gRPC: staging, streaming and resume, content ids, restart, the disk budget,
concurrency, a full disk, a crash mid-staging and flat memory — all on real files."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from lorastream.bench.synthetic import (
    ALL_LINEAR,
    SMOLLM2_135M,
    BaseShape,
    adapter_nbytes,
    make_synthetic_adapter,
)
from lorastream.core import errors
from lorastream.core.adapter_format import WEIGHTS_FILE
from lorastream.core.checksum import crc32c
from lorastream.core.manifest import PreloadProgress
from lorastream.core.stream_layout import StreamLayout
from tests.store.fixtures_core import (
    CountingLocalSource,
    StoreFactory,
    assert_cache_clean,
    assert_streams_intact,
    copy_adapter,
    stream_all,
)
from tests.support.models import ALORA_INVOCATION

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _variants(src: Path, root: Path, count: int) -> list[str]:
    """``count`` adapters with distinct content and equal sizes (alpha 11.0, 12.0, ...)."""
    return [str(copy_adapter(src, root / f"v{i}", lora_alpha=11.0 + i)) for i in range(count)]


# -- round trip and resume ----------------------------------------------------------------------
@pytest.mark.parametrize("chunk_bytes", [1 << 10, 4 << 10, 1 << 20])
def test_streamed_chunks_reassemble_into_the_original_tensors(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, chunk_bytes: int
) -> None:
    store = store_factory()
    store.preload(str(tiny_adapters["all-r8"]), "all")
    original = load_file(str(tiny_adapters["all-r8"] / WEIGHTS_FILE))
    position = (0, 0)
    with store.open_stream("all") as lease:
        manifest = lease.manifest
        layout = StreamLayout(manifest)
        buffers = [bytearray(t.nbytes) for t in manifest.tensors]
        chunks = list(lease.chunks(chunk_bytes=chunk_bytes))
        for chunk in chunks:
            assert (chunk.tensor_index, chunk.offset) == position  # in order, no gaps
            assert 0 < len(chunk.data) <= chunk_bytes
            assert crc32c(chunk.data) == chunk.crc32c
            for index, offset, piece in layout.split(chunk.tensor_index, chunk.offset, chunk.data):
                buffers[index][offset : offset + len(piece)] = piece
            position = layout.position(
                layout.flat(chunk.tensor_index, chunk.offset) + len(chunk.data)
            )
    assert position == (len(manifest.tensors), 0)
    # Every chunk but the last is full: chunks run across tensor boundaries.
    assert all(len(c.data) == chunk_bytes for c in chunks[:-1])
    assert len(chunks) == -(-layout.total // chunk_bytes)
    assert {t.name for t in manifest.tensors} == set(original)
    for info, data in zip(manifest.tensors, buffers, strict=True):
        assert bytes(data) == original[info.name].numpy().tobytes()
        assert hashlib.sha256(data).hexdigest() == info.checksum
        assert (info.dtype, info.shape) == ("F32", tuple(original[info.name].shape))


@pytest.mark.parametrize(("tensor", "offset"), [(0, 0), (0, 1000), (3, 4), (-1, 8), (-1, 0)])
def test_stream_resumes_from_a_tensor_and_offset(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tensor: int, offset: int
) -> None:
    store = store_factory()
    store.preload(str(tiny_adapters["all-r8"]), "all")
    manifest, full = stream_all(store, "all")
    tensor %= len(manifest.tensors)
    with store.open_stream("all", manifest.adapter_id) as lease:
        chunks = list(lease.chunks(tensor, offset, chunk_bytes=1000))
    assert (chunks[0].tensor_index, chunks[0].offset) == (tensor, offset)
    layout = StreamLayout(manifest)
    resumed: dict[int, bytearray] = {}
    for chunk in chunks:
        for index, _offset, piece in layout.split(chunk.tensor_index, chunk.offset, chunk.data):
            resumed.setdefault(index, bytearray()).extend(piece)
    assert bytes(resumed.pop(tensor)) == full[tensor][offset:]
    assert sorted(resumed) == list(range(tensor + 1, len(full)))
    for index, data in resumed.items():
        assert bytes(data) == full[index]


@pytest.mark.parametrize(
    ("tensor", "offset", "chunk_bytes", "message"),
    [
        (-1, 0, 1024, "start_tensor"),
        (10_000, 0, 1024, "start_tensor"),
        (0, -1, 1024, "start_offset"),
        (0, "nbytes", 1024, "start_offset"),  # one past the last byte of tensor 0
        ("end", 4, 1024, "start_offset"),
        (0, 0, 0, "chunk_bytes"),
        (0, 0, 64 << 20, "chunk_bytes"),
    ],
)
def test_out_of_range_resume_points_are_invalid_arguments(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory,
    tensor: int | str, offset: int | str, chunk_bytes: int, message: str,
) -> None:
    store = store_factory()
    manifest = store.preload(str(tiny_adapters["all-r8"]), "all")
    start = len(manifest.tensors) if tensor == "end" else tensor
    start_offset = manifest.tensors[0].nbytes if offset == "nbytes" else offset
    with store.open_stream("all") as lease:
        with pytest.raises(errors.InvalidArgument, match=message):
            lease.chunks(start, start_offset, chunk_bytes)  # type: ignore[arg-type]  # a bad value on purpose


# -- identity, operator calls, progress ----------------------------------------------------------
def test_content_id_is_stable_and_two_names_with_the_same_files_share_one_copy(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tmp_path: Path, cache: Path
) -> None:
    store = store_factory()
    one = store.preload(str(tiny_adapters["attn-r4"]), "one")
    size = store.bytes_used
    two = store.preload(str(copy_adapter(tiny_adapters["attn-r4"], tmp_path / "copy")), "two")
    other = store.preload(str(_variants(tiny_adapters["attn-r4"], tmp_path, 1)[0]), "other")
    assert one.adapter_id == two.adapter_id != other.adapter_id
    assert len(os.listdir(cache / "adapters")) == 2
    assert store.bytes_used < 2 * size + size // 2  # the shared copy is counted once
    store.delete("one")
    assert_streams_intact(store, "two")
    fresh = store_factory(cache_dir=tmp_path / "elsewhere")
    assert fresh.preload(str(tiny_adapters["attn-r4"]), "again").adapter_id == one.adapter_id
    assert_cache_clean(store, cache)


def test_operator_calls_pin_unpin_describe_list_delete(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, cache: Path
) -> None:
    store = store_factory()
    store.preload(str(tiny_adapters["attn-r4"]), "b")
    store.preload(str(tiny_adapters["mlp-r16"]), "a", pin=True)
    assert [m.name for m in store.list()] == ["a", "b"]
    described = store.describe("a")
    assert described.pinned and described.use_rslora and described.rank == 16
    assert described.scaling == pytest.approx(16.0 / 4.0)
    assert not store.unpin("a").pinned and store.pin("b").pinned
    assert store.describe("b").pinned and not store.describe("a").pinned
    assert 0 < store.bytes_used <= store.bytes_budget
    store.delete("a")
    for call in (store.describe, store.delete, store.pin, store.unpin, store.open_stream):
        with pytest.raises(errors.AdapterNotFound, match="'a'"):
            call("a")
    assert_cache_clean(store, cache)


def test_preload_reports_every_phase_and_ends_with_the_manifest(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory
) -> None:
    events: list[PreloadProgress] = []
    manifest = store_factory().preload(str(tiny_adapters["all-r8"]), "all", progress=events.append)
    phases = [e.phase for e in events]
    assert phases[0] == "resolving" and phases[-1] == "done"
    assert phases.index("downloading") < phases.index("validating") < phases.index("staging")
    downloads = [e for e in events if e.phase == "downloading"]
    files = sum(p.stat().st_size for p in tiny_adapters["all-r8"].iterdir() if p.suffix != ".md")
    assert downloads[-1].bytes_done == downloads[-1].bytes_total == files
    assert events[-1].manifest == manifest


def test_same_name_and_uri_reuses_the_staged_adapter_unless_forced(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tmp_path: Path
) -> None:
    source = CountingLocalSource()
    store = store_factory(source=source)
    uri = str(tiny_adapters["attn-r4"])
    first = store.preload(uri, "x")
    again = store.preload(uri, "x", pin=True)
    assert source.downloads == 1 and again.adapter_id == first.adapter_id and again.pinned
    store.preload(uri, "x", force=True)
    assert source.downloads == 2 and store.describe("x").pinned  # force keeps the pin
    with pytest.raises(errors.AlreadyExists, match="force"):
        store.preload(str(tiny_adapters["mlp-r16"]), "x")
    assert store.preload(str(tiny_adapters["mlp-r16"]), "x", force=True).rank == 16


def test_stream_with_a_stale_adapter_id_is_refused_after_the_name_was_replaced(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, cache: Path
) -> None:
    store = store_factory()
    old = store.preload(str(tiny_adapters["attn-r4"]), "x")
    lease = store.open_stream("x", old.adapter_id)
    new = store.preload(str(tiny_adapters["all-r8"]), "x", force=True)
    with pytest.raises(errors.Conflict, match="replaced"):
        store.open_stream("x", old.adapter_id)
    with store.open_stream("x", new.adapter_id) as current:
        assert current.manifest.rank == 8
    assert len(list(lease.chunks())) > 0  # the old content outlives the replacement for its lease
    lease.close()
    assert_cache_clean(store, cache)


# -- restart ---------------------------------------------------------------------------------
def test_a_new_store_on_the_same_cache_dir_keeps_the_registry(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, cache: Path
) -> None:
    first = store_factory()
    first.preload(str(tiny_adapters["attn-r4"]), "a", pin=True)
    first.preload(f"file://{tiny_adapters['all-r8']}", "org/b")
    first.preload(str(tiny_adapters["alora-attn-r4"]), "c")
    assert_streams_intact(first, "org/b")
    before = first.list()
    assert [m.alora_invocation_tokens for m in before] == [(), tuple(ALORA_INVOCATION), ()]
    (cache / "tmp" / "stage-crashed").mkdir()  # what a crash mid-download leaves
    (cache / "tmp" / "stage-crashed" / WEIGHTS_FILE).write_bytes(b"half")
    second = store_factory()
    assert second.list() == before
    assert_cache_clean(second, cache)
    for m in before:
        assert_streams_intact(second, m.name)
    second.delete("a")
    assert [m.name for m in store_factory().list()] == ["c", "org/b"]


def test_startup_drops_names_whose_files_vanished_and_files_no_name_uses(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, cache: Path
) -> None:
    store = store_factory()
    gone = store.preload(str(tiny_adapters["attn-r4"]), "gone")
    store.preload(str(tiny_adapters["mlp-r16"]), "kept")
    (cache / "adapters" / gone.adapter_id).rename(cache / "moved-away")
    (cache / "adapters" / ("f" * 64)).mkdir()  # an orphan without a readable manifest
    restarted = store_factory()
    assert [m.name for m in restarted.list()] == ["kept"]
    assert_cache_clean(restarted, cache)


# -- disk budget -----------------------------------------------------------------------------
def _staged_size(store_factory: StoreFactory, tmp_path: Path, uri: str) -> int:
    probe = store_factory(cache_dir=tmp_path / "probe")
    probe.preload(uri, "probe")
    return probe.bytes_used


def test_lru_eviction_keeps_recently_streamed_and_pinned_adapters(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tmp_path: Path, cache: Path
) -> None:
    uris = _variants(tiny_adapters["attn-r4"], tmp_path, 6)
    size = _staged_size(store_factory, tmp_path, uris[0])
    store = store_factory(2 * size + size // 2)  # room for two
    store.preload(uris[0], "a")
    store.preload(uris[1], "b")
    assert_streams_intact(store, "a")  # a is now more recent than b
    store.preload(uris[2], "c")
    assert [m.name for m in store.list()] == ["a", "c"]
    store.pin("c")
    for i, name in enumerate(("d", "e", "f"), start=3):
        store.preload(uris[i], name)
        assert [m.name for m in store.list()] == ["c", name]  # pinned c never goes
    assert_cache_clean(store, cache)
    assert store.bytes_used <= store.bytes_budget


def test_full_budget_of_pinned_or_streamed_adapters_raises_capacity_exhausted(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tmp_path: Path, cache: Path
) -> None:
    uris = _variants(tiny_adapters["attn-r4"], tmp_path, 3)
    size = _staged_size(store_factory, tmp_path, uris[0])
    budget = 2 * size + size // 2
    store = store_factory(budget)
    store.preload(uris[0], "pinned-a", pin=True)
    store.preload(uris[1], "streamed-b")
    lease = store.open_stream("streamed-b")
    with pytest.raises(errors.CapacityExhausted, match=rf"{budget} bytes.*pinned-a.*streamed-b"):
        store.preload(uris[2], "c")
    assert_cache_clean(store, cache)
    assert [m.name for m in store.list()] == ["pinned-a", "streamed-b"]
    lease.close()
    store.preload(uris[2], "c")  # b is no longer streamed: it is evicted
    assert [m.name for m in store.list()] == ["c", "pinned-a"]
    store.pin("c")
    with pytest.raises(errors.CapacityExhausted, match="pinned: c, pinned-a"):
        store.preload(uris[1], "d")
    assert_streams_intact(store, "c")
    assert_cache_clean(store, cache)


def test_adapter_larger_than_the_whole_budget_is_refused_before_download(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, cache: Path
) -> None:
    source = CountingLocalSource()
    store = store_factory(1000, source=source)
    with pytest.raises(errors.CapacityExhausted, match="budget 1000 bytes"):
        store.preload(str(tiny_adapters["all-r8"]), "big")
    assert source.downloads == 0
    assert_cache_clean(store, cache)


# -- concurrency -----------------------------------------------------------------------------
def _run_threads(*targets: Callable[[], None]) -> None:
    """Run targets concurrently; re-raise the first exception any of them raised."""
    failures: list[BaseException] = []

    def guard(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as err:
            failures.append(err)

    threads = [threading.Thread(target=guard, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if failures:
        raise failures[0]


@pytest.mark.parametrize("names", [("x", "y"), ("x", "x")])
def test_concurrent_preloads_of_one_uri_share_one_download(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, cache: Path,
    names: tuple[str, str],
) -> None:
    gate = threading.Event()
    source = CountingLocalSource(gate)
    store = store_factory(source=source)
    uri = str(tiny_adapters["all-r8"])
    events: tuple[list[PreloadProgress], list[PreloadProgress]] = ([], [])
    second_heard = threading.Event()
    results: dict[int, str] = {}

    def first() -> None:
        results[0] = store.preload(uri, names[0], progress=events[0].append).adapter_id

    def second() -> None:
        assert source.started.wait(10)  # the first download is under way (held at the gate)

        def listen(event: PreloadProgress) -> None:
            events[1].append(event)
            second_heard.set()

        results[1] = store.preload(uri, names[1], progress=listen).adapter_id

    def opener() -> None:
        assert second_heard.wait(10)  # the second preload is waiting too
        gate.set()

    _run_threads(first, second, opener)
    assert (source.resolves, source.downloads) == (1, 1)
    assert results[0] == results[1]
    for stream in events:
        assert stream[-1].phase == "done" and stream[-1].manifest is not None
        assert {"validating", "staging"} <= {e.phase for e in stream}
    assert sorted({m.name for m in store.list()}) == sorted(set(names))
    assert_cache_clean(store, cache)


def test_concurrent_preload_delete_and_stream_leave_a_consistent_store(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, tmp_path: Path, cache: Path
) -> None:
    store = store_factory()
    uris = [str(tiny_adapters["attn-r4"]), _variants(tiny_adapters["attn-r4"], tmp_path, 1)[0]]
    store.preload(uris[0], "x")
    rounds = 15

    def preloader() -> None:
        for i in range(rounds):
            store.preload(uris[i % 2], "x", force=True)

    def deleter() -> None:
        for _ in range(rounds):
            with contextlib.suppress(errors.AdapterNotFound):
                store.delete("x")

    def streamer() -> None:
        for _ in range(rounds):
            with contextlib.suppress(errors.AdapterNotFound):
                assert_streams_intact(store, "x")

    _run_threads(preloader, deleter, streamer)
    assert [m.name for m in store.list()] in ([], ["x"])
    assert_cache_clean(store, cache)
    store.preload(uris[1], "x", force=True)
    assert_streams_intact(store, "x")


def test_delete_during_a_stream_drops_the_name_now_and_the_files_after_the_stream(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, cache: Path
) -> None:
    store = store_factory()
    manifest = store.preload(str(tiny_adapters["all-r8"]), "x")
    _, expected = stream_all(store, "x")
    with store.open_stream("x") as lease:
        chunks = lease.chunks(chunk_bytes=1024)
        received = [next(chunks)]
        store.delete("x")
        with pytest.raises(errors.AdapterNotFound):
            store.describe("x")
        assert (cache / "adapters" / manifest.adapter_id).is_dir()
        received += list(chunks)
    assert not (cache / "adapters" / manifest.adapter_id).exists()
    buffers = [bytearray() for _ in expected]
    for chunk in received:
        buffers[chunk.tensor_index] += chunk.data
    assert [bytes(b) for b in buffers] == expected
    assert store.bytes_used == 0
    assert_cache_clean(store, cache)


# -- a full disk and a crash -------------------------------------------------------------------
TINY_SHAPE = BaseShape(hidden=64, intermediate=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16)


@pytest.fixture
def half_mib_adapter(tmp_path: Path) -> Path:
    """A valid adapter of about 512 KiB (rank 64 on the tiny Llama's shapes)."""
    return make_synthetic_adapter(tmp_path / "half-mib", TINY_SHAPE, rank=64)


@pytest.fixture
def tiny_filesystem(tmp_path: Path):
    """A 256 KiB tmpfs (needs root and mount rights; skipped where mounting is not allowed)."""
    mount_point = tmp_path / "tinyfs"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); the RLIMIT_FSIZE test "
                    "below covers a failing write")
    yield mount_point
    # lazily: the test's stores close after this fixture ends (they were requested before it)
    # and still hold their registry file open in it; a plain umount would fail with EBUSY
    subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


def test_disk_full_during_staging_leaves_nothing_and_the_store_keeps_serving(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, half_mib_adapter: Path,
    tiny_filesystem: Path,
) -> None:
    cache = tiny_filesystem / "cache"
    store = store_factory(cache_dir=cache)
    store.preload(str(tiny_adapters["attn-r4"]), "keep")
    with pytest.raises(errors.CapacityExhausted, match="disk full"):
        store.preload(str(half_mib_adapter), "big")
    assert [m.name for m in store.list()] == ["keep"]
    assert_cache_clean(store, cache)
    assert_streams_intact(store, "keep")
    store.preload(str(tiny_adapters["all-r8"]), "small")
    assert_streams_intact(store, "small")
    assert [m.name for m in store_factory(cache_dir=cache).list()] == ["keep", "small"]


_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    from pathlib import Path
    from lorastream.core.errors import CapacityExhausted
    from lorastream.store.sources import SourceRegistry
    from lorastream.store.sources.local import LocalSource
    from lorastream.store.store import AdapterStore

    mode, cache, big, small = sys.argv[1:]
    store = AdapterStore(Path(cache), 1 << 30, SourceRegistry([LocalSource()]))
    store.preload(small, "small")
    if mode == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        try:
            store.preload(big, "big")
        except CapacityExhausted as err:
            print(json.dumps({"error": str(err), "tmp": os.listdir(Path(cache) / "tmp"),
                              "names": [m.name for m in store.list()]}))
    else:
        def crash(event):
            if event.phase == "validating":
                os._exit(3)  # die with the download complete, mid-staging
        store.preload(big, "big", progress=crash)
""")


def _child(mode: str, cache: Path, big: Path, small: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(cache), str(big), str(small)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )


def test_write_failure_from_a_file_size_limit_leaves_nothing_partial(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, half_mib_adapter: Path,
    cache: Path,
) -> None:
    done = _child("fsize", cache, half_mib_adapter, tiny_adapters["attn-r4"])
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "disk full" in report["error"]
    assert report["tmp"] == [] and report["names"] == ["small"]
    assert os.listdir(cache / "tmp") == []  # the failing process cleaned up itself
    store = store_factory()
    assert [m.name for m in store.list()] == ["small"]
    assert_cache_clean(store, cache)
    store.preload(str(half_mib_adapter), "big")
    assert_streams_intact(store, "big")


def test_crash_mid_staging_leaves_no_visible_adapter_and_restart_cleans_up(
    tiny_adapters: dict[str, Path], store_factory: StoreFactory, half_mib_adapter: Path,
    cache: Path,
) -> None:
    done = _child("crash", cache, half_mib_adapter, tiny_adapters["attn-r4"])
    assert done.returncode == 3, done.stderr
    assert len(os.listdir(cache / "tmp")) == 1  # the crashed download's temp dir
    store = store_factory()
    assert [m.name for m in store.list()] == ["small"]
    assert_cache_clean(store, cache)
    store.preload(str(half_mib_adapter), "big")
    assert_streams_intact(store, "big")


# -- memory ----------------------------------------------------------------------------------
def test_ten_concurrent_chunk_iterations_of_a_100mb_adapter_keep_memory_flat(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    rank = round(100e6 / adapter_nbytes(SMOLLM2_135M, 1, ALL_LINEAR))
    adapter = make_synthetic_adapter(tmp_path / "big", rank=rank)
    store = store_factory()
    manifest = store.preload(str(adapter), "big")
    assert manifest.total_bytes >= 95e6
    gc.collect()
    process = psutil.Process()
    baseline = peak = process.memory_info().rss
    done = threading.Event()
    received: list[int] = []

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.005)

    def stream() -> None:
        with store.open_stream("big") as lease:
            received.append(sum(len(chunk.data) for chunk in lease.chunks()))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        _run_threads(*[stream] * 10)
    finally:
        done.set()
        sampler.join()
    assert received == [manifest.total_bytes] * 10
    growth = peak - baseline
    assert growth < 40e6, f"RSS grew by {growth / 1e6:.0f} MB streaming 10 x 100 MB"
