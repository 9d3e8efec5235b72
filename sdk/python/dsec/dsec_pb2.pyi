from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union
from .common_pb2 import CloseSessionResponse as CloseSessionResponse
from .common_pb2 import CommandResult as CommandResult
from .common_pb2 import ExecResponse as ExecResponse
from .common_pb2 import ExecStarted as ExecStarted
from .common_pb2 import ExitStatus as ExitStatus
from .common_pb2 import FileChunk as FileChunk
from .common_pb2 import FileInfo as FileInfo
from .common_pb2 import ListDirResponse as ListDirResponse
from .common_pb2 import ListSessionsResponse as ListSessionsResponse
from .common_pb2 import MkdirResponse as MkdirResponse
from .common_pb2 import PortConnected as PortConnected
from .common_pb2 import PortEof as PortEof
from .common_pb2 import PortResponse as PortResponse
from .common_pb2 import PtyConfig as PtyConfig
from .common_pb2 import RemoveResponse as RemoveResponse
from .common_pb2 import RenameResponse as RenameResponse
from .common_pb2 import SessionInfo as SessionInfo
from .common_pb2 import StdinEof as StdinEof
from .common_pb2 import WindowSize as WindowSize
from .common_pb2 import WriteFileResponse as WriteFileResponse
from .common_pb2 import FileType as FileType

DESCRIPTOR: _descriptor.FileDescriptor
FILE_TYPE_UNSPECIFIED: _common_pb2.FileType
FILE_TYPE_FILE: _common_pb2.FileType
FILE_TYPE_DIR: _common_pb2.FileType
FILE_TYPE_SYMLINK: _common_pb2.FileType
FILE_TYPE_OTHER: _common_pb2.FileType

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_CONTAINER: _ClassVar[Backend]
    BACKEND_MICROVM: _ClassVar[Backend]

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_STATE_UNSPECIFIED: _ClassVar[SandboxState]
    SANDBOX_STATE_CREATING: _ClassVar[SandboxState]
    SANDBOX_STATE_RUNNING: _ClassVar[SandboxState]
    SANDBOX_STATE_PAUSED: _ClassVar[SandboxState]
    SANDBOX_STATE_STOPPING: _ClassVar[SandboxState]
    SANDBOX_STATE_DEAD: _ClassVar[SandboxState]
    SANDBOX_STATE_LOST: _ClassVar[SandboxState]

class FnStageStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FN_STAGE_STATUS_UNSPECIFIED: _ClassVar[FnStageStatus]
    FN_STAGE_STATUS_FINISHED: _ClassVar[FnStageStatus]
    FN_STAGE_STATUS_TIME_LIMIT_EXCEEDED: _ClassVar[FnStageStatus]
    FN_STAGE_STATUS_ERROR: _ClassVar[FnStageStatus]
BACKEND_UNSPECIFIED: Backend
BACKEND_CONTAINER: Backend
BACKEND_MICROVM: Backend
SANDBOX_STATE_UNSPECIFIED: SandboxState
SANDBOX_STATE_CREATING: SandboxState
SANDBOX_STATE_RUNNING: SandboxState
SANDBOX_STATE_PAUSED: SandboxState
SANDBOX_STATE_STOPPING: SandboxState
SANDBOX_STATE_DEAD: SandboxState
SANDBOX_STATE_LOST: SandboxState
FN_STAGE_STATUS_UNSPECIFIED: FnStageStatus
FN_STAGE_STATUS_FINISHED: FnStageStatus
FN_STAGE_STATUS_TIME_LIMIT_EXCEEDED: FnStageStatus
FN_STAGE_STATUS_ERROR: FnStageStatus

