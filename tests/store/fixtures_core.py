"""Helpers for the store core tests (real PEFT adapters, real local files); their fixtures,
``tiny_adapters`` and ``store_factory``, are in conftest.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from lorastream.core.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from lorastream.core.manifest import AdapterManifest
from lorastream.core.stream_layout import StreamLayout
from lorastream.store.registry import REGISTRY_FILE
from lorastream.store.sources.base import ProgressCallback, ResolvedSource
from lorastream.store.sources.local import LocalSource
from lorastream.store.store import AdapterStore

StoreFactory = Callable[..., AdapterStore]


class CountingLocalSource(LocalSource):
    """A real LocalSource that counts its downloads and can hold them at a gate."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.downloads = 0
        self.resolves = 0
        self.gate = gate
        self.started = threading.Event()
        self._count_lock = threading.Lock()

    def resolve(self, uri: str) -> ResolvedSource:
        with self._count_lock:
            self.resolves += 1
        return super().resolve(uri)

    def download(self, resolved: ResolvedSource, dest: Path, progress: ProgressCallback) -> None:
        with self._count_lock:
            self.downloads += 1
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "test never opened the download gate"
        super().download(resolved, dest, progress)


def copy_adapter(src: Path, dst: Path, **config_changes: object) -> Path:
    """Copy a PEFT dir (config + weights only), optionally changing adapter_config fields."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copyfile(src / name, dst / name)
    if config_changes:
        config = json.loads((dst / CONFIG_FILE).read_text())
        config.update(config_changes)
        (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return dst


def read_header(path: Path) -> tuple[dict[str, dict], bytes]:
    """(safetensors header dict, data bytes) of a weights file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(path: Path, header: dict[str, dict], data: bytes) -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def stream_all(
    store: AdapterStore, name: str, chunk_bytes: int = 1 << 20
) -> tuple[AdapterManifest, list[bytes]]:
    """Stream every tensor of ``name`` and reassemble each tensor's bytes."""
    with store.open_stream(name) as lease:
        layout = StreamLayout(lease.manifest)
        buffers = [bytearray(t.nbytes) for t in lease.manifest.tensors]
        for chunk in lease.chunks(chunk_bytes=chunk_bytes):
            for index, offset, piece in layout.split(chunk.tensor_index, chunk.offset, chunk.data):
                buffers[index][offset : offset + len(piece)] = piece
        return lease.manifest, [bytes(b) for b in buffers]


def assert_streams_intact(store: AdapterStore, name: str) -> AdapterManifest:
    """``name`` streams completely and every tensor matches its manifest checksum."""
    manifest, buffers = stream_all(store, name, chunk_bytes=4096)
    for info, data in zip(manifest.tensors, buffers, strict=True):
        assert hashlib.sha256(data).hexdigest() == info.checksum, info.name
    return manifest


def assert_cache_clean(store: AdapterStore, cache_dir: Path) -> None:
    """No temp dirs; the listed adapters' content dirs exist, and no others but versions a name's
    history holds; bytes_used matches disk."""
    assert os.listdir(cache_dir / "tmp") == []
    on_disk = set(os.listdir(cache_dir / "adapters"))
    listed = {m.adapter_id for m in store.list()}
    with sqlite3.connect(cache_dir / REGISTRY_FILE) as db:
        history = {row[0] for row in db.execute("SELECT adapter_id FROM versions")}
    assert listed <= on_disk <= listed | history
    disk_bytes = sum(
        f.stat().st_size for d in on_disk for f in (cache_dir / "adapters" / d).iterdir()
    )
    assert store.bytes_used == disk_bytes
