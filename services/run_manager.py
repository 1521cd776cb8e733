"""The analyzer's run manager: run lifecycle, round planning, budget reservation, decoding, optimizer, checkpoints.

Transport-independent (the gRPC servicer in services/analyzer.py only converts messages). A round is one protocol
plug-in (shuffledp.protocols.registry: sizing, the spec's randomizer, decoding, the privacy event's arithmetic) plus
one optimizer (shuffledp.optimizers.registry: init / query / step / release); this module holds no branch for
either. Each started run executes in its own background thread:

    plan (once)    population from the shuffler (sizes only) -> T, cohort B (the optimizer's theory), threshold
                   n_min, delta, the protocol's parameters and composition rule, the optimizer's step sizes; stored
                   in the ledger with the (eps, delta) limit.
    each round r   reserve the worst-case cost in the ledger (BudgetExceeded -> the run stops BUDGET_EXHAUSTED and
                   no spec leaves) -> ExecuteRound at the shuffler (blocks until the deadline) -> released batch:
                   the protocol decodes it (skipping and counting bad messages), commit with the contributors it
                   used, optimizer step, evaluate on the public test split, checkpoint; not released: release the
                   reservation.
    restart        Ledger.recover() turns rounds left "reserved" into "spent_unknown"; RUNNING runs resume after the
                   last round ever reserved, from the last checkpoint (no round index is ever reused).

Planning (T, cohort, threshold, delta, the protocol's and the optimizer's parameters) is shuffledp.planning's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
import numpy as np
from shuffledp.services import aggregation
from shuffledp.services.checkpoints import RunState, decode_run_state, decode_state, encode_state
from shuffledp.services.evaluation import EvalData, HeldOut, evaluate
from shuffledp.services.ledger import (
    TERMINAL_STATES,
    BudgetExceeded,
    BudgetLimit,
    BudgetTotals,
    Ledger,
    LedgerError,
    PrivacyEvent,
    RunEnded,
)

from shuffledp.config import ConfigError, RunConfig, parse_config
from shuffledp.optimizers.base import Optimizer
from shuffledp.planning import PlanError, plan_run, planned_optimizer, round_spec
from shuffledp.protocols.base import (  # noqa: F401 (the rejection reasons are re-exported: their former home)
    MALFORMED_PLAINTEXT,
    UNDECRYPTABLE,
    BatchError,
    PlanRequest,
    RoundProtocol,
    canonical_order,
    tensor,
)
from shuffledp.protocols.registry import planned_protocol, round_protocol
from shuffledp.security import sealing
from shuffledp.security.rng import make_rng, simulation_seed
from shuffledp.transport import grpc_options
from shuffledp.transport.spec_signing import SIGNATURE_INVALID, SpecSigner
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

log = logging.getLogger(__name__)

__all__ = [
    "RunManager",
    "RunNotFound",
    "RunStateError",
    "RunView",
    "TERMINAL_STATES",
    "UNDECRYPTABLE",
    "MALFORMED_PLAINTEXT",
]

# gRPC codes with which the shuffler refuses a spec before collecting anything, marked as such by the shuffler's
# trailing metadata (grpc_options.ROUND_REFUSED_METADATA_KEY): no batch exists, so the reservation is released.
# The same codes can come from gRPC itself after a batch was collected (RESOURCE_EXHAUSTED: an answer above the
# receive limit), so without the mark the round stays charged, as after every other failure (issue 10 item 5).
_REFUSED_BEFORE_COLLECTION = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNIMPLEMENTED,
}
# Codes only the server's gRPC layer gives before any handler runs (role check, unknown method): nothing was
# collected whatever the metadata says.
_REFUSED_BEFORE_HANDLER = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
# GetPopulation (a read) failing so is asked again: the shuffler is down or busy. CANCELLED too: a shuffler that 10^4
# devices connect to at once cancels some calls it has no time to pick up, the analyzer's among them (issue 44)
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
_PROBE_SECONDS = 10.0  # GetPopulation before each round: is the shuffler there at all?
_MAX_BACKOFF_SECONDS = 30.0
_RPC_GRACE_SECONDS = 30.0  # ExecuteRound returns at the deadline; allow this much for transfer and aggregation
_MAX_CONSECUTIVE_FAILURES = 3


def _refused_before_collection(exc: grpc.RpcError) -> bool:
    """True only when the shuffler says no batch of this round exists (see _REFUSED_BEFORE_COLLECTION)."""
    code = exc.code()
    if code in _REFUSED_BEFORE_HANDLER:
        return True
    marks = dict(exc.trailing_metadata() or ())
    return code in _REFUSED_BEFORE_COLLECTION and marks.get(grpc_options.ROUND_REFUSED_METADATA_KEY) == code.name


class RunNotFound(LookupError):
    """No run with this id."""


class RunStateError(RuntimeError):
    """The operation does not fit the run's state (e.g. StartRun on a completed run)."""