class NetworkPolicy(_message.Message):
    __slots__ = ("allow_internet", "allow", "deny")
    ALLOW_INTERNET_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    DENY_FIELD_NUMBER: _ClassVar[int]
    allow_internet: bool
    allow: _containers.RepeatedScalarFieldContainer[str]
    deny: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, allow_internet: _Optional[bool] = ..., allow: _Optional[_Iterable[str]] = ..., deny: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("backend", "image", "vcpus", "memory_mib", "disk_mib", "env", "ttl_seconds", "idle_timeout_seconds", "labels", "network", "pids_limit", "request_id", "public_ports", "project", "node_labels", "sandbox_id", "cold", "from_snapshot")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class NodeLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_MIB_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PORTS_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    NODE_LABELS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COLD_FIELD_NUMBER: _ClassVar[int]
    FROM_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    backend: Backend
    image: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    env: _containers.ScalarMap[str, str]
    ttl_seconds: int
    idle_timeout_seconds: int
    labels: _containers.ScalarMap[str, str]
    network: NetworkPolicy
    pids_limit: int
    request_id: str
    public_ports: _containers.RepeatedScalarFieldContainer[int]
    project: str
    node_labels: _containers.ScalarMap[str, str]
    sandbox_id: str
    cold: bool
    from_snapshot: str
    def __init__(self, backend: _Optional[_Union[Backend, str]] = ..., image: _Optional[str] = ..., vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., disk_mib: _Optional[int] = ..., env: _Optional[_Mapping[str, str]] = ..., ttl_seconds: _Optional[int] = ..., idle_timeout_seconds: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ..., pids_limit: _Optional[int] = ..., request_id: _Optional[str] = ..., public_ports: _Optional[_Iterable[int]] = ..., project: _Optional[str] = ..., node_labels: _Optional[_Mapping[str, str]] = ..., sandbox_id: _Optional[str] = ..., cold: _Optional[bool] = ..., from_snapshot: _Optional[str] = ...) -> None: ...

class ResourceUsage(_message.Message):
    __slots__ = ("memory_bytes", "cpu_usage_ns", "pids")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_USAGE_NS_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    cpu_usage_ns: int
    pids: int
    def __init__(self, memory_bytes: _Optional[int] = ..., cpu_usage_ns: _Optional[int] = ..., pids: _Optional[int] = ...) -> None: ...

class CreateSandboxesRequest(_message.Message):
    __slots__ = ("requests", "project")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[CreateSandboxRequest]
    project: str
    def __init__(self, requests: _Optional[_Iterable[_Union[CreateSandboxRequest, _Mapping]]] = ..., project: _Optional[str] = ...) -> None: ...

class CreateSandboxResult(_message.Message):
    __slots__ = ("sandbox", "code", "message")
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    sandbox: Sandbox
    code: int
    message: str
    def __init__(self, sandbox: _Optional[_Union[Sandbox, _Mapping]] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CreateSandboxesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[CreateSandboxResult]
    def __init__(self, results: _Optional[_Iterable[_Union[CreateSandboxResult, _Mapping]]] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("id", "backend", "image", "state", "vcpus", "memory_mib", "disk_mib", "pids_limit", "labels", "created_at_unix_ms", "expires_at_unix_ms", "idle_timeout_seconds", "last_activity_unix_ms", "pid", "parent_id", "usage", "network", "memory_limit_bytes", "request_id", "access_token", "public_ports", "death_reason", "died_at_unix_ms", "project", "node")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_MIB_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVITY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PORTS_FIELD_NUMBER: _ClassVar[int]
    DEATH_REASON_FIELD_NUMBER: _ClassVar[int]
    DIED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    id: str
    backend: Backend
    image: str
    state: SandboxState
    vcpus: int
    memory_mib: int
    disk_mib: int
    pids_limit: int
    labels: _containers.ScalarMap[str, str]
    created_at_unix_ms: int
    expires_at_unix_ms: int
    idle_timeout_seconds: int
    last_activity_unix_ms: int
    pid: int
    parent_id: str
    usage: ResourceUsage
    network: NetworkPolicy
    memory_limit_bytes: int
    request_id: str
    access_token: str
    public_ports: _containers.RepeatedScalarFieldContainer[int]
    death_reason: str
    died_at_unix_ms: int
    project: str
    node: str
    def __init__(self, id: _Optional[str] = ..., backend: _Optional[_Union[Backend, str]] = ..., image: _Optional[str] = ..., state: _Optional[_Union[SandboxState, str]] = ..., vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., disk_mib: _Optional[int] = ..., pids_limit: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ..., created_at_unix_ms: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ..., idle_timeout_seconds: _Optional[int] = ..., last_activity_unix_ms: _Optional[int] = ..., pid: _Optional[int] = ..., parent_id: _Optional[str] = ..., usage: _Optional[_Union[ResourceUsage, _Mapping]] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ..., memory_limit_bytes: _Optional[int] = ..., request_id: _Optional[str] = ..., access_token: _Optional[str] = ..., public_ports: _Optional[_Iterable[int]] = ..., death_reason: _Optional[str] = ..., died_at_unix_ms: _Optional[int] = ..., project: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ("labels", "page_size", "page_token", "project")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROJECT_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    page_size: int
    page_token: str
    project: str
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., project: _Optional[str] = ...) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes", "next_page_token")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    next_page_token: str
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class DeleteSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetTimeoutRequest(_message.Message):
    __slots__ = ("sandbox_id", "ttl_seconds", "idle_timeout_seconds")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    ttl_seconds: int
    idle_timeout_seconds: int
    def __init__(self, sandbox_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., idle_timeout_seconds: _Optional[int] = ...) -> None: ...

class PauseSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ResumeSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ForkSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id", "count", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    count: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, sandbox_id: _Optional[str] = ..., count: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ForkSandboxResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ...) -> None: ...

class SnapshotSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "diff")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIFF_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: str
    diff: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[str] = ..., diff: _Optional[bool] = ...) -> None: ...

class SnapshotSandboxResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("sandbox_id", "follow", "tail_bytes")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    follow: bool
    tail_bytes: int
    def __init__(self, sandbox_id: _Optional[str] = ..., follow: _Optional[bool] = ..., tail_bytes: _Optional[int] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("source", "data")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    source: str
    data: bytes
    def __init__(self, source: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class NodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Budget(_message.Message):
    __slots__ = ("limit", "reserved")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    limit: int
    reserved: int
    def __init__(self, limit: _Optional[int] = ..., reserved: _Optional[int] = ...) -> None: ...

class NodeStatusResponse(_message.Message):
    __slots__ = ("version", "default_backend", "memory_mib", "vcpus", "pids", "disk_mib", "sandboxes", "creates_total", "create_failures_total", "admission_rejections_total", "reaped_total", "adopted_total", "started_at_unix_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    DISK_MIB_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    CREATES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CREATE_FAILURES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_REJECTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REAPED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    version: str
    default_backend: str
    memory_mib: Budget
    vcpus: Budget
    pids: Budget
    disk_mib: Budget
    sandboxes: int
    creates_total: int
    create_failures_total: int
    admission_rejections_total: int
    reaped_total: int
    adopted_total: int
    started_at_unix_ms: int
    def __init__(self, version: _Optional[str] = ..., default_backend: _Optional[str] = ..., memory_mib: _Optional[_Union[Budget, _Mapping]] = ..., vcpus: _Optional[_Union[Budget, _Mapping]] = ..., pids: _Optional[_Union[Budget, _Mapping]] = ..., disk_mib: _Optional[_Union[Budget, _Mapping]] = ..., sandboxes: _Optional[int] = ..., creates_total: _Optional[int] = ..., create_failures_total: _Optional[int] = ..., admission_rejections_total: _Optional[int] = ..., reaped_total: _Optional[int] = ..., adopted_total: _Optional[int] = ..., started_at_unix_ms: _Optional[int] = ...) -> None: ...

class ExecStart(_message.Message):
    __slots__ = ("sandbox_id", "argv", "env", "workdir", "timeout_ms", "stdin", "pty")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    PTY_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    workdir: str
    timeout_ms: int
    stdin: bool
    pty: _common_pb2.PtyConfig
    def __init__(self, sandbox_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., stdin: _Optional[bool] = ..., pty: _Optional[_Union[_common_pb2.PtyConfig, _Mapping]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("start", "stdin", "stdin_eof", "signal", "resize")
    START_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDIN_EOF_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    start: ExecStart
    stdin: bytes
    stdin_eof: _common_pb2.StdinEof
    signal: int
    resize: _common_pb2.WindowSize
    def __init__(self, start: _Optional[_Union[ExecStart, _Mapping]] = ..., stdin: _Optional[bytes] = ..., stdin_eof: _Optional[_Union[_common_pb2.StdinEof, _Mapping]] = ..., signal: _Optional[int] = ..., resize: _Optional[_Union[_common_pb2.WindowSize, _Mapping]] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: bytes
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[bytes] = ...) -> None: ...

class WriteFileHeader(_message.Message):
    __slots__ = ("sandbox_id", "path", "mode", "create_parents")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CREATE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: bytes
    mode: int
    create_parents: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[bytes] = ..., mode: _Optional[int] = ..., create_parents: _Optional[bool] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: WriteFileHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[WriteFileHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListDirRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: bytes
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[bytes] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("sandbox_id", "path")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: bytes
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[bytes] = ...) -> None: ...

class MkdirRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "parents", "mode")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: bytes
    parents: bool
    mode: int
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[bytes] = ..., parents: _Optional[bool] = ..., mode: _Optional[int] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("sandbox_id", "path", "recursive")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    path: bytes
    recursive: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., path: _Optional[bytes] = ..., recursive: _Optional[bool] = ...) -> None: ...

class RenameRequest(_message.Message):
    __slots__ = ("sandbox_id", "to")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    to: bytes
    def __init__(self, sandbox_id: _Optional[str] = ..., to: _Optional[bytes] = ..., **kwargs) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("sandbox_id", "shell", "env", "workdir")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    shell: str
    env: _containers.ScalarMap[str, str]
    workdir: str
    def __init__(self, sandbox_id: _Optional[str] = ..., shell: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ...) -> None: ...

class RunInSessionRequest(_message.Message):
    __slots__ = ("sandbox_id", "session_id", "command", "timeout_ms", "wait", "output_limit")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    session_id: str
    command: str
    timeout_ms: int
    wait: bool
    output_limit: int
    def __init__(self, sandbox_id: _Optional[str] = ..., session_id: _Optional[str] = ..., command: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., wait: _Optional[bool] = ..., output_limit: _Optional[int] = ...) -> None: ...

class ReadOutputRequest(_message.Message):
    __slots__ = ("sandbox_id", "session_id", "command_id", "wait")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    session_id: str
    command_id: int
    wait: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., session_id: _Optional[str] = ..., command_id: _Optional[int] = ..., wait: _Optional[bool] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("sandbox_id", "session_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    session_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class SetPortPublicRequest(_message.Message):
    __slots__ = ("sandbox_id", "port", "public")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    public: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ..., public: _Optional[bool] = ...) -> None: ...

class SetPortPublicResponse(_message.Message):
    __slots__ = ("public_ports",)
    PUBLIC_PORTS_FIELD_NUMBER: _ClassVar[int]
    public_ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, public_ports: _Optional[_Iterable[int]] = ...) -> None: ...

class PortOpen(_message.Message):
    __slots__ = ("sandbox_id", "port", "access_token")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    access_token: str
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ..., access_token: _Optional[str] = ...) -> None: ...

class PortRequest(_message.Message):
    __slots__ = ("open", "data", "eof")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    open: PortOpen
    data: bytes
    eof: _common_pb2.PortEof
    def __init__(self, open: _Optional[_Union[PortOpen, _Mapping]] = ..., data: _Optional[bytes] = ..., eof: _Optional[_Union[_common_pb2.PortEof, _Mapping]] = ...) -> None: ...

class PortUrlRequest(_message.Message):
    __slots__ = ("sandbox_id", "port")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class PortUrl(_message.Message):
    __slots__ = ("url", "host", "address", "access_token")
    URL_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    url: str
    host: str
    address: str
    access_token: str
    def __init__(self, url: _Optional[str] = ..., host: _Optional[str] = ..., address: _Optional[str] = ..., access_token: _Optional[str] = ...) -> None: ...

class SetNetworkPolicyRequest(_message.Message):
    __slots__ = ("sandbox_id", "network")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    network: NetworkPolicy
    def __init__(self, sandbox_id: _Optional[str] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ...) -> None: ...

class SetNetworkPolicyByLabelsRequest(_message.Message):
    __slots__ = ("labels", "network")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.ScalarMap[str, str]
    network: NetworkPolicy
    def __init__(self, labels: _Optional[_Mapping[str, str]] = ..., network: _Optional[_Union[NetworkPolicy, _Mapping]] = ...) -> None: ...

class SetNetworkPolicyByLabelsResponse(_message.Message):
    __slots__ = ("sandboxes", "failed")
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    failed: _containers.RepeatedCompositeFieldContainer[SetNetworkPolicyFailure]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ..., failed: _Optional[_Iterable[_Union[SetNetworkPolicyFailure, _Mapping]]] = ...) -> None: ...

