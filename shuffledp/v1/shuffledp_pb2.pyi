from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Schedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_UNSPECIFIED: _ClassVar[Schedule]
    SEQUENTIAL: _ClassVar[Schedule]
    FULLY_INTERACTIVE: _ClassVar[Schedule]
    SUBSAMPLED: _ClassVar[Schedule]
    STREAM: _ClassVar[Schedule]

class TrustModel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUST_MODEL_UNSPECIFIED: _ClassVar[TrustModel]
    SHUFFLE: _ClassVar[TrustModel]
    LOCAL: _ClassVar[TrustModel]
    CENTRAL: _ClassVar[TrustModel]

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    COUNTS: _ClassVar[Transport]
    BITS: _ClassVar[Transport]
    SEALED: _ClassVar[Transport]
    PRIO3: _ClassVar[Transport]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    CREATED: _ClassVar[RunState]
    RUNNING: _ClassVar[RunState]
    COMPLETED: _ClassVar[RunState]
    FAILED: _ClassVar[RunState]
    CANCELLED: _ClassVar[RunState]
    BUDGET_EXHAUSTED: _ClassVar[RunState]
SCHEDULE_UNSPECIFIED: Schedule
SEQUENTIAL: Schedule
FULLY_INTERACTIVE: Schedule
SUBSAMPLED: Schedule
STREAM: Schedule
TRUST_MODEL_UNSPECIFIED: TrustModel
SHUFFLE: TrustModel
LOCAL: TrustModel
CENTRAL: TrustModel
TRANSPORT_UNSPECIFIED: Transport
COUNTS: Transport
BITS: Transport
SEALED: Transport
PRIO3: Transport
RUN_STATE_UNSPECIFIED: RunState
CREATED: RunState
RUNNING: RunState
COMPLETED: RunState
FAILED: RunState
CANCELLED: RunState
BUDGET_EXHAUSTED: RunState

class Tensor(_message.Message):
    __slots__ = ("shape", "f64")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    F64_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    f64: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., f64: _Optional[bytes] = ...) -> None: ...

