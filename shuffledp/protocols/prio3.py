"""Transport PRIO3 (issue 45; design 5.2): PVEC's count vectors as Prio3SumVec reports, so that the shuffler adds
them up without reading one.

The VDAF is the `prio` crate's (draft-irtf-cfrg-vdaf-18), through the binding in native/ (`shuffledp_prio`); nothing
of the field arithmetic or the proofs is written here. The roles are DAP's (draft-ietf-ppm-dap): the shuffler is the
Leader (it keeps the identities and the uploads), the analyzer the Helper and the Collector. Per round:

    node      shard(...)               one report per group of users' summed counts (UserColumns.sums' groups), the
                                       Helper's input share HPKE-sealed to the analyzer's key from the signed spec
    shuffler  leader_init(...)         prepare_init as aggregator 0 -> HelperReports in a CSPRNG-permuted order
    analyzer  helper_prepare(...)      open, prepare_init as aggregator 1, combine both prep shares (the FLP decision),
                                       prepare_next -> its output shares, and its prep shares for the Leader
    shuffler  leader_finish(...)       combines the same prep shares itself, prepare_next -> its aggregate share,
                                       released only over at least the round's threshold of users
    analyzer  unshard(...)             the per-label totals (count mode's view, design 5.2)

Each party checks what protects its own guarantee: both refuse a report id seen before (draft-18 sec 9.2) and both
decide validity themselves (each combines the two prep shares); the Leader releases its share only over at least the
threshold of users, once per round. The VDAF context string binds every report to its run and round, and the sealed
Helper share carries its report id: a report replayed into another round or under another id does not verify.
"""

from __future__ import annotations

import functools
import os
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shuffledp.security import sealing
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = [
    "VDAFS",
    "DEFAULT_VDAF",
    "REPORT_ID_BYTES",
    "VERIFY_KEY_BYTES",
    "MAX_SHARE_BYTES",
    "MISSING",
    "REPLAYED_REPORT",
    "MALFORMED_REPORT",
    "INVALID_PROOF",
    "UNDECRYPTABLE",
    "HELPER_REJECTED",
    "available",
    "new_verify_key",
    "Vdaf",
    "shard",
    "LeaderReport",
    "leader_init",
    "leader_finish",
    "HelperResult",
    "helper_prepare",
    "unshard",
]

# name -> the binding's class: draft-18's Prio3SumVec (Field128, one proof, sec 7.4.3) and the draft's
# Prio3SumVecWithMultiproof (Field64, three proofs): the two choices the draft allows for this circuit
VDAFS = {"prio3sumvec": "Prio3SumVec", "prio3sumvec-field64x3": "Prio3SumVecField64Multiproof"}
DEFAULT_VDAF = "prio3sumvec"
REPORT_ID_BYTES = 16  # the VDAF nonce (draft-18 sec 5: NONCE_SIZE = 16)
VERIFY_KEY_BYTES = 32  # draft-18 sec 7: VERIFY_KEY_SIZE of Prio3 (XofTurboShake128's seed size)
MAX_SHARE_BYTES = 1024  # a sealed Helper share (its seeds) or a public share is ~100 bytes; a bound on what is held
# field moduli (draft-18 sec 6.1.2): max_measurement must lie below them, and so must every total
_MODULUS = {"prio3sumvec": 2**66 * 4611686018427387897 + 1, "prio3sumvec-field64x3": 2**32 * 4294967295 + 1}

# rejection reasons (design 5.3), counted per user of the report, at the party that found them
REPLAYED_REPORT = "replayed_report"  # a report id seen before in this run (or twice in one round)
MALFORMED_REPORT = "malformed_report"  # a share or id that does not decode as the round's VDAF (wrong length...)
INVALID_PROOF = "invalid_proof"  # the joint verification rejected it: an entry out of range, a forged proof, a
# share of another report
UNDECRYPTABLE = "undecryptable"  # the sealed Helper share does not open (protocols.base.UNDECRYPTABLE)
HELPER_REJECTED = "rejected_by_helper"  # the Leader's count of reports the Helper left out (the Helper says why)

MISSING = (
    'transport PRIO3 (privacy.pvec.aggregation = "prio3") needs the Prio3 binding shuffledp_prio (native/, Rust): '
    "install a Rust toolchain (cargo) and run `SHUFFLEDP_EXTRAS=prio3 bash scripts/_venv.sh` (the extra prio3), or "
    "`pip install ./native`"
)


def available() -> bool:
    """Whether the binding is installed here."""
    try:
        import shuffledp_prio  # noqa: F401
    except ImportError:
        return False
    return True


def _binding() -> Any:
    try:
        import shuffledp_prio
    except ImportError:
        raise RuntimeError(MISSING) from None
    return shuffledp_prio


def _reason(exc: ValueError) -> str:
    """The rejection reason of a failed preparation: the joint verification's (VerificationError), else the report
    did not decode as the round's VDAF."""
    return INVALID_PROOF if isinstance(exc, _binding().VerificationError) else MALFORMED_REPORT