class _Cancelled(Exception):
    """The operator cancelled the run (seen by its thread between rounds, or while it waits for the population)."""


_CANCELLED = "cancelled by the operator"


# ------------------------------------------------------------------------------------------------- planning


def round_event(protocol: RoundProtocol, plan: dict[str, Any], r: int) -> PrivacyEvent:
    """The privacy event the ledger charges for round r of a planned run."""
    return PrivacyEvent(
        protocol.name,
        protocol.event_params(plan, r),
        plan["min_contributors"],
        plan["kind"],
        pb.TrustModel.Name(protocol.trust_model).lower(),
    )


def policy_refusal(cfg: RunConfig, plan: dict[str, Any]) -> str | None:
    """Why every user of a run whose nodes enforce cfg.policy (a local run's) would refuse the planned run: its first
    round's claimed per-user cost (RoundSpec.per_user_cost, what clients/policy.py checks first) above the per-round
    limits, or the run's own (eps, delta) above the users' totals (a user's recorded spend is never below the run's
    guarantee, design 6). None when the plan fits them."""
    protocol = round_protocol(plan["protocol"])
    cost = protocol.spec_fields(plan, protocol.params(plan), round_event(protocol, plan, 0), b"")["per_user_cost"]
    pol = cfg.policy
    checks = [
        ("a round costs each user eps", cost.eps, "max_eps_per_round", pol.max_eps_per_round),
        ("a round costs each user delta", cost.delta, "max_delta_per_round", pol.max_delta_per_round),
        ("the run spends eps", plan["eps"], "max_total_eps", pol.max_total_eps),
        ("the run spends delta", plan["delta"], "max_total_delta", pol.max_total_delta),
    ]
    for what, value, key, limit in checks:
        if value > limit:
            return (
                f"{what} = {value:.4g} (privacy.protocol {plan['protocol']!r}, privacy.eps = {plan['eps']:g}), above "
                f"the users' [policy] {key} = {limit:g}: the run's nodes would refuse every round; raise policy.{key} "
                "or lower privacy.eps"
            )
    return None


def _deadline_failure(report: pb.BatchReport, deadline: float) -> str:
    """Why a round below threshold released nothing when invited users neither answered nor refused: the shuffler
    closed it at the deadline (a too short [deployment] round_deadline_seconds showed only as "0 contributors",
    issue 43 item 17). "" when every invited user answered."""
    silent = report.invited - report.contributors - report.refused - sum(report.rejected.values())
    if silent <= 0:
        return ""
    return (
        f"below threshold: {report.contributors} contributors; {silent} of {report.invited} invited users sent "
        f"nothing before the round deadline ({deadline:g} s: [deployment] round_deadline_seconds)"
    )


# ---------------------------------------------------------------------------------------------------- views
@dataclass
class RunView:
    run_id: str
    state: str
    rounds_done: int
    rounds_planned: int
    budget: BudgetTotals | None
    metrics: list[dict[str, Any]]
    message: str
    config_toml: str = ""
    model: np.ndarray | None = None
    ledger_json: str = ""
    loss: float = float("nan")  # of `model` on the held-out split
    accuracy: float = float("nan")
    excess_risk: float | None = None  # of `model`, when the population optimum is known
    metrics_from: int = 0  # `metrics` leaves out the first that many rounds' metrics


class _Round(NamedTuple):
    """What every round of a run uses, resolved once per run (plug-ins, parameters)."""

    plan: dict[str, Any]
    protocol: RoundProtocol
    params: Any
    opt: Optimizer
    cfg: RunConfig


@dataclass
class _Live:
    thread: threading.Thread | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    private_key: Any = None
    public_key: bytes = b""
    rng: np.random.Generator | None = None  # the analyzer's own noise (central protocols), from the CSPRNG
    # connected users the run settled for after waiting for the rest: later rounds wait again only if fewer
    settled_users: int | None = None
    # GetPopulation asked once a round was applied: answered while the analyzer evaluates and writes the round, it
    # is the next round's check that the shuffler is there (_await_shuffler), not a round trip after them
    probe: Any = None
    # users whose node refused the last round's spec as not the one this analyzer signed (spec_signing)
    forged: int = 0
    report_ids: set[bytes] = field(default_factory=set)  # PRIO3: the run's report ids (the Helper refuses replays)


def _with_ciphertexts(batch: pb.ShuffledBatch, ciphertexts: list[bytes]) -> pb.ShuffledBatch:
    out = pb.ShuffledBatch()
    out.CopyFrom(batch)
    del out.ciphertexts[:]
    out.ciphertexts.extend(ciphertexts)
    return out