class RandomizerSpec(_message.Message):
    __slots__ = ("protocol", "clip_norm", "dim", "g", "m", "p", "eps0", "sigma", "messages_per_user", "message_bytes", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    G_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    P_FIELD_NUMBER: _ClassVar[int]
    EPS0_FIELD_NUMBER: _ClassVar[int]
    SIGMA_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_PER_USER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    clip_norm: float
    dim: int
    g: int
    m: int
    p: float
    eps0: float
    sigma: float
    messages_per_user: int
    message_bytes: int
    extra: _containers.ScalarMap[str, float]
    def __init__(self, protocol: _Optional[str] = ..., clip_norm: _Optional[float] = ..., dim: _Optional[int] = ..., g: _Optional[int] = ..., m: _Optional[int] = ..., p: _Optional[float] = ..., eps0: _Optional[float] = ..., sigma: _Optional[float] = ..., messages_per_user: _Optional[int] = ..., message_bytes: _Optional[int] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PrivacyCost(_message.Message):
    __slots__ = ("eps", "delta", "accountant", "trust_model")
    EPS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    TRUST_MODEL_FIELD_NUMBER: _ClassVar[int]
    eps: float
    delta: float
    accountant: str
    trust_model: TrustModel
    def __init__(self, eps: _Optional[float] = ..., delta: _Optional[float] = ..., accountant: _Optional[str] = ..., trust_model: _Optional[_Union[TrustModel, str]] = ...) -> None: ...

class RoundSpec(_message.Message):
    __slots__ = ("run_id", "round", "schedule", "trust_model", "transport", "randomizer", "model", "task", "num_classes", "cohort_size", "min_contributors", "deadline_seconds", "per_user_cost", "analyzer_public_key", "local_batch", "l2", "smoothing", "participation", "hidden", "check_in", "sampling_rate", "population", "model_name", "model_digest", "signed", "report_goal", "prio3", "verify_key")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    TRUST_MODEL_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RANDOMIZER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    COHORT_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PER_USER_COST_FIELD_NUMBER: _ClassVar[int]
    ANALYZER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_FIELD_NUMBER: _ClassVar[int]
    L2_FIELD_NUMBER: _ClassVar[int]
    SMOOTHING_FIELD_NUMBER: _ClassVar[int]
    PARTICIPATION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CHECK_IN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_RATE_FIELD_NUMBER: _ClassVar[int]
    POPULATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNED_FIELD_NUMBER: _ClassVar[int]
    REPORT_GOAL_FIELD_NUMBER: _ClassVar[int]
    PRIO3_FIELD_NUMBER: _ClassVar[int]
    VERIFY_KEY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    schedule: Schedule
    trust_model: TrustModel
    transport: Transport
    randomizer: RandomizerSpec
    model: Tensor
    task: str
    num_classes: int
    cohort_size: int
    min_contributors: int
    deadline_seconds: float
    per_user_cost: PrivacyCost
    analyzer_public_key: bytes
    local_batch: int
    l2: float
    smoothing: float
    participation: ParticipationLimit
    hidden: int
    check_in: CheckIn
    sampling_rate: float
    population: int
    model_name: str
    model_digest: str
    signed: SignedSpec
    report_goal: int
    prio3: Prio3Spec
    verify_key: bytes
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., schedule: _Optional[_Union[Schedule, str]] = ..., trust_model: _Optional[_Union[TrustModel, str]] = ..., transport: _Optional[_Union[Transport, str]] = ..., randomizer: _Optional[_Union[RandomizerSpec, _Mapping]] = ..., model: _Optional[_Union[Tensor, _Mapping]] = ..., task: _Optional[str] = ..., num_classes: _Optional[int] = ..., cohort_size: _Optional[int] = ..., min_contributors: _Optional[int] = ..., deadline_seconds: _Optional[float] = ..., per_user_cost: _Optional[_Union[PrivacyCost, _Mapping]] = ..., analyzer_public_key: _Optional[bytes] = ..., local_batch: _Optional[int] = ..., l2: _Optional[float] = ..., smoothing: _Optional[float] = ..., participation: _Optional[_Union[ParticipationLimit, _Mapping]] = ..., hidden: _Optional[int] = ..., check_in: _Optional[_Union[CheckIn, _Mapping]] = ..., sampling_rate: _Optional[float] = ..., population: _Optional[int] = ..., model_name: _Optional[str] = ..., model_digest: _Optional[str] = ..., signed: _Optional[_Union[SignedSpec, _Mapping]] = ..., report_goal: _Optional[int] = ..., prio3: _Optional[_Union[Prio3Spec, _Mapping]] = ..., verify_key: _Optional[bytes] = ...) -> None: ...

class Prio3Spec(_message.Message):
    __slots__ = ("vdaf",)
    VDAF_FIELD_NUMBER: _ClassVar[int]
    vdaf: str
    def __init__(self, vdaf: _Optional[str] = ...) -> None: ...

class SignedSpec(_message.Message):
    __slots__ = ("spec", "signature", "certificate")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    spec: bytes
    signature: bytes
    certificate: bytes
    def __init__(self, spec: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., certificate: _Optional[bytes] = ...) -> None: ...

class CheckIn(_message.Message):
    __slots__ = ("noise_trials", "report_fraction", "checked_in")
    NOISE_TRIALS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    CHECKED_IN_FIELD_NUMBER: _ClassVar[int]
    noise_trials: int
    report_fraction: float
    checked_in: int
    def __init__(self, noise_trials: _Optional[int] = ..., report_fraction: _Optional[float] = ..., checked_in: _Optional[int] = ...) -> None: ...

class ParticipationLimit(_message.Message):
    __slots__ = ("max_per_tree", "min_separation", "rounds_per_tree")
    MAX_PER_TREE_FIELD_NUMBER: _ClassVar[int]
    MIN_SEPARATION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PER_TREE_FIELD_NUMBER: _ClassVar[int]
    max_per_tree: int
    min_separation: int
    rounds_per_tree: int
    def __init__(self, max_per_tree: _Optional[int] = ..., min_separation: _Optional[int] = ..., rounds_per_tree: _Optional[int] = ...) -> None: ...

class Invitation(_message.Message):
    __slots__ = ("spec", "user_ids", "eligible", "signed_spec", "checked_in")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_SPEC_FIELD_NUMBER: _ClassVar[int]
    CHECKED_IN_FIELD_NUMBER: _ClassVar[int]
    spec: RoundSpec
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    eligible: int
    signed_spec: SignedSpec
    checked_in: int
    def __init__(self, spec: _Optional[_Union[RoundSpec, _Mapping]] = ..., user_ids: _Optional[_Iterable[str]] = ..., eligible: _Optional[int] = ..., signed_spec: _Optional[_Union[SignedSpec, _Mapping]] = ..., checked_in: _Optional[int] = ...) -> None: ...

class CountVector(_message.Message):
    __slots__ = ("counts", "packed")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    packed: bytes
    def __init__(self, counts: _Optional[_Iterable[int]] = ..., packed: _Optional[bytes] = ...) -> None: ...

class SealedMessages(_message.Message):
    __slots__ = ("ciphertexts",)
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    ciphertexts: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ciphertexts: _Optional[_Iterable[bytes]] = ...) -> None: ...

