from lorastream.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PreloadPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRELOAD_PHASE_UNSPECIFIED: _ClassVar[PreloadPhase]
    PRELOAD_PHASE_RESOLVING: _ClassVar[PreloadPhase]
    PRELOAD_PHASE_DOWNLOADING: _ClassVar[PreloadPhase]
    PRELOAD_PHASE_VALIDATING: _ClassVar[PreloadPhase]
    PRELOAD_PHASE_STAGING: _ClassVar[PreloadPhase]
    PRELOAD_PHASE_DONE: _ClassVar[PreloadPhase]

class PinnedFilter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PINNED_FILTER_UNSPECIFIED: _ClassVar[PinnedFilter]
    PINNED_FILTER_PINNED: _ClassVar[PinnedFilter]
    PINNED_FILTER_UNPINNED: _ClassVar[PinnedFilter]

class AdapterChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADAPTER_CHANGE_KIND_UNSPECIFIED: _ClassVar[AdapterChangeKind]
    ADAPTER_CHANGE_KIND_PUT: _ClassVar[AdapterChangeKind]
    ADAPTER_CHANGE_KIND_VERSION: _ClassVar[AdapterChangeKind]
    ADAPTER_CHANGE_KIND_DELETE: _ClassVar[AdapterChangeKind]
PRELOAD_PHASE_UNSPECIFIED: PreloadPhase
PRELOAD_PHASE_RESOLVING: PreloadPhase
PRELOAD_PHASE_DOWNLOADING: PreloadPhase
PRELOAD_PHASE_VALIDATING: PreloadPhase
PRELOAD_PHASE_STAGING: PreloadPhase
PRELOAD_PHASE_DONE: PreloadPhase
PINNED_FILTER_UNSPECIFIED: PinnedFilter
PINNED_FILTER_PINNED: PinnedFilter
PINNED_FILTER_UNPINNED: PinnedFilter
ADAPTER_CHANGE_KIND_UNSPECIFIED: AdapterChangeKind
ADAPTER_CHANGE_KIND_PUT: AdapterChangeKind
ADAPTER_CHANGE_KIND_VERSION: AdapterChangeKind
ADAPTER_CHANGE_KIND_DELETE: AdapterChangeKind

class PreloadAdapterRequest(_message.Message):
    __slots__ = ("source_uri", "name", "pin", "force")
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    source_uri: str
    name: str
    pin: bool
    force: bool
    def __init__(self, source_uri: _Optional[str] = ..., name: _Optional[str] = ..., pin: _Optional[bool] = ..., force: _Optional[bool] = ...) -> None: ...

class PreloadAdapterResponse(_message.Message):
    __slots__ = ("phase", "bytes_done", "bytes_total", "message", "manifest")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    phase: PreloadPhase
    bytes_done: int
    bytes_total: int
    message: str
    manifest: _common_pb2.AdapterManifest
    def __init__(self, phase: _Optional[_Union[PreloadPhase, str]] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., message: _Optional[str] = ..., manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ...) -> None: ...

class UploadAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: UploadChunk
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[UploadChunk, _Mapping]] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("name", "pin", "force", "files")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    name: str
    pin: bool
    force: bool
    files: _containers.RepeatedCompositeFieldContainer[UploadFile]
    def __init__(self, name: _Optional[str] = ..., pin: _Optional[bool] = ..., force: _Optional[bool] = ..., files: _Optional[_Iterable[_Union[UploadFile, _Mapping]]] = ...) -> None: ...

class UploadFile(_message.Message):
    __slots__ = ("path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("file_index", "offset", "data", "crc32c")
    FILE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    file_index: int
    offset: int
    data: bytes
    crc32c: int
    def __init__(self, file_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class UploadAdapterResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "name_prefix", "pinned", "source_prefix")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAME_PREFIX_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    name_prefix: str
    pinned: PinnedFilter
    source_prefix: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., name_prefix: _Optional[str] = ..., pinned: _Optional[_Union[PinnedFilter, str]] = ..., source_prefix: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "cache_bytes_used", "cache_bytes_budget", "next_page_token", "total_size")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[_common_pb2.AdapterManifest]
    cache_bytes_used: int
    cache_bytes_budget: int
    next_page_token: str
    total_size: int
    def __init__(self, adapters: _Optional[_Iterable[_Union[_common_pb2.AdapterManifest, _Mapping]]] = ..., cache_bytes_used: _Optional[int] = ..., cache_bytes_budget: _Optional[int] = ..., next_page_token: _Optional[str] = ..., total_size: _Optional[int] = ...) -> None: ...

class DescribeAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DescribeAdapterResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class PinAdapterResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ...) -> None: ...

class UnpinAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnpinAdapterResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ...) -> None: ...

class StreamAdapterTensorsRequest(_message.Message):
    __slots__ = ("name", "adapter_id", "start_tensor", "start_offset", "chunk_bytes", "skip_chunk_crc")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    START_TENSOR_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SKIP_CHUNK_CRC_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_id: str
    start_tensor: int
    start_offset: int
    chunk_bytes: int
    skip_chunk_crc: bool
    def __init__(self, name: _Optional[str] = ..., adapter_id: _Optional[str] = ..., start_tensor: _Optional[int] = ..., start_offset: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., skip_chunk_crc: _Optional[bool] = ...) -> None: ...

class ReadAdapterFileRequest(_message.Message):
    __slots__ = ("name", "adapter_id", "file")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    name: str
    adapter_id: str
    file: str
    def __init__(self, name: _Optional[str] = ..., adapter_id: _Optional[str] = ..., file: _Optional[str] = ...) -> None: ...

class ReadAdapterFileResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor_index", "offset", "data", "crc32c")
    TENSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    tensor_index: int
    offset: int
    data: bytes
    crc32c: int
    def __init__(self, tensor_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class StreamAdapterTensorsResponse(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    chunk: TensorChunk
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class AdapterVersion(_message.Message):
    __slots__ = ("name", "version", "adapter_id", "source_uri", "revision", "created_at", "current", "staged", "total_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_URI_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    adapter_id: str
    source_uri: str
    revision: str
    created_at: float
    current: bool
    staged: bool
    total_bytes: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., adapter_id: _Optional[str] = ..., source_uri: _Optional[str] = ..., revision: _Optional[str] = ..., created_at: _Optional[float] = ..., current: _Optional[bool] = ..., staged: _Optional[bool] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ListAdapterVersionsRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListAdapterVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[AdapterVersion]
    def __init__(self, versions: _Optional[_Iterable[_Union[AdapterVersion, _Mapping]]] = ...) -> None: ...

class RollbackAdapterRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class RollbackAdapterResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _common_pb2.AdapterManifest
    def __init__(self, manifest: _Optional[_Union[_common_pb2.AdapterManifest, _Mapping]] = ...) -> None: ...

class WatchAdaptersRequest(_message.Message):
    __slots__ = ("watcher",)
    WATCHER_FIELD_NUMBER: _ClassVar[int]
    watcher: str
    def __init__(self, watcher: _Optional[str] = ...) -> None: ...

class AdapterChange(_message.Message):
    __slots__ = ("kind", "name", "adapter_id", "version")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    kind: AdapterChangeKind
    name: str
    adapter_id: str
    version: int
    def __init__(self, kind: _Optional[_Union[AdapterChangeKind, str]] = ..., name: _Optional[str] = ..., adapter_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class WatchAdaptersResponse(_message.Message):
    __slots__ = ("watch_id", "generation", "snapshot", "snapshot_done", "changes")
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    watch_id: str
    generation: int
    snapshot: bool
    snapshot_done: bool
    changes: _containers.RepeatedCompositeFieldContainer[AdapterChange]
    def __init__(self, watch_id: _Optional[str] = ..., generation: _Optional[int] = ..., snapshot: _Optional[bool] = ..., snapshot_done: _Optional[bool] = ..., changes: _Optional[_Iterable[_Union[AdapterChange, _Mapping]]] = ...) -> None: ...

class AckAdapterChangesRequest(_message.Message):
    __slots__ = ("watch_id", "generation")
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    watch_id: str
    generation: int
    def __init__(self, watch_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class AckAdapterChangesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