def new_verify_key() -> bytes:
    """A round's verification key (the analyzer draws it; draft-18 sec 9.1: uniformly random, secret from clients)."""
    return secrets.token_bytes(VERIFY_KEY_BYTES)


def context(run_id: str, round_index: int) -> bytes:
    """The VDAF's application context string (draft-18 sec 4): the run and round, as HPKE's info binds them."""
    return b"shuffledp.v1/prio3/" + sealing.round_info(run_id, round_index)


@functools.lru_cache(maxsize=256)
def _instance(vdaf: str, dim: int, max_measurement: int, ctx: bytes) -> Any:
    cls = getattr(_binding(), VDAFS[vdaf])
    return cls(dim, max_measurement, ctx=ctx)


@dataclass(frozen=True)
class Vdaf:
    """A round's VDAF: dim entries, each user's counts in [0, bound] (bound = g + m), bound to (run_id, round)."""

    name: str
    dim: int
    bound: int
    run_id: str
    round: int

    def __post_init__(self) -> None:
        if self.name not in VDAFS:
            raise ValueError(f"prio3 vdaf must be one of {sorted(VDAFS)}, got {self.name!r}")
        if self.dim < 1 or self.bound < 1:
            raise ValueError(f"prio3 needs dim >= 1 and g + m >= 1, got dim={self.dim}, g+m={self.bound}")

    def max_users(self) -> int:
        """The most users one report may sum: users * (g + m) must lie below the field's modulus."""
        return (_MODULUS[self.name] - 1) // self.bound

    def of(self, users: int) -> Any:
        """The binding's instance for a report of `users` users: range [0, users * (g + m)] per entry (the bound the
        shuffler checks in the clear in COUNTS, shuffler_checks.add_sums)."""
        if not 1 <= users <= self.max_users():
            raise ValueError(f"a report sums 1..{self.max_users()} users, got {users}")
        return _instance(self.name, self.dim, users * self.bound, context(self.run_id, self.round))

    @property
    def info(self) -> bytes:
        return sealing.round_info(self.run_id, self.round)