def refused_nodes_text(refused: Sequence[pb.RefusedNode], shown: int = 20) -> str:
    """The nodes the shuffler turned away, by reason, named (the first `shown` of each reason), as the end of a status
    line ("; the shuffler refused 12 nodes: capacity (client-48, ...: <its message>)"); "" if none."""
    if not refused:
        return ""
    by_reason: dict[str, list[pb.RefusedNode]] = {}
    for r in refused:
        by_reason.setdefault(r.reason, []).append(r)
    parts = []
    for reason, rs in by_reason.items():
        names = ", ".join(r.node for r in rs[:shown]) + (f" and {len(rs) - shown} more" if len(rs) > shown else "")
        parts.append(f"{reason} ({names}: {rs[-1].details})")
    return f"; the shuffler refused {len(refused)} nodes: " + "; ".join(parts)


class RunManager:
    """Owns the ledger and the runs' threads; talks to the shuffler through an injected stub."""

    def __init__(
        self,
        ledger: Ledger,
        shuffler: pbg.ShufflerStub,
        clock: Callable[[], float] = time.monotonic,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex[:16],
        signer: SpecSigner | None = None,
    ):
        self.ledger = ledger
        self.shuffler = shuffler
        # with a PKI: every spec goes out signed with the analyzer's role key, and nodes act on nothing else
        # (spec_signing); None = insecure mode
        self.signer = signer
        self._clock = clock
        self._new_id = new_id
        self.on_planned: Callable[[str, float], None] = lambda run_id, seconds: (
            None
        )  # shuffledp/observability/metrics.py
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._held_out = HeldOut()  # the public held-out splits the runs are evaluated on

    # -------------------------------------------------------------------------------------- lifecycle
    def create_run(self, config_toml: str) -> str:
        cfg = parse_config(config_toml)  # ConfigError -> INVALID_ARGUMENT
        self._evaluation_data(cfg)  # fail now, not in the thread, if the data cannot be loaded
        run_id = self._new_id()
        self.ledger.create_run(run_id, config_toml)
        return run_id

    def _run(self, run_id: str) -> dict[str, Any]:
        try:
            return self.ledger.run(run_id)
        except LedgerError as exc:
            raise RunNotFound(f"unknown run {run_id!r}") from exc

    def start_run(self, run_id: str) -> None:
        self._run(run_id)  # RunNotFound
        # under the lock with cancel_run's look-up: a cancel finds the run either not started or with its _Live
        with self._lock:
            # the write decides, not a read before it: of two concurrent calls one starts the run
            started = self.ledger.set_state(run_id, "RUNNING", "waiting for the population", only_from="CREATED")
            if started:
                live = self._live[run_id] = _Live()
        if not started:
            raise RunStateError(f"run {run_id} is {self._run(run_id)['state']}; only a CREATED run can be started")
        self._spawn(run_id, live)

    def cancel_run(self, run_id: str, message: str = _CANCELLED) -> None:
        self._run(run_id)  # RunNotFound
        # under the lock start_run and resume register a run's thread with: a cancel finds either the run not
        # started (start_run's compare-and-set then fails) or its _Live
        with self._lock:
            # the ledger first: from this write on no round of the run can be reserved (Ledger.reserve), also
            # not by a thread past its last look at the event (in its pre-round check of the shuffler)
            if not self.ledger.set_state(run_id, "CANCELLED", message):
                raise RunStateError(f"run {run_id} already ended ({self._run(run_id)['state']})")
            live = self._live.get(run_id)
            if live is not None:
                live.cancel.set()  # ends its waits at once
        if live is not None and live.thread is not None:
            live.thread.join(timeout=0.1)

    def cancel_running(self, message: str) -> list[str]:
        """Cancel every RUNNING run: the analyzer of a local run whose CLI is gone (nobody drives its run any more,
        and it must charge no further round). A round in flight stays charged, as at any cancel."""
        cancelled = []
        for run_id in self.ledger.runs_in_state("RUNNING"):
            with contextlib.suppress(RunStateError):  # ended meanwhile
                self.cancel_run(run_id, message)
                cancelled.append(run_id)
        return cancelled

    def recover(self) -> None:
        """At start-up, before the operator API takes calls: the rounds a crashed process left reserved are charged
        as spent (never a round this process reserves)."""
        for run_id, r in self.ledger.recover():
            log.warning("run %s round %d had an unknown outcome: counted as spent", run_id, r)

    def resume(self) -> list[str]:
        """Resume the RUNNING runs (after recover()), each once: under the lock start_run and cancel_run take, so a
        run started meanwhile is not started twice and a run cancelled meanwhile is not resumed or sees its cancel."""
        with self._lock:
            running = [run_id for run_id in self.ledger.runs_in_state("RUNNING") if run_id not in self._live]
            lives = {run_id: self._live.setdefault(run_id, _Live()) for run_id in running}
        for run_id, live in lives.items():
            self._spawn(run_id, live)
        return running

    def wait(self, run_id: str, timeout: float | None = None) -> None:
        with self._lock:
            live = self._live.get(run_id)
        if live is not None and live.thread is not None:
            live.thread.join(timeout)

    def _spawn(self, run_id: str, live: _Live) -> None:
        live.thread = threading.Thread(target=self._thread_main, args=(run_id, live), name=f"run-{run_id}", daemon=True)
        live.thread.start()

    # -------------------------------------------------------------------------------------------- views
    def view(self, run_id: str, with_result: bool = False, metrics_from: int = 0) -> RunView:
        """The run's status; ``metrics_from``: without the first that many rounds' metrics (a poller holds them:
        a long run's status costs what changed, not every round again)."""
        # one snapshot of the ledger: a round settling meanwhile (the one in flight at a cancel) would otherwise
        # leave the budget, the metrics and the exported ledger disagreeing about what was spent
        with self.ledger.snapshot():
            run = self._run(run_id)
            plan = run["plan"] or {}
            hidden = bool(plan.get("hidden_iterates"))
            if with_result and hidden and run["state"] in ("CREATED", "RUNNING"):
                raise RunStateError(f"run {run_id} releases only its last iterate: its result exists once it COMPLETED")
            view = RunView(
                run_id=run_id,
                state=run["state"],
                rounds_done=self.ledger.rounds_done(run_id),
                rounds_planned=int(plan.get("rounds", 0)),
                budget=self.ledger.totals(run_id) if run["limit"] else None,
                metrics=self.ledger.metrics(run_id, skip=metrics_from),
                message=run["message"],
                config_toml=run["config_toml"],
                metrics_from=metrics_from,
            )
            if not with_result:
                return view
            ck = self.ledger.last_checkpoint(run_id)
            view.ledger_json = self.ledger.export_json(run_id)
        if ck is not None and plan and (run["state"] == "COMPLETED" or not hidden):
            opt = planned_optimizer(plan)
            view.model = opt.release(decode_state(ck[1], opt.state_from_arrays), plan.get("output", "mean"))
            model, X, y, _, optimum_loss = self._evaluation_data(parse_config(run["config_toml"]))
            view.loss, view.accuracy = model.loss(view.model, X, y), model.accuracy(view.model, X, y)
            if optimum_loss is not None:
                view.excess_risk = view.loss - optimum_loss
        return view

    def budget(self, run_id: str) -> BudgetTotals | None:
        run = self._run(run_id)
        return self.ledger.totals(run_id) if run["limit"] else None

    # ------------------------------------------------------------------------------------------ helpers
    def _evaluation_data(self, cfg: RunConfig) -> EvalData:
        return self._held_out.data(cfg)

    def _population(self, run_id: str, want_nodes: int, wait: float, cancel: threading.Event) -> pb.PopulationStatus:
        """Wait (at most `wait` s) until the configured client nodes are connected and the admitted count is stable."""
        deadline = self._clock() + wait
        last_reading = None  # the previous reading: (admitted users, connected nodes, refused nodes' text)
        while True:
            if cancel.is_set():
                raise _Cancelled
            try:
                pop = self.shuffler.GetPopulation(pb.PopulationRequest(run_id=run_id), timeout=_PROBE_SECONDS)
            except grpc.RpcError as exc:
                if exc.code() not in _UNREACHABLE:
                    raise
                why = f"shuffler unreachable ({exc.code().name})"
                if self._clock() > deadline:
                    raise PlanError(f"{why} for {wait:.0f} s") from exc
                self.ledger.set_state(run_id, "RUNNING", f"waiting for the population: {why}")
                cancel.wait(1.0)
                continue
            stable = last_reading is not None and pop.admitted_users == last_reading[0]
            if pop.connected_nodes >= want_nodes and pop.admitted_users > 0 and stable:
                return pop
            refused = refused_nodes_text(pop.refused_nodes)
            reading = (pop.admitted_users, pop.connected_nodes, refused)
            if reading != last_reading:
                # progress while a large population registers (the operator's CLI prints each change), and the
                # nodes the shuffler turned away, by name and reason (issue 44: they were left out unseen)
                what = f"{pop.admitted_users} users admitted, {pop.connected_nodes} of {want_nodes} nodes connected"
                self.ledger.set_state(run_id, "RUNNING", f"waiting for the population: {what}{refused}")
            if self._clock() > deadline:
                if pop.admitted_users > 0:
                    if pop.connected_nodes < want_nodes:
                        log.warning(
                            "run %s: %d of %d nodes connected after %.0f s; planned for the %d users admitted%s",
                            run_id,
                            pop.connected_nodes,
                            want_nodes,
                            wait,
                            pop.admitted_users,
                            refused,
                        )
                    return pop
                raise PlanError(f"no users admitted at the shuffler after {wait:.0f} s{refused}")
            last_reading = reading
            cancel.wait(0.05)  # a node registers its users in one call: two equal readings this far apart suffice

    def _plan(self, run_id: str, cfg: RunConfig, live: _Live) -> dict[str, Any]:
        run = self._run(run_id)
        if run["plan"]:
            return run["plan"]
        model, _, _, bound, _ = self._evaluation_data(cfg)
        pop = self._population(run_id, cfg.deployment.client_nodes, cfg.deployment.population_wait_seconds, live.cancel)
        t0 = self._clock()
        plan = plan_run(cfg, pop.admitted_users, pop.unused_users, model, bound)
        seconds = self._clock() - t0
        self.on_planned(run_id, seconds)
        log.info(
            "run %s planned for %d admitted users: %d rounds (%.2f s)",
            run_id,
            pop.admitted_users,
            plan["rounds"],
            seconds,
        )
        limit = BudgetLimit(plan["eps"], plan["delta"], plan["composition"], plan["advanced_slack"])
        initial = self._initial_state(cfg, plan)
        # one transaction: a stop between a plan and its theta_0 left a run that no restart could execute
        with self.ledger.atomic():
            self.ledger.set_budget(run_id, limit, plan)
            self.ledger.save_checkpoint(run_id, -1, *initial)
        return plan

    def _initial_state(self, cfg: RunConfig, plan: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """The checkpoint of round -1: the optimizer's and the protocol's initial state, and theta_0's metrics."""
        opt = planned_optimizer(plan)
        state = opt.init(self._evaluation_data(cfg).model.init_params())
        noise = planned_protocol(plan).noise_state(plan)
        return encode_state(RunState(state, noise)), self._evaluate(cfg, opt, state, -1)

    def _evaluate(self, cfg: RunConfig, opt: Optimizer, state: Any, r: int) -> dict[str, Any]:
        """Held-out loss/accuracy of the model after round r (r = -1: theta_0): services/evaluation.py."""
        return evaluate(self._evaluation_data(cfg), opt, state, r)

    # ------------------------------------------------------------------------------------------ the loop
    def _thread_main(self, run_id: str, live: _Live) -> None:
        try:
            self._execute(run_id, live)
        except _Cancelled:
            self.ledger.set_state(run_id, "CANCELLED", _CANCELLED)
        except RunEnded:
            pass  # ended by another call (a cancel): its state is final
        except BudgetExceeded as exc:
            self.ledger.set_state(run_id, "BUDGET_EXHAUSTED", str(exc))
        except (PlanError, ConfigError) as exc:
            self.ledger.set_state(run_id, "FAILED", f"planning failed: {exc}")
        except Exception as exc:  # the run must end in a terminal state, never hang in RUNNING
            log.exception("run %s failed", run_id)
            self.ledger.set_state(run_id, "FAILED", f"{type(exc).__name__}: {exc}")

    def _execute(self, run_id: str, live: _Live) -> None:
        cfg = parse_config(self._run(run_id)["config_toml"])
        plan = self._plan(run_id, cfg, live)
        protocol = planned_protocol(plan)
        opt = planned_optimizer(plan)
        rd = _Round(plan, protocol, protocol.params(plan), opt, cfg)
        ck = self.ledger.last_checkpoint(run_id)
        if ck is None:  # planned by a version that wrote the plan and theta_0 apart, and stopped between them
            blob, metrics = self._initial_state(cfg, plan)
            self.ledger.save_checkpoint(run_id, -1, blob, metrics)
            ck = (-1, blob)
        state = decode_run_state(ck[1], opt, protocol, plan)
        live.rng = make_rng()
        if protocol.needs_keypair(plan):
            # a fresh key per analyzer process: a round in flight during a crash is charged anyway
            live.private_key, live.public_key = sealing.generate_keypair()
        self.ledger.set_state(run_id, "RUNNING", "")
        failures = 0
        r = self.ledger.next_round(run_id)
        # a protocol that releases only its last iterate runs its rounds until that many were applied: one not
        # released, or lost to a crash before its checkpoint, is run again (and a lost one charged again)
        redo = bool(plan.get("hidden_iterates"))
        applied = sum(1 for m in self.ledger.metrics(run_id) if m.get("round", -1) >= 0 and m.get("released"))
        pace, started = cfg.deployment.min_round_seconds, None
        while (applied if redo else r) < plan["rounds"]:
            left = started + pace - self._clock() if started is not None else 0.0
            if left > 0:
                # pace steering (Bonawitz et al. 2019, sec 2.3): a run's length set in seconds, not by how fast
                # this machine is; a cancel ends the wait at once. The population asked after the last round is
                # older than the wait (users may have left during it): the check below asks afresh
                live.cancel.wait(left)
                live.probe = None
            # no round is reserved while the shuffler cannot be reached: an outage costs no budget (issue 10 item 7)
            # a round's cohort connected: a sequential round's of users not used yet in the run (the shuffler knows
            # only connected users: after a node's or the shuffler's restart, "too few fresh users" is no exhaustion
            # until the missing nodes had their wait); fully interactive: every user
            need, fresh = plan["cohort"], plan["kind"] == "sequential"
            wait = cfg.deployment.population_wait_seconds
            if live.cancel.is_set() or not self._await_shuffler(run_id, live, need, wait, fresh):
                raise _Cancelled
            event = round_event(protocol, plan, r)
            self.ledger.reserve(run_id, r, event)  # BudgetExceeded propagates: no spec leaves
            if live.cancel.is_set():  # cancelled as it was reserved: nothing was sent, nothing is charged
                self.ledger.release(run_id, r, "cancelled before it was sent")
                raise _Cancelled
            t0 = started = self._clock()
            try:
                outcome, state = self._round(run_id, r, rd, state, event, live)
            except Exception as exc:
                # whatever failed once the round was reserved (a batch the analyzer cannot use: data marked not
                # released, another round's, totals out of range, ...) may have delivered data: the round is charged
                # at its reservation, an upper bound of its cost, before the run stops (never left reserved)
                if self.ledger.is_reserved(run_id, r):
                    self.ledger.mark_spent(run_id, r, f"round failed ({exc}): counted as spent")
                raise
            if live.forged:
                self.ledger.set_state(
                    run_id,
                    "FAILED",
                    f"round {r}: {live.forged} users' nodes refused the spec as not the one this analyzer signed "
                    f"({SIGNATURE_INVALID}): the shuffler, which relays every spec, altered or replaced it",
                )
                return
            failures = 0 if outcome == "ok" else failures + 1
            applied += outcome == "ok"
            if outcome == "exhausted":
                self.ledger.set_state(run_id, "COMPLETED", f"stopped after round {r}: no fresh cohort left")
                return
            if failures >= _MAX_CONSECUTIVE_FAILURES:
                self.ledger.set_state(run_id, "FAILED", f"{failures} consecutive rounds failed (last: round {r})")
                return
            log.info("run %s round %d: %s (%.2f s)", run_id, r, outcome, self._clock() - t0)
            r += 1
        self.ledger.set_state(run_id, "COMPLETED", "")

    def _await_shuffler(
        self, run_id: str, live: _Live, need_users: int = 0, wait: float = 0.0, fresh: bool = False
    ) -> bool:
        """Return once the shuffler answers GetPopulation, retrying with exponential backoff while it is unreachable
        (the run's status message says so meanwhile), and once need_users users are connected again (`fresh`: users
        the run has not used yet; after an outage nodes reconnect with a backoff of their own; waited for up to
        `wait` s, then the round is tried anyway). False if the run is cancelled while waiting."""
        delay, since, waited_users = 0.5, None, None
        asked, live.probe = live.probe, None
        while not live.cancel.is_set():
            try:
                if asked is not None:  # its failure counts as this attempt's: the retries ask afresh
                    probe, asked = asked, None
                    pop = probe.result()
                else:
                    pop = self.shuffler.GetPopulation(pb.PopulationRequest(run_id=run_id), timeout=_PROBE_SECONDS)
            except grpc.RpcError as exc:
                if exc.code() not in _UNREACHABLE:
                    raise
                if since is None:
                    since = time.strftime("%H:%M:%S")
                    log.warning("run %s: shuffler unreachable (%s); waiting", run_id, exc.code().name)
                why = f"shuffler unreachable since {since} ({exc.code().name}); retrying in {delay:.0f} s"
                self.ledger.set_state(run_id, "RUNNING", why)
                live.cancel.wait(delay)
                delay = min(2 * delay, _MAX_BACKOFF_SECONDS)
                continue
            if since is not None:
                self.ledger.set_state(run_id, "RUNNING", f"shuffler reachable again (unreachable since {since})")
                since, delay = None, 0.5
            have = pop.unused_users if fresh else pop.admitted_users
            if have >= need_users:
                live.settled_users = None
            elif live.settled_users is None or have < live.settled_users:
                # a new loss: wait once for these users, not at every later round (a node gone for good)
                waited_users = self._clock() if waited_users is None else waited_users
                if self._clock() - waited_users < wait:
                    what = "fresh users" if fresh else "users"
                    why = f"waiting for users to reconnect: {have} of {need_users} {what} connected"
                    self.ledger.set_state(run_id, "RUNNING", why)
                    live.cancel.wait(0.2)
                    continue
                live.settled_users = have
            if waited_users is not None:
                self.ledger.set_state(run_id, "RUNNING", "")
            return True
        return False

    def _round(self, run_id: str, r: int, rd: _Round, state: Any, event: PrivacyEvent, live: _Live):
        """One round after its reservation. Returns (outcome, state)."""
        plan = rd.plan
        theta = rd.opt.query(state.opt)  # where the users take their gradients this round
        spec = round_spec(run_id, r, plan, rd.params, event, theta, live.public_key)
        wire = spec if self.signer is None else pb.RoundSpec(signed=self.signer.sign(spec))
        verify_key = aggregation.attach_key(spec, wire)  # PRIO3: beside the signed spec, never in it
        t0 = self._clock()
        try:
            batch = self.shuffler.ExecuteRound(wire, timeout=plan["deadline"] + _RPC_GRACE_SECONDS)
        except grpc.RpcError as exc:
            code = exc.code()
            if _refused_before_collection(exc):
                # the shuffler refused the spec: no batch exists -> nothing to charge
                why = f"shuffler refused the round: {code.name}: {exc.details()}"
                self.ledger.release(run_id, r, why)
                self._metrics(run_id, r, rd, state, False, 0, self._clock() - t0, failure=why)
                exhausted = code == grpc.StatusCode.RESOURCE_EXHAUSTED and plan["kind"] == "sequential"
                return ("exhausted" if exhausted else "refused"), state
            # unknown outcome (the batch may have left the shuffler): charged, never released
            if code == grpc.StatusCode.UNAVAILABLE:
                why = f"shuffler unreachable during the round ({exc.details()})"
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                why = f"the shuffler's answer was not received ({exc.details()})"
            else:
                why = f"shuffler call failed ({code.name}: {exc.details()})"
            self.ledger.mark_spent(run_id, r, f"{why}: outcome unknown, counted as spent")
            log.warning("run %s round %d: %s; counted as spent", run_id, r, why)
            failure = f"{why}; counted as spent"
            self._metrics(run_id, r, rd, state, False, 0, self._clock() - t0, failure=failure)
            return "error", state
        rep = batch.report
        # users whose node refused the spec as unsigned or altered: the round is booked as usual, then the run stops
        live.forged = int(rep.refused_reasons.get(SIGNATURE_INVALID, 0))
        if not batch.released:
            if batch.label_totals or batch.ciphertexts or batch.reports:
                raise RuntimeError("the shuffler sent data in a batch marked not released")
            self.ledger.release(run_id, r, f"below threshold: {rep.contributors} contributors")
            seconds = self._clock() - t0
            self._metrics(run_id, r, rd, state, False, rep.contributors, seconds, dict(rep.rejected), rep)
            return "below_threshold", state
        n = int(rep.contributors)
        if spec.population and rep.eligible < spec.population:
            # drawn at a higher rate than the round was reserved at (issue 24 item 3): the batch was delivered, so it
            # is charged at the rate it was drawn at (the event's population n = the eligible users it came from,
            # never below its contributors) and the run stops
            drawn = {"n": max(int(rep.eligible), n, 1)} if "n" in event.params else None
            self.ledger.commit(run_id, r, max(n, 1), drawn)
            raise RuntimeError(
                f"the shuffler drew round {r} from {rep.eligible} eligible users, fewer than the {spec.population} "
                "its accountant assumes"
            )
        if batch.run_id != run_id or batch.round != r:
            raise RuntimeError(f"batch for run {batch.run_id!r} round {batch.round} answered round {r}")
        if spec.transport == pb.PRIO3:
            try:
                batch = aggregation.finish(
                    self.shuffler, spec, batch, verify_key, live.private_key, live.report_ids, _RPC_GRACE_SECONDS
                )
            except aggregation.AggregationFailed as exc:
                # the reports' shares left the shuffler: booked as spent at the reservation, nothing released
                why = f"{exc}; counted as spent"
                self.ledger.mark_spent(run_id, r, why)
                log.warning("run %s round %d: %s", run_id, r, why)
                self._metrics(run_id, r, rd, state, False, 0, self._clock() - t0, dict(rep.rejected), rep, failure=why)
                return "error", state
            rep, n = batch.report, int(batch.report.contributors)
        if sealing.repeated_encapsulation(batch.ciphertexts):
            # every sealed message has an encapsulated key of its own (sealing.ENC_BYTES): copies of one message
            # would count one user as several contributors, in the sum and in the amplification (design 5.3)
            raise RuntimeError(f"the batch of round {r} holds copies of a message (equal encapsulated keys)")
        try:  # what the round ran with (as the shuffler's report says; the plug-in decides)
            params, n_min, ran = rd.protocol.released(plan, rd.params, rep)
        except BatchError as exc:  # released, so charged; the run stops
            self.ledger.commit(run_id, r, exc.charged, exc.ran)
            raise
        if not n_min <= n <= plan["cohort"]:
            # the threshold is what bounds the cost; a batch outside it is charged honestly and the run stops
            self.ledger.commit(run_id, r, max(n, 1), ran)
            raise RuntimeError(f"batch has {n} contributors, outside [{n_min}, {plan['cohort']}]")
        if simulation_seed() is not None and batch.ciphertexts:  # a seeded simulation replays bit for bit
            order = canonical_order(live.private_key, batch.ciphertexts, sealing.round_info(run_id, r), make_rng())
            batch = _with_ciphertexts(batch, order)
        try:
            plan_r = {**plan, "min_contributors": n_min} if ran else plan  # this round's threshold
            dec = rd.protocol.decode(batch, n, plan_r, params, live.private_key, sealing.round_info(run_id, r))
        except BatchError as exc:
            self.ledger.commit(run_id, r, exc.charged, ran)  # delivered: charged; the run stops
            raise
        # the batch was delivered and used from here on: always committed, never released (design 6). The commit
        # goes into the durable write of the round's checkpoint (one transaction, one fsync per round: issue 30);
        # a crash before it leaves the round reserved, which a restart charges as spent at its reservation (an
        # upper bound on its committed cost) and resumes from the previous checkpoint, so no round is charged twice
        # and no released noise is redrawn (nothing of this round was released before that write)
        commit = (dec.charged, ran)
        if sum(dec.rejected.values()):
            log.warning("run %s round %d: skipped messages, by reason: %s", run_id, r, dec.rejected)
        if dec.total is None:
            log.warning("run %s round %d failed: %s; charged with %d contributors", run_id, r, dec.failure, dec.charged)
            seconds = self._clock() - t0
            self._metrics(
                run_id, r, rd, state, False, dec.used, seconds, dec.rejected, rep, failure=dec.failure, commit=commit
            )
            return "below_threshold", state
        try:
            # central protocols add their noise here and divide by their fixed cohort; the others by n', which
            # keeps the mean unbiased under dropouts (spec 000 sec 3)
            total, divisor, noise = rd.protocol.add_noise(
                dec.total, r, plan, rd.params, state.noise, live.rng, dec.used
            )
            _, opt_state = rd.opt.step(total / divisor, state.opt, theta)
        except BaseException:
            self.ledger.commit(run_id, r, dec.charged, ran)  # used: charged as it ran; the run stops
            raise
        state = RunState(opt_state, noise)
        seconds = self._clock() - t0
        live.probe = self.shuffler.GetPopulation.future(pb.PopulationRequest(run_id=run_id), timeout=_PROBE_SECONDS)
        self._metrics(run_id, r, rd, state, True, dec.used, seconds, dec.rejected, rep, commit=commit)
        return "ok", state

    def _metrics(
        self,
        run_id: str,
        r: int,
        rd: _Round,
        state: Any,
        released: bool,
        n: int,
        seconds: float,
        rejected: dict[str, int] | None = None,
        report: pb.BatchReport | None = None,
        failure: str = "",
        commit: tuple[int, dict[str, Any] | None] | None = None,
    ) -> None:
        """Write round r's checkpoint with its metrics; with `commit` (contributors charged, parameters it ran with)
        the round's ledger commit too, in the same transaction (the metrics' spend includes it)."""
        if not released and not failure and report is not None:
            failure = _deadline_failure(report, rd.plan["deadline"])
        try:
            if rd.plan.get("hidden_iterates"):  # data-independent status only (spec 004 sec 5)
                m: dict[str, Any] = {
                    "round": r,
                    **{f"{k}_{w}": math.nan for k in ("loss", "accuracy") for w in ("mean", "last")},
                }
            else:
                m = self._evaluate(rd.cfg, rd.opt, state.opt, r)
            with self.ledger.atomic():
                if commit is not None:
                    self.ledger.commit(run_id, r, *commit)
                totals = self.ledger.totals(run_id)
                m.update(
                    released=released,
                    contributors=n,
                    seconds=seconds,
                    eps_spent=totals.eps_spent,
                    delta_spent=totals.delta_spent,
                    eps_spent_robust=totals.eps_spent_robust,
                    **({"eps_spent_local": totals.views["local"]} if "local" in totals.views else {}),
                    rejected=dict(rejected or {}),  # messages rejected by reason, by the shuffler and the analyzer
                    # users who refused the round (their policy, or their node could not deliver), total and by reason
                    refused=int(report.refused) if report is not None else 0,
                    refused_reasons=dict(report.refused_reasons) if report is not None else {},
                    not_in_run=int(report.not_in_run) if report is not None else 0,
                    checked_in=int(report.checked_in) if report is not None else 0,
                    excluded_silent=int(report.excluded_silent) if report is not None else 0,
                )
                if failure:
                    m["failure"] = failure
                self.ledger.save_checkpoint(run_id, r, encode_state(state), m)
        except BaseException:
            # the evaluation or the joint write failed, so the round is still only reserved; its batch was used,
            # so it is charged all the same (an error path never skips a ledger entry)
            if commit is not None:
                with contextlib.suppress(LedgerError):  # committed already: nothing to add
                    self.ledger.commit(run_id, r, *commit)
            raise
