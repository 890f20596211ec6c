"""The codec of the GPU worker's API: its protobuf messages to and from lorastream's plain types.

The store's and the shared messages are in :mod:`lorastream.core.codec`; together they are the one
codec: servicers and clients call these functions, nothing else touches protobuf types.
"""

from __future__ import annotations

import dataclasses

from lorastream.core.adapter_fit import BaseShape
from lorastream.core.adapter_mix import MixSpec
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
from lorastream.core.structured import StructuredKind, StructuredOutput
from lorastream.core.tokenization import Tokenized, TokenizeInput
from lorastream.gpu_worker.v1 import gpu_worker_pb2 as worker_pb2

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
    model: str, prompt: PromptInput, params: SamplingParams, request_id: str = "",
    mix: MixSpec = (),
) -> worker_pb2.GenerateRequest:
    msg = worker_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling=sampling_to_pb(params),
        mix=[worker_pb2.MixComponent(name=name, weight=weight) for name, weight in mix],
    )
    if prompt.token_ids is not None:
        msg.prompt_token_ids.ids.extend(prompt.token_ids)
    elif prompt.messages is not None:
        msg.messages.CopyFrom(_chat_to_pb(prompt))
    else:
        msg.prompt = prompt.text or ""
    return msg


def _chat_to_pb(prompt: PromptInput) -> worker_pb2.ChatMessages:
    extras = prompt.message_extras or ("",) * len(prompt.messages or ())
    return worker_pb2.ChatMessages(
        messages=[
            worker_pb2.ChatMessage(role=role, content=content, extra_json=extra)
            for (role, content), extra in zip(prompt.messages or (), extras, strict=True)
        ],
        tools_json=prompt.tools,
    )


def _chat_from_pb(msg: worker_pb2.ChatMessages) -> PromptInput:
    extras = tuple(m.extra_json for m in msg.messages)
    return PromptInput(
        messages=tuple((m.role, m.content) for m in msg.messages),
        message_extras=extras if any(extras) else (),
        tools=msg.tools_json,
    )


def generate_request_from_pb(
    msg: worker_pb2.GenerateRequest,
) -> tuple[str, str, PromptInput, SamplingParams, MixSpec]:
    """(request_id, model, prompt, sampling, mix) of a Generate call."""
    kind = msg.WhichOneof("input")
    if kind == "prompt_token_ids":
        prompt = PromptInput(token_ids=tuple(msg.prompt_token_ids.ids))
    elif kind == "messages":
        prompt = _chat_from_pb(msg.messages)
    else:
        prompt = PromptInput(text=msg.prompt)
    mix = tuple((c.name, c.weight) for c in msg.mix)
    return msg.request_id, msg.model, prompt, sampling_from_pb(msg.sampling), mix


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
        cached_tokens=e.cached_tokens,
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
        cached_tokens=msg.cached_tokens,
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


def adapter_list_to_pb(
    statuses: list[AdapterStatus], base_model: str, base: BaseShape
) -> worker_pb2.ListAdaptersResponse:
    return worker_pb2.ListAdaptersResponse(
        adapters=[adapter_status_to_pb(s) for s in statuses],
        base_model=base_model,
        num_layers=base.num_layers,
        adaptable_modules=[
            worker_pb2.AdaptableModule(name=name, in_features=fan_in, out_features=fan_out)
            for name, (fan_in, fan_out) in base.modules.items()
        ],
    )


def adapter_list_from_pb(
    msg: worker_pb2.ListAdaptersResponse,
) -> tuple[list[AdapterStatus], str, BaseShape]:
    """The worker's adapters, its base model's served name and what an adapter must match."""
    modules = {m.name: (m.in_features, m.out_features) for m in msg.adaptable_modules}
    return ([adapter_status_from_pb(a) for a in msg.adapters], msg.base_model,
            BaseShape(msg.num_layers, modules))


def stats_to_pb(s: WorkerStats) -> worker_pb2.GetStatsResponse:
    return worker_pb2.GetStatsResponse(**dataclasses.asdict(s))


def stats_from_pb(msg: worker_pb2.GetStatsResponse) -> WorkerStats:
    return WorkerStats(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(WorkerStats)})


# -- tokenize / detokenize ------------------------------------------------------------------------
def tokenize_request_to_pb(t: TokenizeInput) -> worker_pb2.TokenizeRequest:
    msg = worker_pb2.TokenizeRequest(
        add_generation_prompt=t.add_generation_prompt, add_special_tokens=t.add_special_tokens,
        return_token_strs=t.return_token_strs, model=t.model,
    )
    if t.prompt.messages is not None:
        msg.messages.CopyFrom(_chat_to_pb(t.prompt))
    else:
        msg.prompt = t.prompt.text or ""
    return msg


def tokenize_request_from_pb(msg: worker_pb2.TokenizeRequest) -> TokenizeInput:
    if msg.WhichOneof("input") == "messages":
        prompt = _chat_from_pb(msg.messages)
    else:
        prompt = PromptInput(text=msg.prompt)
    return TokenizeInput(prompt, msg.add_generation_prompt, msg.add_special_tokens,
                         msg.return_token_strs, msg.model)


def tokenized_to_pb(t: Tokenized) -> worker_pb2.TokenizeResponse:
    return worker_pb2.TokenizeResponse(tokens=list(t.tokens), max_model_len=t.max_model_len,
                                       token_strs=list(t.token_strs or ()))


def tokenized_from_pb(msg: worker_pb2.TokenizeResponse, with_strs: bool) -> Tokenized:
    strs = tuple(msg.token_strs) if with_strs else None
    return Tokenized(tuple(msg.tokens), msg.max_model_len, strs)
