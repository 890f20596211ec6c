"""The one codec between protobuf messages and lorastream's plain types: the store's and the
shared messages here, the GPU worker's API in :mod:`lorastream.core.worker_codec`.

Servicers and clients call these functions; nothing else in the code base touches protobuf types.
"""

from __future__ import annotations

import dataclasses

from lorastream.adapter_store.v1 import adapter_store_pb2 as store_pb2
from lorastream.common.v1 import common_pb2
from lorastream.core.chunk_wire import encode_chunk_response as encode_chunk_response
from lorastream.core.chunk_wire import fields
from lorastream.core.chunk_wire import serialize_response as serialize_response
from lorastream.core.errors import InvalidArgument
from lorastream.core.listing import MAX_PAGE_SIZE, AdapterFilter
from lorastream.core.manifest import (
    AdapterFile,
    AdapterManifest,
    PreloadProgress,
    TensorChunk,
    TensorInfo,
)
from lorastream.core.upload import UploadChunk, UploadFile, UploadHeader, UploadItem
from lorastream.core.versions import AdapterChange, AdapterVersion, ChangeKind, WatchMessage

_DTYPE_TO_PB = {
    "F32": common_pb2.DTYPE_FLOAT32,
    "F16": common_pb2.DTYPE_FLOAT16,
    "BF16": common_pb2.DTYPE_BFLOAT16,
}
_DTYPE_FROM_PB = {v: k for k, v in _DTYPE_TO_PB.items()}

_PHASE_TO_PB = {
    "resolving": store_pb2.PRELOAD_PHASE_RESOLVING,
    "downloading": store_pb2.PRELOAD_PHASE_DOWNLOADING,
    "validating": store_pb2.PRELOAD_PHASE_VALIDATING,
    "staging": store_pb2.PRELOAD_PHASE_STAGING,
    "done": store_pb2.PRELOAD_PHASE_DONE,
}
_PHASE_FROM_PB = {v: k for k, v in _PHASE_TO_PB.items()}


def tensor_info_to_pb(info: TensorInfo) -> common_pb2.TensorInfo:
    return common_pb2.TensorInfo(
        name=info.name,
        dtype=_DTYPE_TO_PB[info.dtype],
        shape=list(info.shape),
        nbytes=info.nbytes,
        checksum=info.checksum,
        fast_checksum=info.fast_checksum,
    )


def tensor_info_from_pb(msg: common_pb2.TensorInfo) -> TensorInfo:
    return TensorInfo(
        name=msg.name,
        dtype=_DTYPE_FROM_PB[msg.dtype],
        shape=tuple(msg.shape),
        nbytes=msg.nbytes,
        checksum=msg.checksum,
        fast_checksum=msg.fast_checksum,
    )


def manifest_to_pb(m: AdapterManifest) -> common_pb2.AdapterManifest:
    return common_pb2.AdapterManifest(
        adapter_id=m.adapter_id,
        name=m.name,
        source_uri=m.source_uri,
        revision=m.revision,
        base_model=m.base_model,
        rank=m.rank,
        alpha=m.alpha,
        use_rslora=m.use_rslora,
        target_modules=list(m.target_modules),
        tensors=[tensor_info_to_pb(t) for t in m.tensors],
        total_bytes=m.total_bytes,
        created_at=m.created_at,
        pinned=m.pinned,
        last_used_at=m.last_used_at,
        alora_invocation_tokens=list(m.alora_invocation_tokens),
        token_indices=list(m.token_indices),
        files=[common_pb2.AdapterFile(name=f.name, nbytes=f.nbytes, checksum=f.checksum)
               for f in m.files],
        tokenizer_vocab=m.tokenizer_vocab,
        rank_pattern=[common_pb2.ModulePattern(pattern=k, value=v) for k, v in m.rank_pattern],
        alpha_pattern=[common_pb2.ModulePattern(pattern=k, value=v) for k, v in m.alpha_pattern],
        default_rank=m.default_rank,
    )