class UserMessage(_message.Message):
    __slots__ = ("user_id", "nonce", "counts", "sealed")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    nonce: bytes
    counts: CountVector
    sealed: SealedMessages
    def __init__(self, user_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., counts: _Optional[_Union[CountVector, _Mapping]] = ..., sealed: _Optional[_Union[SealedMessages, _Mapping]] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("user_id", "reason")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    reason: str
    def __init__(self, user_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class UserColumns(_message.Message):
    __slots__ = ("user_ids", "nonces", "nonce_bytes", "counts", "sums", "sum_users", "reports")
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    NONCES_FIELD_NUMBER: _ClassVar[int]
    NONCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    SUM_USERS_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    nonces: bytes
    nonce_bytes: int
    counts: bytes
    sums: bytes
    sum_users: int
    reports: _containers.RepeatedCompositeFieldContainer[Prio3Report]
    def __init__(self, user_ids: _Optional[_Iterable[str]] = ..., nonces: _Optional[bytes] = ..., nonce_bytes: _Optional[int] = ..., counts: _Optional[bytes] = ..., sums: _Optional[bytes] = ..., sum_users: _Optional[int] = ..., reports: _Optional[_Iterable[_Union[Prio3Report, _Mapping]]] = ...) -> None: ...

class Prio3Report(_message.Message):
    __slots__ = ("report_id", "public_share", "leader_share", "helper_share")
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_SHARE_FIELD_NUMBER: _ClassVar[int]
    LEADER_SHARE_FIELD_NUMBER: _ClassVar[int]
    HELPER_SHARE_FIELD_NUMBER: _ClassVar[int]
    report_id: bytes
    public_share: bytes
    leader_share: bytes
    helper_share: bytes
    def __init__(self, report_id: _Optional[bytes] = ..., public_share: _Optional[bytes] = ..., leader_share: _Optional[bytes] = ..., helper_share: _Optional[bytes] = ...) -> None: ...

class HelperReport(_message.Message):
    __slots__ = ("report_id", "public_share", "helper_share", "leader_prep_share", "users")
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_SHARE_FIELD_NUMBER: _ClassVar[int]
    HELPER_SHARE_FIELD_NUMBER: _ClassVar[int]
    LEADER_PREP_SHARE_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    report_id: bytes
    public_share: bytes
    helper_share: bytes
    leader_prep_share: bytes
    users: int
    def __init__(self, report_id: _Optional[bytes] = ..., public_share: _Optional[bytes] = ..., helper_share: _Optional[bytes] = ..., leader_prep_share: _Optional[bytes] = ..., users: _Optional[int] = ...) -> None: ...

class AggregationRequest(_message.Message):
    __slots__ = ("run_id", "round", "preps")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PREPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    preps: _containers.RepeatedCompositeFieldContainer[HelperPrep]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., preps: _Optional[_Iterable[_Union[HelperPrep, _Mapping]]] = ...) -> None: ...

class HelperPrep(_message.Message):
    __slots__ = ("report_id", "prep_share")
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    PREP_SHARE_FIELD_NUMBER: _ClassVar[int]
    report_id: bytes
    prep_share: bytes
    def __init__(self, report_id: _Optional[bytes] = ..., prep_share: _Optional[bytes] = ...) -> None: ...

class LeaderAggregate(_message.Message):
    __slots__ = ("released", "aggregate_share", "reports", "contributors", "rejected")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    AGGREGATE_SHARE_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    aggregate_share: bytes
    reports: int
    contributors: int
    rejected: _containers.ScalarMap[str, int]
    def __init__(self, released: _Optional[bool] = ..., aggregate_share: _Optional[bytes] = ..., reports: _Optional[int] = ..., contributors: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Contribution(_message.Message):
    __slots__ = ("run_id", "round", "node_id", "messages", "refusals", "columns")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    node_id: str
    messages: _containers.RepeatedCompositeFieldContainer[UserMessage]
    refusals: _containers.RepeatedCompositeFieldContainer[Refusal]
    columns: UserColumns
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., node_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[UserMessage, _Mapping]]] = ..., refusals: _Optional[_Iterable[_Union[Refusal, _Mapping]]] = ..., columns: _Optional[_Union[UserColumns, _Mapping]] = ...) -> None: ...

