"""The round-protocol plug-in interface (design sec 3.1): what the analyzer, the client node and the shuffler call.

A protocol is one module with one class implementing RoundProtocol, registered in shuffledp.protocols.registry.
The run manager (services/run_manager.py), the client node (clients/node.py, clients/policy.py) and the ledger
(services/ledger.py) call a protocol only through these methods; none of them holds a protocol-specific branch.
The shuffler needs no plug-in: what it does is fixed by RoundSpec.transport (COUNTS: add per-label counts and
forward the totals; BITS / SEALED: permute fixed-length ciphertexts and forward them without identities).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from shuffledp.settings import NoSettings, RunConfig
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = [
    "tensor",
    "tensor_to_array",
    "RoundProtocol",
    "PlanRequest",
    "RoundPlan",
    "Decoded",
    "BatchError",
    "open_each",
    "canonical_order",
    "release_floor",
    "UNDECRYPTABLE",
    "MALFORMED_PLAINTEXT",
    "AnalyzerHooks",
    "UserAccount",
    "Counts",
    "Nonces",
]

# The analyzer's own rejection reasons (design 5.3), counted per message in the round's metrics["rejected"]
UNDECRYPTABLE = "undecryptable"  # HPKE open failed: wrong key, wrong run/round (a replay), tampered or truncated
MALFORMED_PLAINTEXT = "malformed_plaintext"  # opened, but not a message of this round's randomizer


class Nonces(Sequence[bytes]):
    """A round's replay nonces, `width` bytes each, as one buffer (UserColumns' layout): a sequence of bytes to a
    protocol that sends one message per user, the buffer itself (.blob) to one that sends columns, with no object
    per user (issue 30 item 3: a node's memory per hosted user)."""

    def __init__(self, blob: bytes, width: int) -> None:
        if width <= 0 or len(blob) % width:
            raise ValueError(f"{len(blob)} bytes are not nonces of {width} bytes")
        self.blob, self.width = blob, width

    def __len__(self) -> int:
        return len(self.blob) // self.width

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.blob[i * self.width : (i + 1) * self.width]


def _opened(private_key: Any, ciphertexts: Sequence[bytes], info: bytes) -> Iterator[tuple[bytes, bytes | None]]:
    """(ciphertext, its plaintext or None when it does not open), in order."""
    from shuffledp.security import sealing

    for c in ciphertexts:
        try:
            yield c, sealing.open_sealed(private_key, c, info)
        except sealing.SealingError:
            yield c, None


def open_each(private_key: Any, ciphertexts: Sequence[bytes], info: bytes) -> tuple[list[bytes], int]:
    """(plaintexts of the ciphertexts that open, in order; how many did not, each an UNDECRYPTABLE message). A
    message that does not open is skipped, so one bad message cannot void the others; nothing of it is kept."""
    opened = [p for _, p in _opened(private_key, ciphertexts, info) if p is not None]
    return opened, len(ciphertexts) - len(opened)


def canonical_order(
    private_key: Any, ciphertexts: Sequence[bytes], info: bytes, rng: np.random.Generator
) -> list[bytes]:
    """A seeded simulation's order of a sealed batch (issue 46 item 3): the ciphertexts sorted by their plaintexts,
    then permuted by `rng`; those that do not open last, in the order they came. The shuffler's order follows the
    arrival of the nodes' messages and their sealing is keyed from OS entropy, so only an order the plaintexts decide
    lets a run replay bit for bit (float sums, PNSGD's pass). Never used outside a seeded simulation: it holds every
    plaintext at once, which pan-private decoding must not."""
    pairs = list(_opened(private_key, ciphertexts, info))
    opened = sorted((p, c) for c, p in pairs if p is not None)
    return [opened[i][1] for i in rng.permutation(len(opened))] + [c for c, p in pairs if p is None]


def release_floor(spec: pb.RoundSpec) -> int:
    """The fewest contributors a node certifies a round's amplification or sensitivity at: its min_contributors, but
    never more users than the spec itself says can contribute (its cohort, and in a check-in's second invitation the
    users who checked in). An honest spec's threshold lies within both (check_in.share: c_min <= c); one above them
    would have the node certify contributors the round cannot have (a lying shuffler or analyzer)."""
    n = max(int(spec.min_contributors), 1)
    for bound in (int(spec.cohort_size), int(spec.check_in.checked_in)):
        if bound > 0:
            n = min(n, bound)
    return n


@dataclass(frozen=True)
class PlanRequest:
    """What the run manager knows when it sizes a protocol (all public: sizes and configuration only)."""

    kind: str  # "sequential" | "fully_interactive" | "subsampled"
    eps: float  # the run's eps
    delta: float  # the run's delta
    rounds: int  # T
    cohort: int  # users invited per round (B, or n when fully interactive)
    min_contributors: int  # n_min
    dim: int
    clip_norm: float
    transport: str  # "counts" | "bits" | "sealed"
    admitted: int = 0  # users admitted at the shuffler (n)
    rounds_requested: int | None = None  # schedule.rounds as configured (None: as many as fit, for LDP protocols)
    min_contributors_fraction: float = 0.9  # privacy.min_contributors_fraction
    settings: Any = field(default_factory=NoSettings)  # the protocol's own table, [privacy.<name>] (its `settings`)
    options: dict[str, Any] = field(default_factory=dict)  # what else of the run a protocol may use (task, sampling)


@dataclass(frozen=True)
class RoundPlan:
    params: dict[str, Any]  # the protocol's parameters (JSON-able; the ledger's event params)
    composition: str  # across rounds: "parallel" | "rdp" | "advanced" (services/ledger.py)
    advanced_slack: float  # delta' of advanced composition, else 0
    noise_sq: float  # E||decoded sum - true sum||^2 at n_min contributors: what the optimizer's step size needs
    rounds: int | None = None  # T when the protocol sizes it from the budget (None: the schedule's T stands)
    min_contributors: int | None = None  # the release threshold when the protocol sets it (None: the schedule's)
    # keys of the protocol's own in the run's plan (PVEC: its check-in, protocols/pvec_round.py)
    plan_extra: dict[str, Any] = field(default_factory=dict)
    # the protocol releases only its last iterate (PNSGD): no per-round evaluation, the model only once the run
    # COMPLETED, and a round whose update no checkpoint holds is run again (services/run_manager.py)
    hidden_iterates: bool = False


class Decoded(NamedTuple):
    """A delivered batch, decoded: total = estimate of the sum of the `used` users' vectors, or None (failure)."""

    total: np.ndarray | None
    used: int  # contributors whose messages were decoded (n')
    charged: int  # contributors the round is committed with in the ledger
    rejected: dict[str, int]  # messages the analyzer skipped, by reason (design 5.3)
    failure: str = ""


Counts = tuple[tuple[str, int], ...]  # a user's counts in one run, sorted by key (hashable: costs are memoised)


@dataclass(frozen=True)
class UserAccount:
    """How a run's rounds compose for one user, as the user's node computes it from what it can verify itself: the
    spec's public parameters and what the shuffler tells it (design 6; issue 24 items 1-2). The node keeps, per user
    and run, counts of what happened to the user (joins, eligible rounds, leaves of a tree) and charges the user
    cost(counts) in all for the run: composed for the actual counts, never a share of a maximum, and never the
    amplified cost of only the rounds the user was sampled in. Protocols whose rounds compose by basic composition
    per participation have none (RoundProtocol.user_account returns None)."""

    run: str  # the run whose rounds compose
    join: str  # the count that joining this round adds one to
    # counted for every round the user is eligible for, sampled or not (amplification by sampling); None: not used
    eligible: str | None
    cost: Callable[[Counts], tuple[float, float]]  # (eps, delta) of a user's counts in the run; monotone in each
    allows: Callable[[Counts], bool] = lambda counts: True  # participation limits the node checks for its user


class BatchError(RuntimeError):
    """The batch cannot belong to this round (the shuffler broke the protocol): charged with `charged` (and, when
    the round ran with other parameters than reserved, those: `ran`), run stops."""

    def __init__(self, charged: int, message: str, ran: dict[str, Any] | None = None):
        self.charged = charged
        self.ran = ran
        super().__init__(message)


class RoundProtocol(Protocol):
    """One protocol's plug-in. `plan` is the run's plan dict (JSON, stored in the ledger); `params` the protocol's
    parameter object (params(plan)); events are services.ledger.PrivacyEvent (mechanism = name)."""

    name: str  # RandomizerSpec.protocol and PrivacyEvent.mechanism
    trust_model: int  # pb.TrustModel the protocol claims

    # ---- configuration (shuffledp/config.py checks these generically and delegates the rest)
    settings: type  # frozen dataclass of the protocol's table [privacy.<name>] (shuffledp.settings.setting fields)
    schedules: tuple[str, ...]  # the schedule.kind values it runs over
    transports: tuple[str, ...]  # the transport.mode values it sends in
    optimizers: tuple[str, ...]  # the schedule.optimizer values its released sums feed
    auto_optimizer: str | None  # what schedule.optimizer = "auto" resolves to; None: by schedule.kind
    poisson_sampling: bool  # whether its accountant covers schedule.sampling = "poisson"
    example: dict[str, dict[str, Any]]  # section keys that turn the embedded default into a run of this protocol

    def check_config(self, cfg: RunConfig, optimizer: str) -> None: ...

    # ---- analyzer: sizing, the spec, decoding
    def plan(self, req: PlanRequest) -> RoundPlan: ...
    def params(self, plan: dict[str, Any]) -> Any: ...
    def needs_keypair(self, plan: dict[str, Any]) -> bool: ...
    def spec_fields(self, plan: dict[str, Any], params: Any, event: Any, analyzer_public_key: bytes) -> dict: ...
    def decode(
        self, batch: pb.ShuffledBatch, n: int, plan: dict[str, Any], params: Any, private_key: Any, info: bytes
    ) -> Decoded: ...
    def event_params(self, plan: dict[str, Any], round_index: int) -> dict[str, Any]: ...
    def released(
        self, plan: dict[str, Any], params: Any, report: pb.BatchReport
    ) -> tuple[Any, int, dict[str, Any] | None]: ...

    # ---- analyzer: the noise it adds itself (central trust), with a state that lives in the run's checkpoints
    def noise_state(self, plan: dict[str, Any]) -> Any: ...
    def noise_from_arrays(self, plan: dict[str, Any], arrays: dict[str, np.ndarray]) -> Any: ...
    def add_noise(
        self,
        total: np.ndarray,
        round_index: int,
        plan: dict[str, Any],
        params: Any,
        state: Any,
        rng: np.random.Generator,
        used: int,
    ) -> tuple[np.ndarray, float, Any]: ...

    # ---- ledger: the privacy event's arithmetic
    def accountant_name(self, event: Any, composition: str) -> str: ...
    def round_cost(self, event: Any) -> tuple[float, float]: ...
    def compose(self, events: Sequence[Any], limit: Any, honest_fraction: float = 1.0) -> tuple[float, float]: ...
    def views(self, events: Sequence[Any], limit: Any) -> dict[str, float]: ...

    # optional, where the figures depend on the multiset of rounds only (not their order): compose_counts(items,
    # limit, honest_fraction) and views_counts(items, limit) with items = [(event, rounds with it)], equal to
    # compose / views of the rounds listed one by one; the ledger then composes a run per distinct event

    # ---- client node: the users' vectors, the randomizer and what a round costs its users, recomputed from the spec
    def supports(self, spec: pb.RoundSpec) -> bool: ...
    def local_vectors(self, spec: pb.RoundSpec, node: Any, idx: np.ndarray) -> np.ndarray: ...
    def randomize(
        self,
        spec: pb.RoundSpec,
        G: np.ndarray,
        user_ids: Sequence[str],
        nonces: Sequence[bytes],
        rng: np.random.Generator,
        out: pb.Contribution,
    ) -> None: ...
    def verify_epsilon(self, spec: pb.RoundSpec) -> float: ...
    def noise_key(self, spec: pb.RoundSpec) -> Any: ...
    def user_account(self, spec: pb.RoundSpec) -> UserAccount | None: ...

    # optional, for check-in rounds (mechanisms/check_in.py): prepare(spec, blocks, rng) computes what it can
    # once the users checked in (blocks: their vectors as arrays of consecutive rows, in order), and
    # randomize_prepared(spec, prepared, rows, user_ids, nonces, rng, out) -> bool answers the second invitation from
    # it (False: it does not fit that spec, and the node calls randomize). PvecRound has both.


class AnalyzerHooks:
    """Defaults of the configuration hooks (no table of its own, no extra check) and of the analyzer-side hooks,
    right for a protocol whose users randomize their own messages (shuffle and local trust): events carry the plan's
    parameters, the analyzer adds nothing, keeps no noise state, and takes the mean over the users it decoded.
    Central protocols override add_noise (and the state, if they keep one). On the client, the vector a user
    randomizes is its local batch's gradient at the broadcast model (a stateful estimator, DP-mu2's, overrides
    local_vectors)."""

    settings: type = NoSettings
    auto_optimizer: str | None = None
    poisson_sampling = False
    example: dict[str, dict[str, Any]] = {}

    def check_config(self, cfg: RunConfig, optimizer: str) -> None:
        """Combinations of the protocol's table with the rest of the run that the generic checks do not cover:
        raises shuffledp.settings.ConfigError naming the keys."""

    def local_vectors(self, spec: pb.RoundSpec, node: Any, idx: np.ndarray) -> np.ndarray:
        return node.batch_gradients(spec, idx)

    def user_account(self, spec: pb.RoundSpec) -> UserAccount | None:
        return None  # each participation is charged its verified cost, by basic composition

    def event_params(self, plan: dict[str, Any], round_index: int) -> dict[str, Any]:
        return plan["params"]

    def released(
        self, plan: dict[str, Any], params: Any, report: pb.BatchReport
    ) -> tuple[Any, int, dict[str, Any] | None]:
        """What a released round ran with, from the shuffler's report: (its parameters, its release threshold, the
        parameters to record in the ledger where they differ from the reservation, else None). Raises BatchError
        (charged, run stops) when the report admits no such round. Default: as planned."""
        return params, plan["min_contributors"], None

    def noise_state(self, plan: dict[str, Any]) -> None:
        return None

    def noise_from_arrays(self, plan: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        return None

    def add_noise(
        self,
        total: np.ndarray,
        round_index: int,
        plan: dict[str, Any],
        params: Any,
        state: Any,
        rng: np.random.Generator,
        used: int,
    ) -> tuple[np.ndarray, float, None]:
        return total, float(used), None


# ---- the wire's tensors (RoundSpec.model, the released model): float64 little-endian, row-major
def tensor(x: np.ndarray) -> pb.Tensor:
    x = np.ascontiguousarray(x, dtype="<f8")
    return pb.Tensor(shape=list(x.shape), f64=x.tobytes())


def tensor_to_array(t: pb.Tensor) -> np.ndarray:
    """Decode a wire Tensor (float64 little-endian, row-major)."""
    shape = tuple(int(s) for s in t.shape)
    a = np.frombuffer(t.f64, dtype="<f8")
    if a.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"tensor has {a.size} values but shape {shape}")
    return a.reshape(shape).astype(np.float64)
