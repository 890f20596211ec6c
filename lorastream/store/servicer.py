"""Thin gRPC servicer: convert the request, call :class:`AdapterStore`, convert the reply."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from lorastream.adapter_store.v1 import adapter_store_pb2 as pb
from lorastream.adapter_store.v1 import adapter_store_pb2_grpc as pb_grpc
from lorastream.core import codec
from lorastream.core.auth import Scope
from lorastream.core.errors import Cancelled, InvalidArgument
from lorastream.core.manifest import PreloadProgress
from lorastream.core.upload import UploadChunk, UploadHeader
from lorastream.core.versions import parse_version
from lorastream.store.egress import EgressLimiter
from lorastream.store.store import AdapterStore

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["AdapterStoreService"]
SERVICE_NAME = SERVICE.full_name
OPERATOR_METHODS = {
    f"/{SERVICE_NAME}/{m}"
    for m in ("PreloadAdapter", "UploadAdapter", "DeleteAdapter", "PinAdapter", "UnpinAdapter",
              "RollbackAdapter")
}
READ_METHODS = {
    f"/{SERVICE_NAME}/{m}"
    for m in ("ListAdapters", "DescribeAdapter", "StreamAdapterTensors", "ListAdapterVersions",
              "WatchAdapters", "AckAdapterChanges", "ReadAdapterFile")
}
# The scope each method needs when the store has tokens (lorastream/core/auth.py).
REQUIRED_SCOPES = {
    **{method: Scope.OPERATE for method in OPERATOR_METHODS},
    **{method: Scope.READ for method in READ_METHODS},
}


class AdapterStoreServicer(pb_grpc.AdapterStoreServiceServicer):
    def __init__(
        self,
        store: AdapterStore,
        default_chunk_bytes: int,
        chunk_delay_s: float = 0.0,
        egress: EgressLimiter | None = None,
    ) -> None:
        self._store = store
        self._chunk_bytes = default_chunk_bytes
        self._chunk_delay_s = chunk_delay_s  # test hook (StoreSettings.stream_chunk_delay_s)
        self._egress = egress  # StoreSettings.egress_limit_mbps

    def PreloadAdapter(
        self, request: pb.PreloadAdapterRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PreloadAdapterResponse]:
        # The preload runs on its own thread so progress events stream while it works.
        events: queue.Queue[PreloadProgress | BaseException | None] = queue.Queue()

        def run() -> None:
            try:
                self._store.preload(
                    request.source_uri,
                    request.name,
                    pin=request.pin,
                    force=request.force,
                    progress=events.put,
                )
                events.put(None)
            except BaseException as exc:
                events.put(exc)

        threading.Thread(target=run, name=f"preload-{request.name}", daemon=True).start()
        while (event := events.get()) is not None:
            if isinstance(event, BaseException):
                raise event
            yield codec.progress_to_pb(event)

    def UploadAdapter(
        self, request_iterator: Iterator[pb.UploadAdapterRequest], context: grpc.ServicerContext
    ) -> pb.UploadAdapterResponse:
        try:
            first = next(request_iterator, pb.UploadAdapterRequest())
        except grpc.RpcError as err:
            raise Cancelled("a push was cancelled by the client before its header") from err
        header = codec.upload_request_from_pb(first)
        if not isinstance(header, UploadHeader):
            raise InvalidArgument("an upload must begin with its header (name and files)")
        manifest = self._store.push(header, _upload_chunks(request_iterator, header.name))
        return pb.UploadAdapterResponse(manifest=codec.manifest_to_pb(manifest))

    def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext
    ) -> pb.ListAdaptersResponse:
        where, after, page_size = codec.list_request_from_pb(request)
        page = self._store.list(where, after, page_size + 1)  # one more: is there a next page?
        more = len(page) > page_size
        page = page[:page_size]
        return pb.ListAdaptersResponse(
            adapters=[codec.manifest_to_pb(m) for m in page],
            cache_bytes_used=self._store.bytes_used,
            cache_bytes_budget=self._store.bytes_budget,
            next_page_token=page[-1].name if more else "",
            total_size=self._store.count(where),
        )

    def DescribeAdapter(
        self, request: pb.DescribeAdapterRequest, context: grpc.ServicerContext
    ) -> pb.DescribeAdapterResponse:
        return pb.DescribeAdapterResponse(
            manifest=codec.manifest_to_pb(self._store.describe(request.name))
        )

    def DeleteAdapter(
        self, request: pb.DeleteAdapterRequest, context: grpc.ServicerContext
    ) -> pb.DeleteAdapterResponse:
        self._store.delete(request.name)
        return pb.DeleteAdapterResponse()

    def PinAdapter(
        self, request: pb.PinAdapterRequest, context: grpc.ServicerContext
    ) -> pb.PinAdapterResponse:
        return pb.PinAdapterResponse(manifest=codec.manifest_to_pb(self._store.pin(request.name)))

    def UnpinAdapter(
        self, request: pb.UnpinAdapterRequest, context: grpc.ServicerContext
    ) -> pb.UnpinAdapterResponse:
        return pb.UnpinAdapterResponse(
            manifest=codec.manifest_to_pb(self._store.unpin(request.name))
        )

    def ListAdapterVersions(
        self, request: pb.ListAdapterVersionsRequest, context: grpc.ServicerContext
    ) -> pb.ListAdapterVersionsResponse:
        return pb.ListAdapterVersionsResponse(
            versions=[codec.version_to_pb(v) for v in self._store.history(request.name)]
        )

    def RollbackAdapter(
        self, request: pb.RollbackAdapterRequest, context: grpc.ServicerContext
    ) -> pb.RollbackAdapterResponse:
        manifest = self._store.rollback(request.name, parse_version(request.version))
        return pb.RollbackAdapterResponse(manifest=codec.manifest_to_pb(manifest))

    def WatchAdapters(
        self, request: pb.WatchAdaptersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchAdaptersResponse]:
        # Holds one server thread for as long as the watcher stays (--max-workers counts it).
        label = request.watcher or context.peer()
        for message in self._store.watch(label, context.is_active):
            yield codec.watch_message_to_pb(message)

    def AckAdapterChanges(
        self, request: pb.AckAdapterChangesRequest, context: grpc.ServicerContext
    ) -> pb.AckAdapterChangesResponse:
        self._store.ack(request.watch_id, request.generation)
        return pb.AckAdapterChangesResponse()

    def StreamAdapterTensors(
        self, request: pb.StreamAdapterTensorsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StreamAdapterTensorsResponse | bytes]:
        # Chunks go out pre-encoded (codec.encode_chunk_response): same wire bytes, fewer copies.
        chunk_bytes = request.chunk_bytes or self._chunk_bytes
        with self._store.open_stream(request.name, request.adapter_id or None) as lease:
            self._store.metrics.stream_opened()
            yield pb.StreamAdapterTensorsResponse(manifest=codec.manifest_to_pb(lease.manifest))
            chunks = lease.chunks(request.start_tensor, request.start_offset, chunk_bytes,
                                  with_crc=not request.skip_chunk_crc)
            for chunk in chunks:
                if self._chunk_delay_s:
                    time.sleep(self._chunk_delay_s)
                if self._egress is not None:
                    self._egress.acquire(len(chunk.data))
                if not context.is_active():
                    log.info("stream of %s cancelled by the client", request.name)
                    return
                self._store.metrics.streamed(len(chunk.data))
                yield codec.encode_chunk_response(chunk)

    def ReadAdapterFile(
        self, request: pb.ReadAdapterFileRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.ReadAdapterFileResponse]:
        with self._store.open_stream(request.name, request.adapter_id or None) as lease:
            for data in lease.file_chunks(request.file, self._chunk_bytes):
                if not context.is_active():
                    return
                self._store.metrics.streamed(len(data))
                yield pb.ReadAdapterFileResponse(data=data)


def _upload_chunks(requests: Iterator[pb.UploadAdapterRequest], name: str) -> Iterator[UploadChunk]:
    """The chunks after an upload's header; Cancelled when the client goes away mid-stream."""
    try:
        for request in requests:
            item = codec.upload_request_from_pb(request)
            if not isinstance(item, UploadChunk):
                raise InvalidArgument(f"push of {name}: a second header arrived mid-upload")
            yield item
    except grpc.RpcError as err:
        raise Cancelled(f"push of {name} was cancelled by the client; nothing was staged") from err