def _map(fn: Any, items: Sequence[Any]) -> list[Any]:
    """fn over items on every core: the binding releases the GIL around each crate call."""
    workers = min(os.cpu_count() or 1, 8)
    if len(items) < 4 or workers < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers, thread_name_prefix="prio3") as pool:
        return list(pool.map(fn, items, chunksize=max(1, len(items) // (4 * workers))))


# ------------------------------------------------------------------------------------------------------------- node
def shard(vdaf: Vdaf, sums: np.ndarray, sizes: Sequence[int], analyzer_key: bytes) -> list[tuple[bytes, ...]]:
    """One report per group (row of `sums`, the summed counts of sizes[j] users): (report_id, public_share,
    leader_share, sealed helper share). Fresh randomness from the OS CSPRNG (the binding's, and the report id)."""

    def one(j: int) -> tuple[bytes, ...]:
        rid = secrets.token_bytes(REPORT_ID_BYTES)
        public, leader, helper = vdaf.of(int(sizes[j])).shard(sums[j], rid)
        return rid, public, leader, sealing.seal(analyzer_key, rid + helper, vdaf.info)

    return _map(one, range(len(sizes)))


# ---------------------------------------------------------------------------------------------------------- leader
@dataclass
class LeaderReport:
    """A report the Leader prepared: what it keeps (state, prep share) and what goes to the Helper."""

    report_id: bytes
    public_share: bytes
    helper_share: bytes
    users: int
    state: bytes
    prep_share: bytes

    def for_helper(self) -> pb.HelperReport:
        """What the Helper receives of this report (ShuffledBatch.reports): never the Leader's share or state."""
        return pb.HelperReport(
            report_id=self.report_id,
            public_share=self.public_share,
            helper_share=self.helper_share,
            leader_prep_share=self.prep_share,
            users=self.users,
        )


def leader_init(
    vdaf: Vdaf, verify_key: bytes, reports: Sequence[tuple[bytes, bytes, bytes, bytes, int]]
) -> tuple[list[LeaderReport], Counter]:
    """prepare_init as aggregator 0 for each (report_id, public_share, leader_share, sealed helper share, users):
    (the prepared reports, users rejected by reason). The caller checked ids and sizes (shuffler_checks)."""

    def one(rep: tuple[bytes, bytes, bytes, bytes, int]) -> LeaderReport | None:
        rid, public, leader, helper, users = rep
        try:
            state, share = vdaf.of(users).prepare_init(verify_key, 0, rid, public, leader)
        except ValueError:  # the binding's VdafError / DecodeError: not a report of this round's VDAF
            return None
        return LeaderReport(rid, public, helper, users, state, share)

    out: list[LeaderReport] = []
    rejected: Counter = Counter()
    for rep, done in zip(reports, _map(one, reports), strict=True):
        if done is None:
            rejected[MALFORMED_REPORT] += rep[4]
        else:
            out.append(done)
    return out, rejected


def leader_finish(
    vdaf: Vdaf, prepared: dict[bytes, LeaderReport], preps: Iterable[tuple[bytes, bytes]]
) -> tuple[bytes | None, int, int, Counter]:
    """The Leader's part once the Helper answered with its prep shares (report_id, prep_share): it combines both prep
    shares itself (the FLP decision is its own, not the Helper's word) and finishes the valid reports. Returns (its
    aggregate share or None when no report is valid, valid reports, their users, users rejected by reason). A report
    the Helper left out is counted as HELPER_REJECTED (the Helper's own counts say why); an id the Leader does not
    hold, or given twice, is ignored and so cannot count twice."""
    given: dict[bytes, bytes] = {}
    for rid, share in preps:
        given.setdefault(bytes(rid), bytes(share))
    todo = [(p, given[rid]) for rid, p in prepared.items() if rid in given]
    rejected: Counter = Counter()
    missing = sum(p.users for rid, p in prepared.items() if rid not in given)
    if missing:
        rejected[HELPER_REJECTED] += missing

    def one(item: tuple[LeaderReport, bytes]) -> bytes | str:
        p, helper_share = item
        inst = vdaf.of(p.users)
        try:
            message = inst.prep_shares_to_prep([p.prep_share, helper_share])
            return bytes(inst.prepare_next(p.state, message))
        except ValueError as exc:  # the binding's VdafError and its subclasses
            return _reason(exc)

    outs: list[bytes] = []
    users = 0
    for (p, _), done in zip(todo, _map(one, todo), strict=True):
        if isinstance(done, str):
            rejected[done] += p.users
        else:
            outs.append(done)
            users += p.users
    if not outs:
        return None, 0, 0, rejected
    # output shares are d field elements whatever the report's range: one instance adds them all (its encoding
    # depends on the field and the length only)
    return bytes(vdaf.of(1).aggregate(outs)), len(outs), users, rejected


# ---------------------------------------------------------------------------------------------------------- helper
@dataclass
class HelperResult:
    """The Helper's part of a round: its prep shares for the Leader (one per report it found valid), its aggregate
    share over those reports, their users, and the users it rejected by reason."""

    preps: list[tuple[bytes, bytes]]
    aggregate_share: bytes | None
    users: int
    rejected: Counter

    @property
    def reports(self) -> int:
        """The reports the Helper found valid."""
        return len(self.preps)


def helper_prepare(
    vdaf: Vdaf, verify_key: bytes, private_key: Any, reports: Sequence[Any], seen: set[bytes] | None = None
) -> HelperResult:
    """The Helper's verification of a batch's HelperReports (report_id, public_share, helper_share, leader_prep_share,
    users): open its sealed share (bound to the round and the report id), prepare_init as aggregator 1, combine both
    prep shares (the FLP decision), prepare_next. `seen`: report ids of the run so far (replays refused, then added)."""
    seen = set() if seen is None else seen
    rejected: Counter = Counter()
    todo = []
    for rep in reports:
        rid, users = bytes(rep.report_id), int(rep.users)
        if len(rid) != REPORT_ID_BYTES or not 1 <= users <= vdaf.max_users():
            rejected[MALFORMED_REPORT] += max(users, 1)
        elif rid in seen:
            rejected[REPLAYED_REPORT] += users
        else:
            seen.add(rid)
            todo.append(rep)

    def one(rep: Any) -> tuple[bytes, bytes, bytes] | str:
        rid = bytes(rep.report_id)
        try:
            plain = sealing.open_sealed(private_key, bytes(rep.helper_share), vdaf.info)
        except sealing.SealingError:
            return UNDECRYPTABLE
        if plain[:REPORT_ID_BYTES] != rid:  # a share sealed for another report: the Leader swapped it
            return INVALID_PROOF
        inst = vdaf.of(int(rep.users))
        try:
            state, share = inst.prepare_init(verify_key, 1, rid, bytes(rep.public_share), plain[REPORT_ID_BYTES:])
            message = inst.prep_shares_to_prep([bytes(rep.leader_prep_share), share])
            return rid, share, bytes(inst.prepare_next(state, message))
        except ValueError as exc:  # the binding's VdafError and its subclasses
            return _reason(exc)

    preps: list[tuple[bytes, bytes]] = []
    outs: list[bytes] = []
    users = 0
    for rep, done in zip(todo, _map(one, todo), strict=True):
        if isinstance(done, str):
            rejected[done] += int(rep.users)
            continue
        rid, share, out = done
        preps.append((rid, share))
        outs.append(out)
        users += int(rep.users)
    agg = bytes(vdaf.of(1).aggregate(outs)) if outs else None
    return HelperResult(preps, agg, users, rejected)


def unshard(vdaf: Vdaf, leader_share: bytes, helper_share: bytes, reports: int) -> np.ndarray:
    """The per-label totals (int64) from both aggregate shares (the Collector's step, draft-18 sec 5.4)."""
    totals = vdaf.of(1).unshard([leader_share, helper_share], reports)
    return np.asarray(totals, dtype=np.int64)
