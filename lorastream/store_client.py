"""Client of the adapter store, shared by the CLI, the worker and the gateway.

The tensor stream lands in a :class:`TensorSink` chunk by chunk at each chunk's offset (no
concatenation of bytes objects); every chunk's crc32 and every tensor's sha256 are verified, and a
stream cut by a dead store resumes from the last verified (tensor, offset).
"""

from __future__ import annotations

import hashlib
import logging
import time
import zlib
from collections.abc import Iterator
from typing import Protocol

import grpc

from lorastream import codec
from lorastream.adapter_store.v1 import adapter_store_pb2 as pb
from lorastream.adapter_store.v1 import adapter_store_pb2_grpc as pb_grpc
from lorastream.errors import InvalidAdapter, SourceUnavailable
from lorastream.grpc_status import raise_from_rpc_error
from lorastream.manifest import AdapterManifest, PreloadProgress, TensorChunk

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_receive_message_length", 16 << 20)]
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class TensorSink(Protocol):
    """Where streamed tensor bytes land."""

    def begin(self, manifest: AdapterManifest) -> None:
        """Called once per stream attempt with the manifest, before any chunk (allocate here)."""

    def write(self, tensor_index: int, offset: int, data: bytes) -> None:
        """Copy ``data`` into tensor ``tensor_index`` at byte ``offset``."""

    def view(self, tensor_index: int) -> memoryview:
        """The bytes of a completely received tensor, for checksum verification."""


class BytesSink:
    """A sink with one preallocated ``bytearray`` per tensor (the CLI's ``pull`` uses it)."""

    def __init__(self) -> None:
        self.manifest: AdapterManifest | None = None
        self.buffers: list[bytearray] = []

    def begin(self, manifest: AdapterManifest) -> None:
        if self.manifest is None or self.manifest.adapter_id != manifest.adapter_id:
            self.manifest = manifest
            self.buffers = [bytearray(t.nbytes) for t in manifest.tensors]

    def write(self, tensor_index: int, offset: int, data: bytes) -> None:
        self.buffers[tensor_index][offset : offset + len(data)] = data

    def view(self, tensor_index: int) -> memoryview:
        return memoryview(self.buffers[tensor_index])


