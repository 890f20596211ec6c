"""The one codec between protobuf messages and lorastream's plain types.

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
from lorastream.core.generation import (
    AdapterStatus,
    FinishReason,
    GenerationEvent,
    PromptInput,
    SamplingParams,
    TokenLogprobs,
    TopLogprob,
    WorkerStats,
)
from lorastream.core.listing import MAX_PAGE_SIZE, AdapterFilter
from lorastream.core.manifest import AdapterManifest, PreloadProgress, TensorChunk, TensorInfo
from lorastream.core.structured import StructuredKind, StructuredOutput
from lorastream.core.tokenization import TokenizeInput, Tokenized
from lorastream.core.upload import UploadChunk, UploadFile, UploadHeader, UploadItem
from lorastream.core.versions import AdapterChange, AdapterVersion, ChangeKind, WatchMessage
from lorastream.gpu_worker.v1 import gpu_worker_pb2 as worker_pb2

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


# -- the GPU worker's API -------------------------------------------------------------------
_FINISH_TO_PB = {
    FinishReason.STOP: worker_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: worker_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: worker_pb2.FINISH_REASON_CANCELLED,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_RESIDENCY_TO_PB = {
    "remote": worker_pb2.RESIDENCY_REMOTE,
    "loading": worker_pb2.RESIDENCY_LOADING,
    "host": worker_pb2.RESIDENCY_HOST,
    "device": worker_pb2.RESIDENCY_DEVICE,
}
_RESIDENCY_FROM_PB = {v: k for k, v in _RESIDENCY_TO_PB.items()}


def sampling_to_pb(p: SamplingParams) -> worker_pb2.SamplingParams:
    msg = worker_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logit_bias=dict(p.logit_bias),
        min_tokens=p.min_tokens,
        n=p.n,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.max_tokens:  # 0 in the plain type: the server's default, sent as unset
        msg.max_tokens = p.max_tokens
    if p.structured is not None:
        msg.structured.CopyFrom(worker_pb2.StructuredOutput(
            kind=_STRUCTURED_TO_PB[p.structured.kind], spec=p.structured.spec,
            param=p.structured.param,
        ))
    return msg


_STRUCTURED_TO_PB = {
    StructuredKind.JSON_SCHEMA: worker_pb2.STRUCTURED_KIND_JSON_SCHEMA,
    StructuredKind.REGEX: worker_pb2.STRUCTURED_KIND_REGEX,
    StructuredKind.GRAMMAR: worker_pb2.STRUCTURED_KIND_GRAMMAR,
}
_STRUCTURED_FROM_PB = {v: k for k, v in _STRUCTURED_TO_PB.items()}


def structured_from_pb(msg: worker_pb2.StructuredOutput) -> StructuredOutput:
    param = msg.param or "structured"
    if msg.kind not in _STRUCTURED_FROM_PB:
        raise InvalidArgument(
            f"{param}: the constraint's kind is unset or unknown ({msg.kind}); set "
            "json_schema, regex or grammar"
        )
    return StructuredOutput(_STRUCTURED_FROM_PB[msg.kind], msg.spec, param)


def sampling_from_pb(msg: worker_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults mean "unset": max_tokens unset -> 0 (the server's default), top_p 0 -> 1,
    repetition_penalty 0 -> 1, n 0 -> 1.

    An explicit ``max_tokens`` below 1 is refused here, at the edge: read as "unset" it would
    generate the server's default number of tokens for a client that asked for none.
    """
    if msg.HasField("max_tokens") and msg.max_tokens < 1:
        raise InvalidArgument(
            f"max_tokens must be >= 1, got {msg.max_tokens}; leave it unset for the server's "
            "default"
        )
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=msg.top_k,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        n=msg.n or 1,
        structured=structured_from_pb(msg.structured) if msg.HasField("structured") else None,
    )


def generate_request_to_pb(
    model: str, prompt: PromptInput, params: SamplingParams, request_id: str = ""
) -> worker_pb2.GenerateRequest:
    msg = worker_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling=sampling_to_pb(params)
    )
    if prompt.token_ids is not None:
        msg.prompt_token_ids.ids.extend(prompt.token_ids)
    elif prompt.messages is not None:
        msg.messages.messages.extend(
            worker_pb2.ChatMessage(role=role, content=content) for role, content in prompt.messages
        )
    else:
        msg.prompt = prompt.text or ""
    return msg