class SetNetworkPolicyFailure(_message.Message):
    __slots__ = ("sandbox_id", "message")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    message: str
    def __init__(self, sandbox_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class FnRunRequest(_message.Message):
    __slots__ = ("language", "code", "stdin", "files", "fetch_files", "compile_timeout", "run_timeout", "memory_mib", "network", "image", "network_policy")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FETCH_FILES_FIELD_NUMBER: _ClassVar[int]
    COMPILE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    RUN_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    NETWORK_POLICY_FIELD_NUMBER: _ClassVar[int]
    language: str
    code: str
    stdin: bytes
    files: _containers.ScalarMap[str, bytes]
    fetch_files: _containers.RepeatedScalarFieldContainer[str]
    compile_timeout: float
    run_timeout: float
    memory_mib: int
    network: bool
    image: str
    network_policy: NetworkPolicy
    def __init__(self, language: _Optional[str] = ..., code: _Optional[str] = ..., stdin: _Optional[bytes] = ..., files: _Optional[_Mapping[str, bytes]] = ..., fetch_files: _Optional[_Iterable[str]] = ..., compile_timeout: _Optional[float] = ..., run_timeout: _Optional[float] = ..., memory_mib: _Optional[int] = ..., network: _Optional[bool] = ..., image: _Optional[str] = ..., network_policy: _Optional[_Union[NetworkPolicy, _Mapping]] = ...) -> None: ...

class FnStageResult(_message.Message):
    __slots__ = ("status", "exit_code", "signal", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "seconds")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    status: FnStageStatus
    exit_code: int
    signal: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    seconds: float
    def __init__(self, status: _Optional[_Union[FnStageStatus, str]] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class FnRunResponse(_message.Message):
    __slots__ = ("compile", "run", "files", "file_errors", "out_of_memory", "total_seconds", "success")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FILE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_MEMORY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    compile: FnStageResult
    run: FnStageResult
    files: _containers.ScalarMap[str, bytes]
    file_errors: _containers.RepeatedScalarFieldContainer[str]
    out_of_memory: bool
    total_seconds: float
    success: bool
    def __init__(self, compile: _Optional[_Union[FnStageResult, _Mapping]] = ..., run: _Optional[_Union[FnStageResult, _Mapping]] = ..., files: _Optional[_Mapping[str, bytes]] = ..., file_errors: _Optional[_Iterable[str]] = ..., out_of_memory: _Optional[bool] = ..., total_seconds: _Optional[float] = ..., success: _Optional[bool] = ...) -> None: ...

class FnRunBatchRequest(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[FnRunRequest]
    def __init__(self, calls: _Optional[_Iterable[_Union[FnRunRequest, _Mapping]]] = ...) -> None: ...

class FnRunBatchItem(_message.Message):
    __slots__ = ("response", "error")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    response: FnRunResponse
    error: str
    def __init__(self, response: _Optional[_Union[FnRunResponse, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class FnRunBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[FnRunBatchItem]
    def __init__(self, results: _Optional[_Iterable[_Union[FnRunBatchItem, _Mapping]]] = ...) -> None: ...
