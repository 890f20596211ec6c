from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StructuredKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRUCTURED_KIND_UNSPECIFIED: _ClassVar[StructuredKind]
    STRUCTURED_KIND_JSON_SCHEMA: _ClassVar[StructuredKind]
    STRUCTURED_KIND_REGEX: _ClassVar[StructuredKind]
    STRUCTURED_KIND_GRAMMAR: _ClassVar[StructuredKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]

class Residency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESIDENCY_UNSPECIFIED: _ClassVar[Residency]
    RESIDENCY_REMOTE: _ClassVar[Residency]
    RESIDENCY_LOADING: _ClassVar[Residency]
    RESIDENCY_HOST: _ClassVar[Residency]
    RESIDENCY_DEVICE: _ClassVar[Residency]
STRUCTURED_KIND_UNSPECIFIED: StructuredKind
STRUCTURED_KIND_JSON_SCHEMA: StructuredKind
STRUCTURED_KIND_REGEX: StructuredKind
STRUCTURED_KIND_GRAMMAR: StructuredKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
RESIDENCY_UNSPECIFIED: Residency
RESIDENCY_REMOTE: Residency
RESIDENCY_LOADING: Residency
RESIDENCY_HOST: Residency
RESIDENCY_DEVICE: Residency

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "n", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    logprobs: int
    n: int
    structured: StructuredOutput
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec", "param")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredKind
    spec: str
    param: str
    def __init__(self, kind: _Optional[_Union[StructuredKind, str]] = ..., spec: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "messages", "prompt_token_ids", "sampling", "mix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    messages: ChatMessages
    prompt_token_ids: TokenIds
    sampling: SamplingParams
    mix: _containers.RepeatedCompositeFieldContainer[MixComponent]
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mix: _Optional[_Iterable[_Union[MixComponent, _Mapping]]] = ...) -> None: ...

class MixComponent(_message.Message):
    __slots__ = ("name", "weight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "extra_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    extra_json: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., extra_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs", "index", "cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "local_path", "pin")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    local_path: str
    pin: bool
    def __init__(self, name: _Optional[str] = ..., local_path: _Optional[str] = ..., pin: _Optional[bool] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: AdapterStatus
    def __init__(self, adapter: _Optional[_Union[AdapterStatus, _Mapping]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterStatus(_message.Message):
    __slots__ = ("name", "adapter_id", "residency", "rank", "nbytes", "pinned", "references", "slot")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    REFERENCES_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_id: str
    residency: Residency
    rank: int
    nbytes: int
    pinned: bool
    references: int
    slot: int
    def __init__(self, name: _Optional[str] = ..., adapter_id: _Optional[str] = ..., residency: _Optional[_Union[Residency, str]] = ..., rank: _Optional[int] = ..., nbytes: _Optional[int] = ..., pinned: _Optional[bool] = ..., references: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "base_model", "num_layers", "adaptable_modules")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTABLE_MODULES_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterStatus]
    base_model: str
    num_layers: int
    adaptable_modules: _containers.RepeatedCompositeFieldContainer[AdaptableModule]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterStatus, _Mapping]]] = ..., base_model: _Optional[str] = ..., num_layers: _Optional[int] = ..., adaptable_modules: _Optional[_Iterable[_Union[AdaptableModule, _Mapping]]] = ...) -> None: ...

class AdaptableModule(_message.Message):
    __slots__ = ("name", "in_features", "out_features")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IN_FEATURES_FIELD_NUMBER: _ClassVar[int]
    OUT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    in_features: int
    out_features: int
    def __init__(self, name: _Optional[str] = ..., in_features: _Optional[int] = ..., out_features: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("waiting_requests", "running_requests", "loading_adapters", "device_slots_total", "device_slots_used", "host_bytes_used", "host_bytes_budget", "kv_tokens_used", "kv_tokens_total", "generated_tokens_total", "requests_finished_total", "base_model")
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LOADING_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    waiting_requests: int
    running_requests: int
    loading_adapters: int
    device_slots_total: int
    device_slots_used: int
    host_bytes_used: int
    host_bytes_budget: int
    kv_tokens_used: int
    kv_tokens_total: int
    generated_tokens_total: int
    requests_finished_total: int
    base_model: str
    def __init__(self, waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., loading_adapters: _Optional[int] = ..., device_slots_total: _Optional[int] = ..., device_slots_used: _Optional[int] = ..., host_bytes_used: _Optional[int] = ..., host_bytes_budget: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., kv_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., requests_finished_total: _Optional[int] = ..., base_model: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("prompt", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs", "model")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    messages: ChatMessages
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool
    model: str
    def __init__(self, prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strs: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens", "max_model_len", "token_strs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., token_strs: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens", "model")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    model: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    def __init__(self, prompt: _Optional[str] = ...) -> None: ...