def manifest_from_pb(msg: common_pb2.AdapterManifest) -> AdapterManifest:
    return AdapterManifest(
        adapter_id=msg.adapter_id,
        name=msg.name,
        source_uri=msg.source_uri,
        revision=msg.revision,
        base_model=msg.base_model,
        rank=msg.rank,
        alpha=msg.alpha,
        use_rslora=msg.use_rslora,
        target_modules=tuple(msg.target_modules),
        tensors=tuple(tensor_info_from_pb(t) for t in msg.tensors),
        created_at=msg.created_at,
        pinned=msg.pinned,
        last_used_at=msg.last_used_at,
        alora_invocation_tokens=tuple(msg.alora_invocation_tokens),
        token_indices=tuple(msg.token_indices),
        files=tuple(AdapterFile(f.name, f.nbytes, f.checksum) for f in msg.files),
        tokenizer_vocab=msg.tokenizer_vocab,
        rank_pattern=tuple((p.pattern, p.value) for p in msg.rank_pattern),
        alpha_pattern=tuple((p.pattern, p.value) for p in msg.alpha_pattern),
        default_rank=msg.default_rank,
    )


def progress_to_pb(p: PreloadProgress) -> store_pb2.PreloadAdapterResponse:
    msg = store_pb2.PreloadAdapterResponse(
        phase=_PHASE_TO_PB.get(p.phase, store_pb2.PRELOAD_PHASE_UNSPECIFIED),
        bytes_done=p.bytes_done,
        bytes_total=p.bytes_total,
        message=p.message,
    )
    if p.manifest is not None:
        msg.manifest.CopyFrom(manifest_to_pb(p.manifest))
    return msg


def progress_from_pb(msg: store_pb2.PreloadAdapterResponse) -> PreloadProgress:
    return PreloadProgress(
        phase=_PHASE_FROM_PB.get(msg.phase, "unspecified"),
        bytes_done=msg.bytes_done,
        bytes_total=msg.bytes_total,
        message=msg.message,
        manifest=manifest_from_pb(msg.manifest) if msg.HasField("manifest") else None,
    )


def chunk_to_pb(chunk: TensorChunk) -> store_pb2.StreamAdapterTensorsResponse:
    return store_pb2.StreamAdapterTensorsResponse(
        chunk=store_pb2.TensorChunk(
            tensor_index=chunk.tensor_index,
            offset=chunk.offset,
            data=bytes(chunk.data),
            crc32c=chunk.crc32c,
        )
    )


def chunk_from_pb(msg: store_pb2.TensorChunk) -> TensorChunk:
    return TensorChunk(
        tensor_index=msg.tensor_index, offset=msg.offset, data=msg.data, crc32c=msg.crc32c
    )


def upload_request_to_pb(item: UploadItem) -> store_pb2.UploadAdapterRequest:
    if isinstance(item, UploadHeader):
        return store_pb2.UploadAdapterRequest(
            header=store_pb2.UploadHeader(
                name=item.name,
                pin=item.pin,
                force=item.force,
                files=[store_pb2.UploadFile(path=f.path, size=f.size) for f in item.files],
            )
        )
    return store_pb2.UploadAdapterRequest(
        chunk=store_pb2.UploadChunk(
            file_index=item.file_index, offset=item.offset, data=bytes(item.data),
            crc32c=item.crc32c,
        )
    )


def upload_request_from_pb(msg: store_pb2.UploadAdapterRequest) -> UploadItem:
    """The header or chunk an upload message holds; InvalidArgument when it holds neither."""
    kind = msg.WhichOneof("payload")
    if kind == "header":
        h = msg.header
        return UploadHeader(
            name=h.name,
            pin=h.pin,
            force=h.force,
            files=tuple(UploadFile(path=f.path, size=f.size) for f in h.files),
        )
    if kind == "chunk":
        c = msg.chunk
        return UploadChunk(
            file_index=c.file_index, offset=c.offset, data=c.data, crc32c=c.crc32c
        )
    raise InvalidArgument("an upload message holds neither a header nor a chunk")


# -- the chunk response on the wire (encoding: chunk_wire.py) ------------------------------
def decode_stream_response(raw: bytes) -> AdapterManifest | TensorChunk:
    """Parse one ``StreamAdapterTensorsResponse``: the manifest, or a chunk whose ``data`` is a
    zero-copy view into ``raw`` (the protobuf runtime would copy the payload twice)."""
    view = memoryview(raw)
    payload: tuple[int, memoryview] | None = None
    for field, value in fields(view):
        if field in (1, 2) and isinstance(value, memoryview):
            payload = (field, value)  # a oneof: the last one wins, as in protobuf
    if payload is None:
        raise ValueError("stream response holds neither a manifest nor a chunk")
    if payload[0] == 1:
        return manifest_from_pb(common_pb2.AdapterManifest.FromString(payload[1].tobytes()))
    index = offset = crc = 0
    data: memoryview = view[0:0]
    for field, value in fields(payload[1]):
        if field == 1 and isinstance(value, int):
            index = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 2 and isinstance(value, int):
            offset = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 3 and isinstance(value, memoryview):
            data = value
        elif field == 4 and isinstance(value, int):
            crc = value & 0xFFFFFFFF
    return TensorChunk(index, offset, data, crc)


