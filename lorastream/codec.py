"""The one codec between protobuf messages and lorastream's plain types.

Servicers and clients call these functions; nothing else in the code base touches protobuf types.
"""

from __future__ import annotations

from lorastream.adapter_store.v1 import adapter_store_pb2 as store_pb2
from lorastream.common.v1 import common_pb2
from lorastream.manifest import AdapterManifest, PreloadProgress, TensorChunk, TensorInfo

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
    )


def tensor_info_from_pb(msg: common_pb2.TensorInfo) -> TensorInfo:
    return TensorInfo(
        name=msg.name,
        dtype=_DTYPE_FROM_PB[msg.dtype],
        shape=tuple(msg.shape),
        nbytes=msg.nbytes,
        checksum=msg.checksum,
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
            crc32=chunk.crc32,
        )
    )


def chunk_from_pb(msg: store_pb2.TensorChunk) -> TensorChunk:
    return TensorChunk(
        tensor_index=msg.tensor_index, offset=msg.offset, data=msg.data, crc32=msg.crc32
    )
