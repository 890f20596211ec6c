"""Per-tensor fast digests: computed by the store at staging, carried in the manifest, checked by
the receiver on landing; sha256 still names the content, and manifests without the fast digest
(staged before it existed) still verify with sha256. Real store server on loopback, real PEFT
adapters, corruption made on the store's disk after staging."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
import xxhash

from lorastream.core import checksum, codec
from lorastream.core.adapter_format import WEIGHTS_FILE
from lorastream.core.adapter_validation import STAGED_FILES, content_id, validate_adapter_dir
from lorastream.core.checksum import TENSOR_DIGESTS, verify_tensor
from lorastream.core.errors import InvalidAdapter
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import BytesSink, StoreClient
from lorastream.store import reader as store_reader
from lorastream.store import staging, writeback
from lorastream.store.config import StoreSettings
from lorastream.store.digesting import StreamDigests
from lorastream.store.server import create_server
from lorastream.store.sources import SourceRegistry
from lorastream.store.sources.s3 import S3Source
from lorastream.store.staging import MANIFEST_FILE
from lorastream.store.store import AdapterStore
from tests.support.models import ALL_LINEAR, make_peft_adapter, make_tiny_llama
from tests.support.s3_server import MotoS3Server, upload_dir

_EXPECTED = {
    "xxh3-128": lambda b: "xxh3-128:" + xxhash.xxh3_128_hexdigest(b),
    "blake3": lambda b: "blake3:" + blake3.blake3(b).hexdigest(),
    "sha256": lambda b: "",
}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fast-verify")
    base = make_tiny_llama(root / "base")
    return make_peft_adapter(base, root / "all-r8", rank=8, targets=ALL_LINEAR, seed=5)


class _Store:
    """A store server on port 0 over ``cache_dir``, staging with ``digest``."""

    def __init__(self, cache_dir: Path, adapter: Path, digest: str) -> None:
        settings = StoreSettings(port=0, cache_dir=cache_dir, tensor_digest=digest,
                                 allowed_local_roots=[adapter.parent])
        self.server, port, self.store = create_server(settings)
        self.server.start()
        self.client = StoreClient(f"127.0.0.1:{port}")

    def close(self) -> None:
        self.client.close()
        self.server.stop(grace=None).wait()


@pytest.fixture
def open_store(tmp_path: Path, adapter: Path) -> Iterator:
    opened: list[_Store] = []

    def open_(digest: str = "xxh3-128") -> _Store:
        store = _Store(tmp_path / "cache", adapter, digest)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


def _preload(store: _Store, adapter: Path) -> AdapterManifest:
    events = list(store.client.preload(str(adapter), "a"))
    assert events[-1].manifest is not None
    return events[-1].manifest


def _flip_byte(cache_dir: Path, manifest: AdapterManifest, tensor: int) -> None:
    """Corrupt one byte of ``tensor`` in the staged weights file (disk rot after staging)."""
    staged = cache_dir / "adapters" / manifest.adapter_id
    doc = json.loads((staged / MANIFEST_FILE).read_text())
    at = doc["tensors"][tensor]["file_offset"] + 3
    with (staged / "adapter_model.safetensors").open("r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def _drop_fast_checksums(cache_dir: Path, manifest: AdapterManifest) -> None:
    """Rewrite the staged manifest.json as a store from before the fast digest wrote it."""
    path = cache_dir / "adapters" / manifest.adapter_id / MANIFEST_FILE
    doc = json.loads(path.read_text())
    for tensor in doc["tensors"]:
        del tensor["fast_checksum"]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("digest", TENSOR_DIGESTS)
def test_staging_computes_the_fast_digest_and_keeps_sha256_and_the_content_id(
    adapter: Path, digest: str
) -> None:
    validated = validate_adapter_dir(adapter, tensor_digest=digest)
    raw = (adapter / "adapter_model.safetensors").read_bytes()
    for staged in validated.tensors:
        data = raw[staged.file_offset : staged.file_offset + staged.info.nbytes]
        assert staged.info.checksum == hashlib.sha256(data).hexdigest()
        assert staged.info.fast_checksum == _EXPECTED[digest](data)
    assert len(content_id(adapter)) == 64  # the content id does not depend on the digest


@pytest.mark.parametrize(
    ("fast", "used"),
    [("xxh3-128:{x}", "xxh3-128"), ("blake3:{b}", "blake3"), ("", "sha256"),
     ("md7:0000", "sha256")],  # an algorithm this build does not know: sha256, always present
)
def test_verify_tensor_uses_the_fast_digest_when_known_and_catches_one_flipped_bit(
    fast: str, used: str
) -> None:
    data = bytearray(range(256)) * 300
    sha = hashlib.sha256(data).hexdigest()
    fast = fast.format(x=xxhash.xxh3_128_hexdigest(data), b=blake3.blake3(data).hexdigest())
    assert verify_tensor(data, sha, fast) == (True, used)
    data[1234] ^= 1
    assert verify_tensor(data, sha, fast) == (False, used)


def test_codec_carries_the_fast_digest(adapter: Path) -> None:
    manifest = validate_adapter_dir(adapter).manifest(adapter_id="0" * 64, name="a",
                                                      source_uri="file:///a")
    back = codec.manifest_from_pb(codec.manifest_to_pb(manifest))
    assert back.tensors == manifest.tensors
    assert all(t.fast_checksum.startswith("xxh3-128:") for t in back.tensors)


@pytest.mark.parametrize("digest", TENSOR_DIGESTS)
def test_stream_verifies_with_the_manifests_digest(open_store, adapter: Path, digest: str) -> None:
    store = open_store(digest)
    staged = _preload(store, adapter)
    sink = BytesSink()
    manifest = store.client.stream_tensors("a", sink, chunk_bytes=4096)
    assert manifest.adapter_id == staged.adapter_id == content_id(adapter)
    for info, buf in zip(manifest.tensors, sink.buffers, strict=True):
        assert info.fast_checksum == _EXPECTED[digest](bytes(buf))


@pytest.mark.parametrize("digest", TENSOR_DIGESTS)
def test_a_byte_rotted_on_the_stores_disk_fails_the_landing_check(
    open_store, adapter: Path, tmp_path: Path, digest: str
) -> None:
    store = open_store(digest)
    manifest = _preload(store, adapter)
    _flip_byte(tmp_path / "cache", manifest, tensor=5)
    expected = f"{digest} mismatch for a tensor .*delete and preload"
    with pytest.raises(InvalidAdapter, match=expected):
        store.client.stream_tensors("a", BytesSink(), chunk_bytes=4096)


@pytest.mark.parametrize("reader", ["stream_tensors", "iter_chunks"])
def test_only_a_receiver_without_tensor_digests_gets_chunk_crcs(
    open_store, adapter: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    """``stream_tensors`` checks every tensor's digest, so it asks the store for no per-chunk
    CRC-32C and the store computes none; ``iter_chunks`` checks chunks only and gets them."""
    store = open_store()
    _preload(store, adapter)
    computed: list[int] = []

    def counting_crc32c(data: bytes | memoryview) -> int:
        computed.append(len(data))
        return checksum.crc32c(data)

    monkeypatch.setattr(store_reader, "crc32c", counting_crc32c)  # the store's side
    if reader == "stream_tensors":
        sink = BytesSink()
        manifest = store.client.stream_tensors("a", sink, chunk_bytes=4096)
        assert computed == []
        assert sum(len(b) for b in sink.buffers) == manifest.total_bytes  # all landed, verified
    else:
        chunks = list(store.client.iter_chunks("a", chunk_bytes=4096))
        assert len(computed) == len(chunks) > 1
        assert all(c.crc32c == checksum.crc32c(c.data) for c in chunks)


@pytest.mark.parametrize("digest", TENSOR_DIGESTS)
def test_without_chunk_crcs_a_damaged_byte_still_fails_its_tensor(
    open_store, adapter: Path, monkeypatch: pytest.MonkeyPatch, digest: str
) -> None:
    """A byte damaged between the store's read and the receiver (here: in the store's reader,
    after the disk) is caught by the tensor's digest, now that no chunk CRC looks at it."""
    store = open_store(digest)
    manifest = _preload(store, adapter)
    real_pread = store_reader.os.pread
    calls = 0

    def damaging_pread(fd: int, n: int, offset: int) -> bytes:
        nonlocal calls
        calls += 1
        data = real_pread(fd, n, offset)
        return data[:5] + bytes([data[5] ^ 1]) + data[6:] if calls == 3 else data

    monkeypatch.setattr(store_reader.os, "pread", damaging_pread)
    damaged = f"{digest} mismatch for a tensor .*damaged in transit"
    with pytest.raises(InvalidAdapter, match=damaged):
        store.client.stream_tensors("a", BytesSink(), chunk_bytes=4096)
    assert calls >= 3 and manifest.total_bytes > 3 * 4096


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_manifest_staged_before_the_fast_digest_still_verifies_with_sha256(
    open_store, adapter: Path, tmp_path: Path, corrupt: bool
) -> None:
    first = open_store()
    manifest = _preload(first, adapter)
    first.close()
    _drop_fast_checksums(tmp_path / "cache", manifest)
    if corrupt:
        _flip_byte(tmp_path / "cache", manifest, tensor=2)
    restarted = open_store()
    described = restarted.client.describe("a")
    assert [t.fast_checksum for t in described.tensors] == [""] * len(described.tensors)
    if corrupt:
        with pytest.raises(InvalidAdapter, match="sha256 mismatch"):
            restarted.client.stream_tensors("a", BytesSink(), chunk_bytes=4096)
    else:
        sink = BytesSink()
        restarted.client.stream_tensors("a", sink, chunk_bytes=4096)
        for info, buf in zip(described.tensors, sink.buffers, strict=True):
            assert hashlib.sha256(buf).hexdigest() == info.checksum