class StoreClient:
    """Blocking client of ``AdapterStoreService``; raises lorastream domain exceptions."""

    def __init__(self, target: str, token: str | None = None, timeout: float = 30.0) -> None:
        self.target = target
        self._channel = grpc.insecure_channel(target, options=GRPC_OPTIONS)
        self._stub = pb_grpc.AdapterStoreServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operator calls ---------------------------------------------------------------------
    def preload(
        self, source_uri: str, name: str, *, pin: bool = False, force: bool = False
    ) -> Iterator[PreloadProgress]:
        request = pb.PreloadAdapterRequest(source_uri=source_uri, name=name, pin=pin, force=force)
        try:
            for event in self._stub.PreloadAdapter(request, metadata=self._metadata):
                yield codec.progress_from_pb(event)
        except grpc.RpcError as err:
            raise_from_rpc_error(err)

    def list(self) -> tuple[list[AdapterManifest], int, int]:
        """All staged adapters, with the cache's bytes used and budget."""
        reply = self._call(self._stub.ListAdapters, pb.ListAdaptersRequest())
        adapters = [codec.manifest_from_pb(m) for m in reply.adapters]
        return adapters, reply.cache_bytes_used, reply.cache_bytes_budget

    def describe(self, name: str) -> AdapterManifest:
        reply = self._call(self._stub.DescribeAdapter, pb.DescribeAdapterRequest(name=name))
        return codec.manifest_from_pb(reply.manifest)

    def delete(self, name: str) -> None:
        self._call(self._stub.DeleteAdapter, pb.DeleteAdapterRequest(name=name))

    def pin(self, name: str) -> AdapterManifest:
        reply = self._call(self._stub.PinAdapter, pb.PinAdapterRequest(name=name))
        return codec.manifest_from_pb(reply.manifest)

    def unpin(self, name: str) -> AdapterManifest:
        reply = self._call(self._stub.UnpinAdapter, pb.UnpinAdapterRequest(name=name))
        return codec.manifest_from_pb(reply.manifest)

    def _call(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return method(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.RpcError as err:
            raise_from_rpc_error(err)

    # -- tensor stream ----------------------------------------------------------------------
    def iter_chunks(self, name: str, *, chunk_bytes: int = 0) -> Iterator[TensorChunk]:
        """The raw chunk stream of ``name`` (crc32 checked, no landing, no resume)."""
        request = pb.StreamAdapterTensorsRequest(name=name, chunk_bytes=chunk_bytes)
        try:
            for msg in self._stub.StreamAdapterTensors(request, metadata=self._metadata):
                if msg.HasField("chunk"):
                    chunk = codec.chunk_from_pb(msg.chunk)
                    if zlib.crc32(chunk.data) != chunk.crc32:
                        raise InvalidAdapter(f"crc32 mismatch in {name} at {chunk.offset}")
                    yield chunk
        except grpc.RpcError as err:
            raise_from_rpc_error(err)

    def stream_tensors(
        self,
        name: str,
        sink: TensorSink,
        *,
        chunk_bytes: int = 0,
        max_retries: int = 5,
        retry_backoff: float = 0.2,
    ) -> AdapterManifest:
        """Stream every tensor of ``name`` into ``sink``, verified; resume after store failures.

        Raises InvalidAdapter on a checksum mismatch, SourceUnavailable when the store stays away
        for ``max_retries`` attempts, and the store's own errors (AdapterNotFound, ...) as they are.
        """
        position = (0, 0)  # next (tensor_index, offset) expected
        manifest: AdapterManifest | None = None
        attempt = 0
        while True:
            request = pb.StreamAdapterTensorsRequest(
                name=name,
                adapter_id=manifest.adapter_id if manifest else "",
                start_tensor=position[0],
                start_offset=position[1],
                chunk_bytes=chunk_bytes,
            )
            try:
                for msg in self._stub.StreamAdapterTensors(request, metadata=self._metadata):
                    if msg.HasField("manifest"):
                        manifest = codec.manifest_from_pb(msg.manifest)
                        sink.begin(manifest)
                        if position == (0, 0):
                            position = _skip_empty(manifest, position)
                        continue
                    if manifest is None:
                        raise InvalidAdapter(f"store sent a chunk of {name} before its manifest")
                    position = self._land_chunk(manifest, sink, msg.chunk, position)
                if manifest is None or position[0] < len(manifest.tensors):
                    raise InvalidAdapter(
                        f"store ended the stream of {name} early at tensor {position[0]}"
                    )
                return manifest
            except grpc.RpcError as err:
                if err.code() not in _RETRYABLE:
                    raise_from_rpc_error(err)
                attempt += 1
                if attempt > max_retries:
                    raise SourceUnavailable(
                        f"adapter store {self.target} unreachable while streaming {name} "
                        f"(gave up after {max_retries} retries at tensor {position[0]}, "
                        f"offset {position[1]}): {err.details()}"
                    ) from err
                delay = retry_backoff * (2 ** (attempt - 1))
                log.warning(
                    "stream of %s interrupted at tensor %d offset %d (%s); retry %d in %.2fs",
                    name, position[0], position[1], err.code().name, attempt, delay,
                )
                time.sleep(delay)

    @staticmethod
    def _land_chunk(
        manifest: AdapterManifest,
        sink: TensorSink,
        chunk: pb.TensorChunk,
        position: tuple[int, int],
    ) -> tuple[int, int]:
        index, offset = chunk.tensor_index, chunk.offset
        if (index, offset) != position:
            raise InvalidAdapter(
                f"store sent {manifest.name} tensor {index} offset {offset}, expected {position}"
            )
        data = chunk.data
        info = manifest.tensors[index]
        if offset + len(data) > info.nbytes:
            raise InvalidAdapter(f"chunk overruns tensor {info.name} of {manifest.name}")
        if zlib.crc32(data) != chunk.crc32:
            raise InvalidAdapter(
                f"crc32 mismatch in {manifest.name} tensor {info.name} at offset {offset}"
            )
        sink.write(index, offset, data)
        offset += len(data)
        if offset < info.nbytes:
            return index, offset
        digest = hashlib.sha256(sink.view(index)).hexdigest()
        if digest != info.checksum:
            raise InvalidAdapter(
                f"sha256 mismatch for {manifest.name} tensor {info.name}: the staged adapter is "
                "corrupt; delete and preload it again"
            )
        return _skip_empty(manifest, (index + 1, 0))


def _skip_empty(manifest: AdapterManifest, position: tuple[int, int]) -> tuple[int, int]:
    """Advance past zero-byte tensors, which the store sends no chunk for."""
    index, offset = position
    while index < len(manifest.tensors) and manifest.tensors[index].nbytes == 0:
        index += 1
    return index, offset