class ContributionAck(_message.Message):
    __slots__ = ("accepted", "rejected")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected: _containers.ScalarMap[str, int]
    def __init__(self, accepted: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ...) -> None: ...

class BatchReport(_message.Message):
    __slots__ = ("invited", "contributors", "rejected", "refused", "below_threshold", "refused_reasons", "not_in_run", "checked_in", "eligible", "excluded_silent")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INVITED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    BELOW_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REASONS_FIELD_NUMBER: _ClassVar[int]
    NOT_IN_RUN_FIELD_NUMBER: _ClassVar[int]
    CHECKED_IN_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_SILENT_FIELD_NUMBER: _ClassVar[int]
    invited: int
    contributors: int
    rejected: _containers.ScalarMap[str, int]
    refused: int
    below_threshold: bool
    refused_reasons: _containers.ScalarMap[str, int]
    not_in_run: int
    checked_in: int
    eligible: int
    excluded_silent: int
    def __init__(self, invited: _Optional[int] = ..., contributors: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., refused: _Optional[int] = ..., below_threshold: _Optional[bool] = ..., refused_reasons: _Optional[_Mapping[str, int]] = ..., not_in_run: _Optional[int] = ..., checked_in: _Optional[int] = ..., eligible: _Optional[int] = ..., excluded_silent: _Optional[int] = ...) -> None: ...

class ShuffledBatch(_message.Message):
    __slots__ = ("run_id", "round", "released", "label_totals", "ciphertexts", "report", "reports")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOTALS_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    round: int
    released: bool
    label_totals: _containers.RepeatedScalarFieldContainer[int]
    ciphertexts: _containers.RepeatedScalarFieldContainer[bytes]
    report: BatchReport
    reports: _containers.RepeatedCompositeFieldContainer[HelperReport]
    def __init__(self, run_id: _Optional[str] = ..., round: _Optional[int] = ..., released: _Optional[bool] = ..., label_totals: _Optional[_Iterable[int]] = ..., ciphertexts: _Optional[_Iterable[bytes]] = ..., report: _Optional[_Union[BatchReport, _Mapping]] = ..., reports: _Optional[_Iterable[_Union[HelperReport, _Mapping]]] = ...) -> None: ...