# -- hashed while downloading -------------------------------------------------------------------
@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize("digest", TENSOR_DIGESTS)
def test_digests_fed_in_any_pieces_equal_the_ones_read_from_disk(
    adapter: Path, tmp_path: Path, piece: int, digest: str
) -> None:
    digests = StreamDigests(digest, max_header_bytes=16 << 20)
    for name in STAGED_FILES:
        data = (adapter / name).read_bytes()
        writer = digests.writer(name, len(data), tmp_path / name)
        for at in range(0, len(data), piece):
            writer.write(data[at : at + piece])
        writer.close()
    assert digests.content_id == content_id(adapter) == content_id(tmp_path)
    from_disk = validate_adapter_dir(adapter, tensor_digest=digest)
    hashed = digests.tensors
    assert len(hashed) == len(from_disk.tensors)
    for staged in from_disk.tensors:
        nbytes, fed = hashed[staged.file_offset]
        assert nbytes == staged.info.nbytes
        assert (fed.sha256, fed.fast_checksum) == (staged.info.checksum, staged.info.fast_checksum)


def test_the_weights_are_synced_to_disk_while_they_download(
    adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writeback, "DEFAULT_STRIDE", 4096)
    started: dict[str, writeback.Writeback] = {}
    real_writer = StreamDigests.writer

    def writer(self: StreamDigests, name: str, size: int, target: Path) -> object:
        w = real_writer(self, name, size, target)
        started[name] = w._writeback
        return w

    monkeypatch.setattr(StreamDigests, "writer", writer)
    digests = StreamDigests("xxh3-128", max_header_bytes=16 << 20)
    for name in STAGED_FILES:
        data = (adapter / name).read_bytes()
        w = digests.writer(name, len(data), tmp_path / name)
        for at in range(0, len(data), 1000):
            w.write(data[at : at + 1000])
        w.close()
    size = (adapter / WEIGHTS_FILE).stat().st_size
    assert size >= 3 * 4096
    assert started[WEIGHTS_FILE].synced == size - size % 4096 and started[WEIGHTS_FILE].syncs
    assert digests.content_id == content_id(adapter) == content_id(tmp_path)  # bytes unchanged


