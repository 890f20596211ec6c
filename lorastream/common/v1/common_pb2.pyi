from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "checksum", "fast_checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FAST_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    checksum: str
    fast_checksum: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ..., fast_checksum: _Optional[str] = ...) -> None: ...

class AdapterManifest(_message.Message):
    __slots__ = ("adapter_id", "name", "source_uri", "revision", "base_model", "rank", "alpha", "use_rslora", "target_modules", "tensors", "total_bytes", "created_at", "pinned", "last_used_at", "alora_invocation_tokens", "token_indices", "files", "tokenizer_vocab", "rank_pattern", "alpha_pattern", "default_rank")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    ALORA_INVOCATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INDICES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_VOCAB_FIELD_NUMBER: _ClassVar[int]
    RANK_PATTERN_FIELD_NUMBER: _ClassVar[int]
    ALPHA_PATTERN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RANK_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    name: str
    source_uri: str
    revision: str
    base_model: str
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    total_bytes: int
    created_at: float
    pinned: bool
    last_used_at: float
    alora_invocation_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_indices: _containers.RepeatedScalarFieldContainer[int]
    files: _containers.RepeatedCompositeFieldContainer[AdapterFile]
    tokenizer_vocab: int
    rank_pattern: _containers.RepeatedCompositeFieldContainer[ModulePattern]
    alpha_pattern: _containers.RepeatedCompositeFieldContainer[ModulePattern]
    default_rank: int
    def __init__(self, adapter_id: _Optional[str] = ..., name: _Optional[str] = ..., source_uri: _Optional[str] = ..., revision: _Optional[str] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., use_rslora: _Optional[bool] = ..., target_modules: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., created_at: _Optional[float] = ..., pinned: _Optional[bool] = ..., last_used_at: _Optional[float] = ..., alora_invocation_tokens: _Optional[_Iterable[int]] = ..., token_indices: _Optional[_Iterable[int]] = ..., files: _Optional[_Iterable[_Union[AdapterFile, _Mapping]]] = ..., tokenizer_vocab: _Optional[int] = ..., rank_pattern: _Optional[_Iterable[_Union[ModulePattern, _Mapping]]] = ..., alpha_pattern: _Optional[_Iterable[_Union[ModulePattern, _Mapping]]] = ..., default_rank: _Optional[int] = ...) -> None: ...

class ModulePattern(_message.Message):
    __slots__ = ("pattern", "value")
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    pattern: str
    value: float
    def __init__(self, pattern: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class AdapterFile(_message.Message):
    __slots__ = ("name", "nbytes", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    checksum: str
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...