class RegisterUsersRequest(_message.Message):
    __slots__ = ("node_id", "user_ids")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., user_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterUsersResponse(_message.Message):
    __slots__ = ("admitted", "total_users")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_USERS_FIELD_NUMBER: _ClassVar[int]
    admitted: int
    total_users: int
    def __init__(self, admitted: _Optional[int] = ..., total_users: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class NodeMessage(_message.Message):
    __slots__ = ("seq", "subscribe", "contribution")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    subscribe: SubscribeRequest
    contribution: Contribution
    def __init__(self, seq: _Optional[int] = ..., subscribe: _Optional[_Union[SubscribeRequest, _Mapping]] = ..., contribution: _Optional[_Union[Contribution, _Mapping]] = ...) -> None: ...

class SubmitResult(_message.Message):
    __slots__ = ("seq", "ack", "status", "details", "reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ack: ContributionAck
    status: str
    details: str
    reason: str
    def __init__(self, seq: _Optional[int] = ..., ack: _Optional[_Union[ContributionAck, _Mapping]] = ..., status: _Optional[str] = ..., details: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ShufflerMessage(_message.Message):
    __slots__ = ("invitation", "result")
    INVITATION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    invitation: Invitation
    result: SubmitResult
    def __init__(self, invitation: _Optional[_Union[Invitation, _Mapping]] = ..., result: _Optional[_Union[SubmitResult, _Mapping]] = ...) -> None: ...

class PopulationRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class PopulationStatus(_message.Message):
    __slots__ = ("admitted_users", "unused_users", "connected_nodes", "refused_nodes")
    ADMITTED_USERS_FIELD_NUMBER: _ClassVar[int]
    UNUSED_USERS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_NODES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_NODES_FIELD_NUMBER: _ClassVar[int]
    admitted_users: int
    unused_users: int
    connected_nodes: int
    refused_nodes: _containers.RepeatedCompositeFieldContainer[RefusedNode]
    def __init__(self, admitted_users: _Optional[int] = ..., unused_users: _Optional[int] = ..., connected_nodes: _Optional[int] = ..., refused_nodes: _Optional[_Iterable[_Union[RefusedNode, _Mapping]]] = ...) -> None: ...

class RefusedNode(_message.Message):
    __slots__ = ("node", "reason", "details", "calls")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    node: str
    reason: str
    details: str
    calls: int
    def __init__(self, node: _Optional[str] = ..., reason: _Optional[str] = ..., details: _Optional[str] = ..., calls: _Optional[int] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("config_toml",)
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    config_toml: str
    def __init__(self, config_toml: _Optional[str] = ...) -> None: ...

class RunRef(_message.Message):
    __slots__ = ("run_id", "wait_ms", "seen_rounds", "seen_state", "seen_message", "metrics_from")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    SEEN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SEEN_STATE_FIELD_NUMBER: _ClassVar[int]
    SEEN_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FROM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    wait_ms: int
    seen_rounds: int
    seen_state: RunState
    seen_message: str
    metrics_from: int
    def __init__(self, run_id: _Optional[str] = ..., wait_ms: _Optional[int] = ..., seen_rounds: _Optional[int] = ..., seen_state: _Optional[_Union[RunState, str]] = ..., seen_message: _Optional[str] = ..., metrics_from: _Optional[int] = ...) -> None: ...

class BudgetStatus(_message.Message):
    __slots__ = ("eps_spent", "delta_spent", "eps_reserved", "delta_reserved", "eps_limit", "delta_limit", "accountant", "trust_model", "rounds_committed", "honest_fraction", "eps_spent_robust", "views")
    class ViewsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPS_SPENT_FIELD_NUMBER: _ClassVar[int]
    DELTA_SPENT_FIELD_NUMBER: _ClassVar[int]
    EPS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    DELTA_RESERVED_FIELD_NUMBER: _ClassVar[int]
    EPS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    DELTA_LIMIT_FIELD_NUMBER: _ClassVar[int]
    ACCOUNTANT_FIELD_NUMBER: _ClassVar[int]
    TRUST_MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    HONEST_FRACTION_FIELD_NUMBER: _ClassVar[int]
    EPS_SPENT_ROBUST_FIELD_NUMBER: _ClassVar[int]
    VIEWS_FIELD_NUMBER: _ClassVar[int]
    eps_spent: float
    delta_spent: float
    eps_reserved: float
    delta_reserved: float
    eps_limit: float
    delta_limit: float
    accountant: str
    trust_model: TrustModel
    rounds_committed: int
    honest_fraction: float
    eps_spent_robust: float
    views: _containers.ScalarMap[str, float]
    def __init__(self, eps_spent: _Optional[float] = ..., delta_spent: _Optional[float] = ..., eps_reserved: _Optional[float] = ..., delta_reserved: _Optional[float] = ..., eps_limit: _Optional[float] = ..., delta_limit: _Optional[float] = ..., accountant: _Optional[str] = ..., trust_model: _Optional[_Union[TrustModel, str]] = ..., rounds_committed: _Optional[int] = ..., honest_fraction: _Optional[float] = ..., eps_spent_robust: _Optional[float] = ..., views: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RoundMetrics(_message.Message):
    __slots__ = ("round", "contributors", "loss", "accuracy", "eps_spent", "delta_spent", "released", "seconds", "rejected", "refused", "refused_reasons", "failure", "excess_risk", "eps_spent_local", "not_in_run", "checked_in", "excluded_silent")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    EPS_SPENT_FIELD_NUMBER: _ClassVar[int]
    DELTA_SPENT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REASONS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    EXCESS_RISK_FIELD_NUMBER: _ClassVar[int]
    EPS_SPENT_LOCAL_FIELD_NUMBER: _ClassVar[int]
    NOT_IN_RUN_FIELD_NUMBER: _ClassVar[int]
    CHECKED_IN_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_SILENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    contributors: int
    loss: float
    accuracy: float
    eps_spent: float
    delta_spent: float
    released: bool
    seconds: float
    rejected: _containers.ScalarMap[str, int]
    refused: int
    refused_reasons: _containers.ScalarMap[str, int]
    failure: str
    excess_risk: float
    eps_spent_local: float
    not_in_run: int
    checked_in: int
    excluded_silent: int
    def __init__(self, round: _Optional[int] = ..., contributors: _Optional[int] = ..., loss: _Optional[float] = ..., accuracy: _Optional[float] = ..., eps_spent: _Optional[float] = ..., delta_spent: _Optional[float] = ..., released: _Optional[bool] = ..., seconds: _Optional[float] = ..., rejected: _Optional[_Mapping[str, int]] = ..., refused: _Optional[int] = ..., refused_reasons: _Optional[_Mapping[str, int]] = ..., failure: _Optional[str] = ..., excess_risk: _Optional[float] = ..., eps_spent_local: _Optional[float] = ..., not_in_run: _Optional[int] = ..., checked_in: _Optional[int] = ..., excluded_silent: _Optional[int] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "state", "rounds_done", "rounds_planned", "budget", "metrics", "message", "metrics_from")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_DONE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_PLANNED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FROM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: RunState
    rounds_done: int
    rounds_planned: int
    budget: BudgetStatus
    metrics: _containers.RepeatedCompositeFieldContainer[RoundMetrics]
    message: str
    metrics_from: int
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., rounds_done: _Optional[int] = ..., rounds_planned: _Optional[int] = ..., budget: _Optional[_Union[BudgetStatus, _Mapping]] = ..., metrics: _Optional[_Iterable[_Union[RoundMetrics, _Mapping]]] = ..., message: _Optional[str] = ..., metrics_from: _Optional[int] = ...) -> None: ...

class RunResult(_message.Message):
    __slots__ = ("status", "model", "ledger_json", "config_toml", "loss", "accuracy", "excess_risk")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LEDGER_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TOML_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    EXCESS_RISK_FIELD_NUMBER: _ClassVar[int]
    status: RunStatus
    model: Tensor
    ledger_json: str
    config_toml: str
    loss: float
    accuracy: float
    excess_risk: float
    def __init__(self, status: _Optional[_Union[RunStatus, _Mapping]] = ..., model: _Optional[_Union[Tensor, _Mapping]] = ..., ledger_json: _Optional[str] = ..., config_toml: _Optional[str] = ..., loss: _Optional[float] = ..., accuracy: _Optional[float] = ..., excess_risk: _Optional[float] = ...) -> None: ...

class NodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "users", "rounds_joined", "refusals")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_JOINED_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    users: int
    rounds_joined: int
    refusals: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., users: _Optional[int] = ..., rounds_joined: _Optional[int] = ..., refusals: _Optional[_Mapping[str, int]] = ...) -> None: ...
