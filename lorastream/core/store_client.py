"""Client of the adapter store, shared by the CLI, the worker and the gateway.

The tensor stream lands in a :class:`TensorSink` chunk by chunk at each chunk's offset (no
concatenation of bytes objects); every tensor's digest (core/checksum.py) is verified as its last
byte lands, and the sink told so (``verified``: tensors come in layer order, so a receiver can
tell when an adapter's leading layers are whole); a stream cut by a dead store resumes from the
last verified (tensor, offset). The raw chunk stream (``iter_chunks``) checks each chunk's CRC-32C
instead.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import grpc.experimental
from google.protobuf.message import Message

from lorastream.adapter_store.v1 import adapter_store_pb2 as pb
from lorastream.adapter_store.v1 import adapter_store_pb2_grpc as pb_grpc
from lorastream.core import codec
from lorastream.core.checksum import crc32c, verify_tensor
from lorastream.core.errors import InvalidAdapter, SourceUnavailable
from lorastream.core.grpc_status import raise_from_rpc_error
from lorastream.core.listing import AdapterFilter
from lorastream.core.manifest import AdapterManifest, PreloadProgress, TensorChunk
from lorastream.core.stream_layout import StreamLayout
from lorastream.core.tls import ClientTLS, open_channel
from lorastream.core.upload import FileContent, SentCallback, directory_files, upload_items
from lorastream.core.versions import AdapterVersion, WatchMessage

log = logging.getLogger(__name__)

GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 16 << 20),
    # A store that comes back is found within 2 s (gRPC's own default backs off up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# The tensor stream's own channel: gRPC's single-threaded unary-stream calls read the responses
# on the caller's thread instead of handing each message over from gRPC's polling thread. Its
# own TCP connection also keeps a large stream from queueing the control calls (describe, the
# watch) behind its bytes. measured: docs/notes/store.md, "The stream's own channel"
STREAM_GRPC_OPTIONS = [
    *GRPC_OPTIONS,
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
]
_STREAM_METHOD = (
    "/" + pb.DESCRIPTOR.services_by_name["AdapterStoreService"].full_name + "/StreamAdapterTensors"
)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class TensorSink(Protocol):
    """Where streamed tensor bytes land."""

    def begin(self, manifest: AdapterManifest) -> None:
        """Called once per stream attempt with the manifest, before any chunk (allocate here)."""

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into tensor ``tensor_index`` at byte ``offset``."""

    def view(self, tensor_index: int) -> memoryview:
        """The bytes of a completely received tensor, for checksum verification."""

    def verified(self, tensor_index: int) -> None:
        """Tensor ``tensor_index`` landed whole and its digest matched (once per tensor and
        stream: a resumed stream goes on after the last tensor verified)."""


class BytesSink:
    """A sink with one preallocated ``bytearray`` per tensor (the CLI's ``pull`` uses it)."""

    def __init__(self) -> None:
        self.manifest: AdapterManifest | None = None
        self.buffers: list[bytearray] = []
        self._views: list[memoryview] = []

    def begin(self, manifest: AdapterManifest) -> None:
        if self.manifest is None or self.manifest.adapter_id != manifest.adapter_id:
            self.manifest = manifest
            self.buffers = [bytearray(t.nbytes) for t in manifest.tensors]
            self._views = [memoryview(b) for b in self.buffers]

    def write(self, tensor_index: int, offset: int, data: bytes | memoryview) -> None:
        # Through a memoryview: a bytearray's own slice assignment copies anything that is not
        # a bytearray into a temporary one first, a second copy of every chunk.
        self._views[tensor_index][offset : offset + len(data)] = data

    def view(self, tensor_index: int) -> memoryview:
        return self._views[tensor_index]

    def verified(self, tensor_index: int) -> None:
        pass


class _StreamCall(Protocol):
    """What a unary-stream stub call returns: an iterator of replies that is also a grpc.Call."""

    def __iter__(self) -> Iterator[pb.WatchAdaptersResponse]: ...

    def cancel(self) -> bool: ...


class AdapterWatch:
    """An open WatchAdapters stream: iterate for its messages; :meth:`cancel` ends it (the
    iteration then raises Cancelled). Errors come as lorastream domain exceptions."""

    def __init__(self, call: _StreamCall) -> None:
        self._call = call

    def __iter__(self) -> Iterator[WatchMessage]:
        try:
            for message in self._call:
                yield codec.watch_message_from_pb(message)
        except grpc.RpcError as err:
            raise_from_rpc_error(err)

    def cancel(self) -> None:
        self._call.cancel()