@pytest.mark.parametrize(
    "spoil",
    ["weights first", "short file", "header bomb"],
)
def test_anything_unexpected_turns_the_shortcut_off(adapter: Path, tmp_path: Path,
                                                    spoil: str) -> None:
    digests = StreamDigests("xxh3-128", max_header_bytes=64 if spoil == "header bomb" else 1 << 24)
    order = STAGED_FILES[::-1] if spoil == "weights first" else STAGED_FILES
    for name in order:
        data = (adapter / name).read_bytes()
        writer = digests.writer(name, len(data) + (spoil == "short file"), tmp_path / name)
        writer.write(data)
        writer.close()
    assert digests.content_id is None and digests.tensors == {}


def test_an_s3_preload_hashes_while_downloading_with_the_same_result_as_from_disk(
    moto_s3: MotoS3Server, bucket: str, aws_env: None, adapter: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload_dir(moto_s3.client(), adapter, bucket, "a")
    sources = SourceRegistry([S3Source(endpoint_url=moto_s3.endpoint_url, multipart_threshold=4096,
                                       multipart_chunksize=4096)])  # many parts, written in order
    reread: list[Path] = []
    monkeypatch.setattr(staging, "content_id", lambda d: reread.append(d) or content_id(d))
    store = AdapterStore(tmp_path / "cache", 1 << 30, sources)
    manifest = store.preload(f"s3://{bucket}/a", "a")
    assert reread == []  # the content id came from the download, not from a second read
    assert manifest.adapter_id == content_id(adapter)
    local = validate_adapter_dir(adapter)
    assert manifest.tensors == tuple(t.info for t in local.tensors)
