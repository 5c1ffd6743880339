from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskId(_message.Message):
    __slots__ = ("type", "index")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    type: str
    index: int
    def __init__(self, type: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("pstrain", "tensorflow", "python")
    PSTRAIN_FIELD_NUMBER: _ClassVar[int]
    TENSORFLOW_FIELD_NUMBER: _ClassVar[int]
    PYTHON_FIELD_NUMBER: _ClassVar[int]
    pstrain: str
    tensorflow: str
    python: str
    def __init__(self, pstrain: _Optional[str] = ..., tensorflow: _Optional[str] = ..., python: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("task", "host", "address", "pid", "versions", "devices")
    TASK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    task: TaskId
    host: str
    address: str
    pid: int
    versions: Versions
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task: _Optional[_Union[TaskId, _Mapping]] = ..., host: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("accepted", "reason", "heartbeat_interval_s", "heartbeat_timeout_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ...) -> None: ...

class Resources(_message.Message):
    __slots__ = ("cpu_percent", "rss_bytes", "gpu_memory_bytes")
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    cpu_percent: float
    rss_bytes: int
    gpu_memory_bytes: int
    def __init__(self, cpu_percent: _Optional[float] = ..., rss_bytes: _Optional[int] = ..., gpu_memory_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("task", "state", "resources", "step", "gradients_by_worker")
    class GradientsByWorkerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    TASK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_BY_WORKER_FIELD_NUMBER: _ClassVar[int]
    task: TaskId
    state: str
    resources: Resources
    step: int
    gradients_by_worker: _containers.ScalarMap[int, int]
    def __init__(self, task: _Optional[_Union[TaskId, _Mapping]] = ..., state: _Optional[str] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., step: _Optional[int] = ..., gradients_by_worker: _Optional[_Mapping[int, int]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("stop", "unknown", "stop_reason")
    STOP_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    unknown: bool
    stop_reason: str
    def __init__(self, stop: _Optional[bool] = ..., unknown: _Optional[bool] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("task", "state", "host", "address", "pid", "heartbeat_age_s", "step", "steps_per_s", "gradients", "resources", "devices", "hostname", "versions", "restarts", "restarts_reset_at")
    TASK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_RESET_AT_FIELD_NUMBER: _ClassVar[int]
    task: TaskId
    state: str
    host: str
    address: str
    pid: int
    heartbeat_age_s: float
    step: int
    steps_per_s: float
    gradients: int
    resources: Resources
    devices: _containers.RepeatedScalarFieldContainer[str]
    hostname: str
    versions: Versions
    restarts: int
    restarts_reset_at: float
    def __init__(self, task: _Optional[_Union[TaskId, _Mapping]] = ..., state: _Optional[str] = ..., host: _Optional[str] = ..., address: _Optional[str] = ..., pid: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., step: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., gradients: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., devices: _Optional[_Iterable[str]] = ..., hostname: _Optional[str] = ..., versions: _Optional[_Union[Versions, _Mapping]] = ..., restarts: _Optional[int] = ..., restarts_reset_at: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("state", "step", "total_steps", "tasks", "time", "max_restarts", "restart_window_s", "step_age_s")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTART_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    state: str
    step: int
    total_steps: int
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStatus]
    time: float
    max_restarts: int
    restart_window_s: float
    step_age_s: float
    def __init__(self, state: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[TaskStatus, _Mapping]]] = ..., time: _Optional[float] = ..., max_restarts: _Optional[int] = ..., restart_window_s: _Optional[float] = ..., step_age_s: _Optional[float] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StopReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class AssignmentRequest(_message.Message):
    __slots__ = ("host_addresses",)
    HOST_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    host_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, host_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class AssignmentReply(_message.Message):
    __slots__ = ("cluster_json", "tasks", "worker_gpus")
    CLUSTER_JSON_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_GPUS_FIELD_NUMBER: _ClassVar[int]
    cluster_json: str
    tasks: _containers.RepeatedCompositeFieldContainer[TaskId]
    worker_gpus: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cluster_json: _Optional[str] = ..., tasks: _Optional[_Iterable[_Union[TaskId, _Mapping]]] = ..., worker_gpus: _Optional[_Iterable[int]] = ...) -> None: ...
