"""Fetch an adapter's tensors into a host buffer: from the store by name, or from a local dir.

Either way the bytes land chunk by chunk at their offsets in one preallocated host buffer and
every tensor's sha256 is checked before anything else sees it. ``chunk_delay_s`` is a test hook
that slows every landed chunk, so tests can hold a load in flight.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from lorastream.adapter_validation import content_id, validate_adapter_dir
from lorastream.errors import InvalidAdapter, InvalidArgument, SourceUnavailable
from lorastream.manifest import AdapterManifest
from lorastream.store_client import StoreClient
from services.gpu_worker.device import Device
from services.gpu_worker.loading.host_buffer import HostAdapterBuffer

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20


class _SlowSink:
    """Wraps a sink and sleeps before each write (the fault hook)."""

    def __init__(self, inner: HostAdapterBuffer, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def begin(self, manifest: AdapterManifest) -> None:
        self._inner.begin(manifest)

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        time.sleep(self._delay_s)
        self._inner.write(tensor_index, offset, data)

    def view(self, tensor_index: int) -> memoryview:
        return self._inner.view(tensor_index)


class AdapterFetcher:
    """Knows where adapters come from; owns the store client."""

    def __init__(self, device: Device, store: str | None, store_token: str | None = None) -> None:
        self._device = device
        self._store_target = store
        self._client = StoreClient(store, store_token) if store else None
        self.chunk_bytes = 0  # stream chunk size asked of the store; 0: the store's default
        self.chunk_delay_s = 0.0  # test hook

    @property
    def has_store(self) -> bool:
        return self._client is not None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _store(self, name: str) -> StoreClient:
        if self._client is None:
            raise InvalidArgument(
                f"adapter {name!r} is not loaded on this worker and the worker has no store "
                "(start it with --store HOST:PORT, or LoadAdapter it from a local path)"
            )
        return self._client

    def describe(self, name: str) -> AdapterManifest:
        """The store's current manifest of ``name`` (its content id decides identity)."""
        return self._store(name).describe(name)

    def fetch(
        self, name: str, expected_id: str, storage: torch.Tensor | None = None
    ) -> HostAdapterBuffer:
        """Stream ``name`` from the store into a host buffer, verified: into ``storage`` (a
        reserved host range, ``[>= nbytes]`` uint8) when given, else a new allocation."""
        buffer = HostAdapterBuffer(self._device, storage)
        sink = _SlowSink(buffer, self.chunk_delay_s) if self.chunk_delay_s else buffer
        started = time.perf_counter()
        manifest = self._store(name).stream_tensors(name, sink, chunk_bytes=self.chunk_bytes)
        if manifest.adapter_id != expected_id:
            raise SourceUnavailable(
                f"adapter {name} changed in the store while it was being fetched (now "
                f"{manifest.adapter_id[:12]}, expected {expected_id[:12]}); retry the request"
            )
        log.info(
            "fetched %s (%s, %.1f MB) from the store in %.3fs",
            name, expected_id[:12], manifest.total_bytes / 1e6, time.perf_counter() - started,
        )
        return buffer

    def read_local(self, name: str, path: Path) -> HostAdapterBuffer:
        """Validate a local PEFT directory and read its tensors into a new host buffer."""
        if not path.is_dir():
            raise InvalidArgument(f"{path} is not a directory; expected a PEFT LoRA directory")
        validated = validate_adapter_dir(path, label=f"{name} ({path})")
        manifest = AdapterManifest(
            adapter_id=content_id(path),
            name=name,
            source_uri=path.resolve().as_uri(),
            revision="",
            base_model=validated.base_model,
            rank=validated.rank,
            alpha=validated.alpha,
            use_rslora=validated.use_rslora,
            target_modules=validated.target_modules,
            tensors=tuple(t.info for t in validated.tensors),
            created_at=time.time(),
        )
        buffer = HostAdapterBuffer(self._device)
        buffer.begin(manifest)
        fd = os.open(path / "adapter_model.safetensors", os.O_RDONLY)
        try:
            for index, staged in enumerate(validated.tensors):
                done = 0
                while done < staged.info.nbytes:
                    data = os.pread(
                        fd, min(_READ_CHUNK, staged.info.nbytes - done), staged.file_offset + done
                    )
                    if not data:
                        raise InvalidAdapter(f"{path}: weights file shrank while being read")
                    buffer.write(index, done, data)
                    done += len(data)
                if hashlib.sha256(buffer.view(index)).hexdigest() != staged.info.checksum:
                    raise InvalidAdapter(f"{path}: weights changed while being read; retry")
        finally:
            os.close(fd)
        return buffer