# -- listings -------------------------------------------------------------------------------------
_PINNED_TO_PB = {
    None: store_pb2.PINNED_FILTER_UNSPECIFIED,
    True: store_pb2.PINNED_FILTER_PINNED,
    False: store_pb2.PINNED_FILTER_UNPINNED,
}
_PINNED_FROM_PB = {v: k for k, v in _PINNED_TO_PB.items()}


def list_request_to_pb(
    where: AdapterFilter, page_token: str = "", page_size: int = 0
) -> store_pb2.ListAdaptersRequest:
    return store_pb2.ListAdaptersRequest(
        page_size=page_size, page_token=page_token, name_prefix=where.prefix,
        pinned=_PINNED_TO_PB[where.pinned], source_prefix=where.source_prefix,
    )


def list_request_from_pb(msg: store_pb2.ListAdaptersRequest) -> tuple[AdapterFilter, str, int]:
    """(filter, the name after which the page starts, page size capped at MAX_PAGE_SIZE)."""
    if msg.page_size < 0:
        raise InvalidArgument(f"page_size must be >= 0, got {msg.page_size}")
    if msg.pinned not in _PINNED_FROM_PB:
        raise InvalidArgument(f"unknown pinned filter {msg.pinned}")
    where = AdapterFilter(
        prefix=msg.name_prefix, pinned=_PINNED_FROM_PB[msg.pinned],
        source_prefix=msg.source_prefix,
    )
    return where, msg.page_token, min(msg.page_size or MAX_PAGE_SIZE, MAX_PAGE_SIZE)


# -- versions and the watch (lorastream/core/versions.py) ---------------------------------------
_CHANGE_TO_PB = {
    ChangeKind.PUT: store_pb2.ADAPTER_CHANGE_KIND_PUT,
    ChangeKind.VERSION: store_pb2.ADAPTER_CHANGE_KIND_VERSION,
    ChangeKind.DELETE: store_pb2.ADAPTER_CHANGE_KIND_DELETE,
}
_CHANGE_FROM_PB = {v: k for k, v in _CHANGE_TO_PB.items()}


def version_to_pb(v: AdapterVersion) -> store_pb2.AdapterVersion:
    return store_pb2.AdapterVersion(**dataclasses.asdict(v))


def version_from_pb(msg: store_pb2.AdapterVersion) -> AdapterVersion:
    return AdapterVersion(
        **{f.name: getattr(msg, f.name) for f in dataclasses.fields(AdapterVersion)}
    )


def watch_message_to_pb(m: WatchMessage) -> store_pb2.WatchAdaptersResponse:
    return store_pb2.WatchAdaptersResponse(
        watch_id=m.watch_id, generation=m.generation, snapshot=m.snapshot,
        snapshot_done=m.snapshot_done,
        changes=[
            store_pb2.AdapterChange(kind=_CHANGE_TO_PB[c.kind], name=c.name,
                                    adapter_id=c.adapter_id, version=c.version)
            for c in m.changes
        ],
    )


def watch_message_from_pb(msg: store_pb2.WatchAdaptersResponse) -> WatchMessage:
    """InvalidArgument on a change kind this version does not know (a newer store)."""
    unknown = [c.kind for c in msg.changes if c.kind not in _CHANGE_FROM_PB]
    if unknown:
        raise InvalidArgument(f"the store sent an adapter change of unknown kind {unknown[0]}")
    return WatchMessage(
        watch_id=msg.watch_id, generation=msg.generation, snapshot=msg.snapshot,
        snapshot_done=msg.snapshot_done,
        changes=tuple(
            AdapterChange(_CHANGE_FROM_PB[c.kind], c.name, c.adapter_id, c.version)
            for c in msg.changes
        ),
    )