class StoreClient:
    """Blocking client of ``AdapterStoreService``; raises lorastream domain exceptions."""

    def __init__(self, target: str, token: str | None = None, timeout: float = 30.0,
                 tls: ClientTLS | None = None) -> None:
        self.target = target
        self._channel = open_channel(target, tls, GRPC_OPTIONS)  # tls None: plaintext
        self._stub = pb_grpc.AdapterStoreServiceStub(self._channel)
        self._data_channel = open_channel(target, tls, STREAM_GRPC_OPTIONS)
        # The tensor stream is decoded by the codec: chunk payloads stay zero-copy views.
        self._stream_tensors = self._data_channel.unary_stream(
            _STREAM_METHOD,
            request_serializer=pb.StreamAdapterTensorsRequest.SerializeToString,
            response_deserializer=codec.decode_stream_response,
        )
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout

    def close(self) -> None:
        self._channel.close()
        self._data_channel.close()

    def __enter__(self) -> StoreClient:
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

    def push(
        self,
        source: str | Path | Sequence[tuple[str, FileContent]],
        name: str,
        *,
        pin: bool = False,
        force: bool = False,
        on_sent: SentCallback | None = None,
    ) -> AdapterManifest:
        """Upload a PEFT LoRA directory (or its files, as paths or bytes: config, weights and
        its tokenizer's if it ships one) as ``name``.

        The store validates and stages it like a preload from ``push://<name>``; the files are
        sent in chunks of at most 1 MiB (read from disk as they go), ``on_sent(done, total)``
        after each. Raises InvalidAdapter (bad files), AlreadyExists (``name`` staged from
        another source; pass ``force``), CapacityExhausted (larger than the store accepts).
        """
        files = (
            directory_files(Path(source)) if isinstance(source, (str, Path)) else list(source)
        )
        items = upload_items(name, files, pin=pin, force=force, on_sent=on_sent)
        try:
            reply = self._stub.UploadAdapter(
                (codec.upload_request_to_pb(item) for item in items), metadata=self._metadata
            )
        except grpc.RpcError as err:
            raise_from_rpc_error(err)
        return codec.manifest_from_pb(reply.manifest)

    def list(
        self, where: AdapterFilter = AdapterFilter()
    ) -> tuple[list[AdapterManifest], int, int]:
        """Every staged adapter matching ``where`` (all pages), with the cache's bytes used and
        budget."""
        adapters: list[AdapterManifest] = []
        used = budget = 0
        for page, page_used, page_budget in self.pages(where):
            adapters += page
            used, budget = page_used, page_budget  # the last page's figures
        return adapters, used, budget

    def pages(
        self, where: AdapterFilter = AdapterFilter(), page_size: int = 0, page_token: str = ""
    ) -> Iterator[tuple[builtins.list[AdapterManifest], int, int]]:
        """Staged adapters matching ``where`` a page at a time (0: the store's largest page),
        each with the cache's bytes used and budget; from ``page_token`` on (a page's last name:
        the names after it)."""
        token = page_token
        while True:
            request = codec.list_request_to_pb(where, token, page_size)
            reply = self._call(self._stub.ListAdapters, request)
            adapters = [codec.manifest_from_pb(m) for m in reply.adapters]
            yield adapters, reply.cache_bytes_used, reply.cache_bytes_budget
            token = reply.next_page_token
            if not token:
                return

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

    def history(self, name: str) -> builtins.list[AdapterVersion]:
        """``name``'s versions, newest first."""
        reply = self._call(self._stub.ListAdapterVersions,
                           pb.ListAdapterVersionsRequest(name=name))
        return [codec.version_from_pb(v) for v in reply.versions]

    def rollback(self, name: str, version: str = "") -> AdapterManifest:
        """Point ``name`` at an earlier version: ``vN``, a content id prefix, or "" (the content
        before its current one). Returns the name's new current manifest."""
        reply = self._call(self._stub.RollbackAdapter,
                           pb.RollbackAdapterRequest(name=name, version=version))
        return codec.manifest_from_pb(reply.manifest)

    # -- watch ------------------------------------------------------------------------------
    def watch(self, watcher: str) -> AdapterWatch:
        """Open a WatchAdapters stream: a snapshot of every name's current content id, then
        each change; acknowledge applied changes with :meth:`ack`."""
        return AdapterWatch(
            self._stub.WatchAdapters(pb.WatchAdaptersRequest(watcher=watcher),
                                     metadata=self._metadata)
        )

    def ack(self, watch_id: str, generation: int, timeout: float = 2.0) -> None:
        """Tell the store every change up to ``generation`` of the watch is applied."""
        try:
            self._stub.AckAdapterChanges(
                pb.AckAdapterChangesRequest(watch_id=watch_id, generation=generation),
                metadata=self._metadata, timeout=timeout,
            )
        except grpc.RpcError as err:
            raise_from_rpc_error(err)

    def _call(self, method: Callable[..., Any], request: Message) -> Any:
        try:
            return method(request, metadata=self._metadata, timeout=self._timeout)
        except grpc.RpcError as err:
            raise_from_rpc_error(err)

    def read_file(self, name: str, adapter_id: str, file: str) -> bytes:
        """One of the files ``name``'s manifest lists (at content ``adapter_id``), whole. The
        caller checks it against the manifest's sha256."""
        request = pb.ReadAdapterFileRequest(name=name, adapter_id=adapter_id, file=file)
        try:
            return b"".join(reply.data for reply in self._stub.ReadAdapterFile(
                request, metadata=self._metadata, timeout=self._timeout))
        except grpc.RpcError as err:
            raise_from_rpc_error(err)

    # -- tensor stream ----------------------------------------------------------------------
    def iter_chunks(self, name: str, *, chunk_bytes: int = 0) -> Iterator[TensorChunk]:
        """The raw chunk stream of ``name`` (CRC-32C checked, no landing, no resume)."""
        request = pb.StreamAdapterTensorsRequest(name=name, chunk_bytes=chunk_bytes)
        try:
            for item in self._stream_tensors(request, metadata=self._metadata):
                if isinstance(item, TensorChunk):
                    chunk = item
                    if crc32c(chunk.data) != chunk.crc32c:
                        raise InvalidAdapter(
                            f"CRC-32C mismatch in {name} tensor {chunk.tensor_index} at offset "
                            f"{chunk.offset}: the stream was corrupted in transit"
                        )
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
        layout: StreamLayout | None = None
        attempt = 0
        while True:
            request = pb.StreamAdapterTensorsRequest(
                name=name,
                adapter_id=manifest.adapter_id if manifest else "",
                start_tensor=position[0],
                start_offset=position[1],
                chunk_bytes=chunk_bytes,
                skip_chunk_crc=True,  # every tensor is checked against its digest instead
            )
            try:
                for item in self._stream_tensors(request, metadata=self._metadata):
                    if isinstance(item, AdapterManifest):
                        manifest = item
                        layout = StreamLayout(manifest)
                        sink.begin(manifest)
                        position = layout.position(layout.flat(*position))
                        continue
                    if manifest is None or layout is None:
                        raise InvalidAdapter(f"store sent a chunk of {name} before its manifest")
                    position = self._land_chunk(manifest, layout, sink, item, position)
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
        layout: StreamLayout,
        sink: TensorSink,
        chunk: TensorChunk,
        position: tuple[int, int],
    ) -> tuple[int, int]:
        """Check ``chunk``'s place, write its pieces into ``sink``; return the next expected
        position.

        A tensor's digest (the manifest's fast checksum, else its sha256) is checked as soon as
        its last byte landed, then ``sink.verified`` is called. That covers every byte end to
        end, from the store's staging to this buffer, so the stream asks for no per-chunk
        CRC-32C: one pass over the bytes less on each end (a store from before
        ``skip_chunk_crc`` still sends it; it goes unread).
        """
        if (chunk.tensor_index, chunk.offset) != position:
            raise InvalidAdapter(
                f"store sent {manifest.name} tensor {chunk.tensor_index} offset {chunk.offset}, "
                f"expected {position}"
            )
        try:
            pieces = list(layout.split(chunk.tensor_index, chunk.offset, chunk.data))
        except ValueError as err:
            raise InvalidAdapter(f"store sent a bad chunk of {manifest.name}: {err}") from err
        for index, offset, data in pieces:
            sink.write(index, offset, data)
            info = manifest.tensors[index]
            if offset + len(data) == info.nbytes:
                ok, algorithm = verify_tensor(sink.view(index), info.checksum, info.fast_checksum)
                if not ok:
                    raise InvalidAdapter(
                        f"{algorithm} mismatch for {manifest.name} tensor {info.name}: the bytes "
                        "received differ from those the store staged (damaged in transit or on "
                        "the store's disk); retry, and if it fails again delete and preload it "
                        "again"
                    )
                sink.verified(index)
        return layout.position(layout.flat(chunk.tensor_index, chunk.offset) + len(chunk.data))
