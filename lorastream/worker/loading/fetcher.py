"""Fetch an adapter's tensors into a host buffer: from the store by name, or from a local dir.

Either way the bytes land chunk by chunk at their offsets in one preallocated host buffer and
every tensor's digest (``core/checksum.py``: the manifest's fast one, else sha256) is checked
before anything else sees it. Store fetches into the host arena run in the fetch process when
there is one (``fetch_process.py`` says why), else in the calling thread. Either way a store
fetch reports, through ``on_layers``, each time more of the adapter's leading layers have landed
verified (the store streams them in layer order; ``layer_progress.py``). ``chunk_delay_s`` is a
test hook that slows every landed chunk, so tests can hold a load in flight.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from lorastream.core.adapter_validation import content_id, validate_adapter_dir
from lorastream.core.checksum import verify_tensor
from lorastream.core.errors import InvalidAdapter, InvalidArgument, SourceUnavailable
from lorastream.core.manifest import AdapterManifest
from lorastream.core.store_client import StoreClient
from lorastream.core.tls import ClientTLS
from lorastream.core.versions import pinned_ref
from lorastream.worker.device.device import Device
from lorastream.worker.loading.fetch_process import FetchProcess
from lorastream.worker.loading.host_buffer import HostAdapterBuffer
from lorastream.worker.loading.landing import SlowSink
from lorastream.worker.loading.layer_progress import LayersCallback

log = logging.getLogger(__name__)

_READ_CHUNK = 1 << 20


class AdapterFetcher:
    """Knows where adapters come from; owns the store client."""

    def __init__(self, device: Device, store: str | None, store_token: str | None = None,
                 process: FetchProcess | None = None, store_tls: ClientTLS | None = None) -> None:
        self._device = device
        self._store_target = store
        self._client = StoreClient(store, store_token, tls=store_tls) if store else None
        self._process = process
        self.chunk_bytes = 0  # stream chunk size asked of the store; 0: the store's default
        self.chunk_delay_s = 0.0  # test hook

    @property
    def has_store(self) -> bool:
        return self._client is not None

    @property
    def client(self) -> StoreClient | None:
        """The store client (the catalogue's watch shares its channel); None without a store."""
        return self._client

    @property
    def process(self) -> FetchProcess | None:
        return self._process

    @property
    def landing_memory(self) -> torch.Tensor | None:
        """Host memory the fetch process lands in (``[n]`` uint8): the host arena must be carved
        out of it for fetches to run there. None without a fetch process."""
        return None if self._process is None else self._process.memory.tensor

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._process is not None:
            self._process.close()

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
        self, name: str, expected_id: str, storage: torch.Tensor | None = None,
        on_layers: LayersCallback | None = None,
    ) -> HostAdapterBuffer:
        """Stream ``name`` from the store into a host buffer, verified: into ``storage`` (a
        reserved host range, ``[>= nbytes]`` uint8) when given, else a new allocation. The
        stream names ``expected_id``'s version of ``name`` (``name@id``): it stays fetchable when
        the name moves on to other content meanwhile. ``on_layers(count)`` is called, before
        this returns, each time the count of leading layers landed and verified grows (layers
        per the manifest: ``layer_progress.manifest_layers``)."""
        ref = pinned_ref(name, expected_id)
        started = time.perf_counter()
        client = self._store(name)
        process = self._process
        if process is not None and storage is not None and process.memory.holds(storage):
            # The fetch process lands and verifies the bytes in ``storage``: shared memory.
            buffer = HostAdapterBuffer(self._device, storage)
            manifest, landing = process.fetch(ref, storage, self.chunk_bytes, self.chunk_delay_s,
                                              on_layers)
            buffer.adopt(manifest, landing)
        else:
            buffer = HostAdapterBuffer(self._device, storage, on_layers)
            sink = SlowSink(buffer, self.chunk_delay_s) if self.chunk_delay_s else buffer
            manifest = client.stream_tensors(ref, sink, chunk_bytes=self.chunk_bytes)
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
        manifest = validated.manifest(
            adapter_id=content_id(path), name=name, source_uri=path.resolve().as_uri(),
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
                info = staged.info
                if not verify_tensor(buffer.view(index), info.checksum, info.fast_checksum)[0]:
                    raise InvalidAdapter(f"{path}: weights changed while being read; retry")
                buffer.verified(index)
        finally:
            os.close(fd)
        return buffer
