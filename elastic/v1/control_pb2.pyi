from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_IDLE: _ClassVar[WorkerState]
    WORKER_RUNNING: _ClassVar[WorkerState]
    WORKER_EXITED: _ClassVar[WorkerState]

class FailureCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_CAUSE_UNSPECIFIED: _ClassVar[FailureCause]
    FAILURE_CAUSE_OWN: _ClassVar[FailureCause]
    FAILURE_CAUSE_PEER: _ClassVar[FailureCause]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_IDLE: WorkerState
WORKER_RUNNING: WorkerState
WORKER_EXITED: WorkerState
FAILURE_CAUSE_UNSPECIFIED: FailureCause
FAILURE_CAUSE_OWN: FailureCause
FAILURE_CAUSE_PEER: FailureCause

class Header(_message.Message):
    __slots__ = ("job_id", "host_id", "incarnation", "generation", "seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    host_id: str
    incarnation: str
    generation: int
    seq: int
    def __init__(self, job_id: _Optional[str] = ..., host_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., generation: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("generation", "state", "pid", "exit_code", "signal", "stderr_tail", "stopped_on_request", "step", "committed_step", "metrics", "suspended", "process_id", "num_processes", "failure_cause")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    STOPPED_ON_REQUEST_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CAUSE_FIELD_NUMBER: _ClassVar[int]
    generation: int
    state: WorkerState
    pid: int
    exit_code: int
    signal: int
    stderr_tail: str
    stopped_on_request: bool
    step: int
    committed_step: int
    metrics: _containers.ScalarMap[str, float]
    suspended: bool
    process_id: int
    num_processes: int
    failure_cause: FailureCause
    def __init__(self, generation: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., stderr_tail: _Optional[str] = ..., stopped_on_request: _Optional[bool] = ..., step: _Optional[int] = ..., committed_step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., suspended: _Optional[bool] = ..., process_id: _Optional[int] = ..., num_processes: _Optional[int] = ..., failure_cause: _Optional[_Union[FailureCause, str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("header", "devices", "address", "failure_domain", "agent_pid", "worker", "free_port", "device_kind", "fenced", "service_port", "metrics_port", "protocol", "release")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    AGENT_PID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FREE_PORT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    SERVICE_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    header: Header
    devices: int
    address: str
    failure_domain: str
    agent_pid: int
    worker: WorkerStatus
    free_port: int
    device_kind: str
    fenced: str
    service_port: int
    metrics_port: int
    protocol: int
    release: str
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., devices: _Optional[int] = ..., address: _Optional[str] = ..., failure_domain: _Optional[str] = ..., agent_pid: _Optional[int] = ..., worker: _Optional[_Union[WorkerStatus, _Mapping]] = ..., free_port: _Optional[int] = ..., device_kind: _Optional[str] = ..., fenced: _Optional[str] = ..., service_port: _Optional[int] = ..., metrics_port: _Optional[int] = ..., protocol: _Optional[int] = ..., release: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("job_id", "generation", "heartbeat_interval_s", "heartbeat_timeout_s", "launch", "controller_lease_s", "term", "heartbeat_port", "heartbeat_key", "stream_wait_s", "protocol", "release", "received_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_LEASE_S_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PORT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_KEY_FIELD_NUMBER: _ClassVar[int]
    STREAM_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    launch: StartWorker
    controller_lease_s: float
    term: int
    heartbeat_port: int
    heartbeat_key: bytes
    stream_wait_s: float
    protocol: int
    release: str
    received_at: float
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., launch: _Optional[_Union[StartWorker, _Mapping]] = ..., controller_lease_s: _Optional[float] = ..., term: _Optional[int] = ..., heartbeat_port: _Optional[int] = ..., heartbeat_key: _Optional[bytes] = ..., stream_wait_s: _Optional[float] = ..., protocol: _Optional[int] = ..., release: _Optional[str] = ..., received_at: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq", "worker", "free_port", "preemption", "sent_at", "devices", "device_kind")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FREE_PORT_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    seq: int
    worker: WorkerStatus
    free_port: int
    preemption: str
    sent_at: float
    devices: int
    device_kind: str
    def __init__(self, seq: _Optional[int] = ..., worker: _Optional[_Union[WorkerStatus, _Mapping]] = ..., free_port: _Optional[int] = ..., preemption: _Optional[str] = ..., sent_at: _Optional[float] = ..., devices: _Optional[int] = ..., device_kind: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "committed_step", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    committed_step: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., committed_step: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("kind", "reason", "fields_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    reason: str
    fields_json: str
    def __init__(self, kind: _Optional[str] = ..., reason: _Optional[str] = ..., fields_json: _Optional[str] = ...) -> None: ...

class WorkerStacks(_message.Message):
    __slots__ = ("generation", "process_id", "pid", "stacks", "frame", "error")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    generation: int
    process_id: int
    pid: int
    stacks: str
    frame: str
    error: str
    def __init__(self, generation: _Optional[int] = ..., process_id: _Optional[int] = ..., pid: _Optional[int] = ..., stacks: _Optional[str] = ..., frame: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("header", "heartbeat", "worker_exited", "progress", "worker_event", "stacks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WORKER_EXITED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_EVENT_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    header: Header
    heartbeat: Heartbeat
    worker_exited: WorkerStatus
    progress: Progress
    worker_event: WorkerEvent
    stacks: WorkerStacks
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., worker_exited: _Optional[_Union[WorkerStatus, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., worker_event: _Optional[_Union[WorkerEvent, _Mapping]] = ..., stacks: _Optional[_Union[WorkerStacks, _Mapping]] = ...) -> None: ...

class StartWorker(_message.Message):
    __slots__ = ("generation", "process_id", "num_processes", "coordinator_address", "argv", "env", "workdir", "prestart_next", "devices_per_host", "replica_host", "replica_address", "next_slices", "replica_senders")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    PRESTART_NEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_HOST_FIELD_NUMBER: _ClassVar[int]
    REPLICA_HOST_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SLICES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_SENDERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    process_id: int
    num_processes: int
    coordinator_address: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    workdir: str
    prestart_next: bool
    devices_per_host: int
    replica_host: str
    replica_address: str
    next_slices: _containers.RepeatedCompositeFieldContainer[SliceShape]
    replica_senders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., process_id: _Optional[int] = ..., num_processes: _Optional[int] = ..., coordinator_address: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., workdir: _Optional[str] = ..., prestart_next: _Optional[bool] = ..., devices_per_host: _Optional[int] = ..., replica_host: _Optional[str] = ..., replica_address: _Optional[str] = ..., next_slices: _Optional[_Iterable[_Union[SliceShape, _Mapping]]] = ..., replica_senders: _Optional[_Iterable[str]] = ...) -> None: ...

class SliceShape(_message.Message):
    __slots__ = ("num_processes", "devices_per_host")
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_PER_HOST_FIELD_NUMBER: _ClassVar[int]
    num_processes: int
    devices_per_host: int
    def __init__(self, num_processes: _Optional[int] = ..., devices_per_host: _Optional[int] = ...) -> None: ...

class StopWorker(_message.Message):
    __slots__ = ("generation", "grace_s", "reason", "dump_stacks")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DUMP_STACKS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    grace_s: float
    reason: str
    dump_stacks: bool
    def __init__(self, generation: _Optional[int] = ..., grace_s: _Optional[float] = ..., reason: _Optional[str] = ..., dump_stacks: _Optional[bool] = ...) -> None: ...

class Rejected(_message.Message):
    __slots__ = ("reason", "current_generation")
    REASON_FIELD_NUMBER: _ClassVar[int]
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    reason: str
    current_generation: int
    def __init__(self, reason: _Optional[str] = ..., current_generation: _Optional[int] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("job_id", "generation", "start", "stop", "rejected", "ack", "term")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    generation: int
    start: StartWorker
    stop: StopWorker
    rejected: Rejected
    ack: HeartbeatAck
    term: int
    def __init__(self, job_id: _Optional[str] = ..., generation: _Optional[int] = ..., start: _Optional[_Union[StartWorker, _Mapping]] = ..., stop: _Optional[_Union[StopWorker, _Mapping]] = ..., rejected: _Optional[_Union[Rejected, _Mapping]] = ..., ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., term: _Optional[int] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq", "controller_lag_s", "received_at")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_LAG_S_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_AT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    controller_lag_s: float
    received_at: float
    def __init__(self, seq: _Optional[int] = ..., controller_lag_s: _Optional[float] = ..., received_at: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HostStatus(_message.Message):
    __slots__ = ("host_id", "state", "devices", "agent_pid", "worker_pid", "heartbeat_age_s", "step", "rank", "failure_domain", "incarnation", "worker_state", "address", "metrics", "note", "device_kind", "service_port", "metrics_port", "heartbeat_path")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    AGENT_PID_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    SERVICE_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PATH_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    state: str
    devices: int
    agent_pid: int
    worker_pid: int
    heartbeat_age_s: float
    step: int
    rank: int
    failure_domain: str
    incarnation: str
    worker_state: str
    address: str
    metrics: _containers.ScalarMap[str, float]
    note: str
    device_kind: str
    service_port: int
    metrics_port: int
    heartbeat_path: str
    def __init__(self, host_id: _Optional[str] = ..., state: _Optional[str] = ..., devices: _Optional[int] = ..., agent_pid: _Optional[int] = ..., worker_pid: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., failure_domain: _Optional[str] = ..., incarnation: _Optional[str] = ..., worker_state: _Optional[str] = ..., address: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ..., note: _Optional[str] = ..., device_kind: _Optional[str] = ..., service_port: _Optional[int] = ..., metrics_port: _Optional[int] = ..., heartbeat_path: _Optional[str] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "phase", "generation", "restarts", "reason", "hosts", "committed_step", "phase_age_s", "ettr", "heartbeat_latency_p50_s", "heartbeat_latency_p99_s", "last_failure")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ETTR_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_LATENCY_P50_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_LATENCY_P99_S_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: str
    generation: int
    restarts: int
    reason: str
    hosts: _containers.RepeatedCompositeFieldContainer[HostStatus]
    committed_step: int
    phase_age_s: float
    ettr: float
    heartbeat_latency_p50_s: float
    heartbeat_latency_p99_s: float
    last_failure: str
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[str] = ..., generation: _Optional[int] = ..., restarts: _Optional[int] = ..., reason: _Optional[str] = ..., hosts: _Optional[_Iterable[_Union[HostStatus, _Mapping]]] = ..., committed_step: _Optional[int] = ..., phase_age_s: _Optional[float] = ..., ettr: _Optional[float] = ..., heartbeat_latency_p50_s: _Optional[float] = ..., heartbeat_latency_p99_s: _Optional[float] = ..., last_failure: _Optional[str] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("generation", "agent", "tail_bytes", "follow")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    TAIL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    generation: int
    agent: bool
    tail_bytes: int
    follow: bool
    def __init__(self, generation: _Optional[int] = ..., agent: _Optional[bool] = ..., tail_bytes: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("source", "generation", "rank", "data")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    source: str
    generation: int
    rank: int
    data: bytes
    def __init__(self, source: _Optional[str] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicaChunk(_message.Message):
    __slots__ = ("run_id", "step", "size", "data", "generation")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    size: int
    data: bytes
    generation: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., size: _Optional[int] = ..., data: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...