def generate_request_from_pb(
    msg: worker_pb2.GenerateRequest,
) -> tuple[str, str, PromptInput, SamplingParams]:
    """(request_id, model, prompt, sampling) of a Generate call."""
    kind = msg.WhichOneof("input")
    if kind == "prompt_token_ids":
        prompt = PromptInput(token_ids=tuple(msg.prompt_token_ids.ids))
    elif kind == "messages":
        prompt = PromptInput(
            messages=tuple((m.role, m.content) for m in msg.messages.messages)
        )
    else:
        prompt = PromptInput(text=msg.prompt)
    return msg.request_id, msg.model, prompt, sampling_from_pb(msg.sampling)


def event_to_pb(e: GenerationEvent) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        token_ids=list(e.token_ids),
        text=e.text,
        finish_reason=(
            _FINISH_TO_PB[e.finish_reason]
            if e.finish_reason is not None
            else worker_pb2.FINISH_REASON_UNSPECIFIED
        ),
        prompt_tokens=e.prompt_tokens,
        completion_tokens=e.completion_tokens,
        logprobs=[
            worker_pb2.TokenLogprobs(
                token_id=lp.token_id, token=lp.token, logprob=lp.logprob,
                top=[worker_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)
                     for t in lp.top],
            )
            for lp in e.logprobs
        ],
        index=e.index,
    )


def event_from_pb(msg: worker_pb2.GenerateResponse) -> GenerationEvent:
    return GenerationEvent(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        finish_reason=_FINISH_FROM_PB.get(msg.finish_reason),
        logprobs=tuple(
            TokenLogprobs(
                lp.token_id, lp.token, lp.logprob,
                tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in lp.top),
            )
            for lp in msg.logprobs
        ),
        index=msg.index,
    )


def adapter_status_to_pb(s: AdapterStatus) -> worker_pb2.AdapterStatus:
    return worker_pb2.AdapterStatus(
        name=s.name,
        adapter_id=s.adapter_id,
        residency=_RESIDENCY_TO_PB.get(s.residency, worker_pb2.RESIDENCY_UNSPECIFIED),
        rank=s.rank,
        nbytes=s.nbytes,
        pinned=s.pinned,
        references=s.references,
        slot=s.slot,
    )


def adapter_status_from_pb(msg: worker_pb2.AdapterStatus) -> AdapterStatus:
    return AdapterStatus(
        name=msg.name,
        adapter_id=msg.adapter_id,
        residency=_RESIDENCY_FROM_PB.get(msg.residency, "unspecified"),
        rank=msg.rank,
        nbytes=msg.nbytes,
        pinned=msg.pinned,
        references=msg.references,
        slot=msg.slot,
    )


def stats_to_pb(s: WorkerStats) -> worker_pb2.GetStatsResponse:
    return worker_pb2.GetStatsResponse(**dataclasses.asdict(s))


def stats_from_pb(msg: worker_pb2.GetStatsResponse) -> WorkerStats:
    return WorkerStats(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(WorkerStats)})


# -- tokenize / detokenize ------------------------------------------------------------------------
def tokenize_request_to_pb(t: TokenizeInput) -> worker_pb2.TokenizeRequest:
    msg = worker_pb2.TokenizeRequest(
        add_generation_prompt=t.add_generation_prompt, add_special_tokens=t.add_special_tokens,
        return_token_strs=t.return_token_strs,
    )
    if t.prompt.messages is not None:
        msg.messages.messages.extend(
            worker_pb2.ChatMessage(role=r, content=c) for r, c in t.prompt.messages
        )
    else:
        msg.prompt = t.prompt.text or ""
    return msg


def tokenize_request_from_pb(msg: worker_pb2.TokenizeRequest) -> TokenizeInput:
    if msg.WhichOneof("input") == "messages":
        prompt = PromptInput(messages=tuple((m.role, m.content) for m in msg.messages.messages))
    else:
        prompt = PromptInput(text=msg.prompt)
    return TokenizeInput(prompt, msg.add_generation_prompt, msg.add_special_tokens,
                         msg.return_token_strs)


def tokenized_to_pb(t: Tokenized) -> worker_pb2.TokenizeResponse:
    return worker_pb2.TokenizeResponse(tokens=list(t.tokens), max_model_len=t.max_model_len,
                                       token_strs=list(t.token_strs or ()))


def tokenized_from_pb(msg: worker_pb2.TokenizeResponse, with_strs: bool) -> Tokenized:
    strs = tuple(msg.token_strs) if with_strs else None
    return Tokenized(tuple(msg.tokens), msg.max_model_len, strs)


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
