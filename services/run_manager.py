"""The analyzer's run manager: run lifecycle, round planning, budget reservation, decoding, optimizer, checkpoints.

Transport-independent (the gRPC servicer in services/analyzer.py only converts messages). Each started run executes
in its own background thread:

    plan (once)    population from the shuffler (sizes only) -> T, cohort B, threshold n_min, delta, PVEC params,
                   composition rule, step size; stored in the ledger with the (eps, delta) limit.
    each round r   reserve the worst-case cost in the ledger (BudgetExceeded -> the run stops BUDGET_EXHAUSTED and
                   no spec leaves) -> ExecuteRound at the shuffler (blocks until the deadline) -> released batch:
                   (BITS: open and validate every ciphertext, skipping and counting bad ones, see open_bit_messages)
                   commit with the actual contributors n', decode (decode_counts / decode_bits), optimizer step,
                   evaluate on the public test split, checkpoint; not released: release the reservation.
    restart        Ledger.recover() turns rounds left "reserved" into "spent_unknown"; RUNNING runs resume after the
                   last round ever reserved, from the last checkpoint (no round index is ever reused).

Planning (spec 000 sec 4): sequential = PSGD, T = floor(unused users / B) fresh cohorts (at most schedule.rounds
when set), parameters sized for one round at (eps, delta) (parallel composition); fully interactive = PGD, all n
users for T rounds, per-round
parameters from calibrate_pvec(eps, delta, ..., rounds=T) (calibrated) or the paper's (eps_r, delta_r).
The PVEC noise is sized for the threshold n_min = ceil(min_contributors_fraction * cohort) contributors: a
released batch has n' >= n_min, and fewer contributors means less binomial noise, so sizing at n_min makes the
reserved (worst-case) cost an upper bound on every committed cost (the robust variant of spec 000 sec 3 / A.3).
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import grpc
import numpy as np
from shuffledp.services.ledger import (
    BudgetExceeded,
    BudgetLimit,
    BudgetTotals,
    Ledger,
    LedgerError,
    PrivacyEvent,
    round_cost,
)

from shuffledp import grpc_options, sealing
from shuffledp.config import DEFAULT_ROUNDS, ConfigError, RunConfig, parse_config
from shuffledp.data import load_dataset
from shuffledp.models import Model, make_model
from shuffledp.optimizers.pgd import pgd, pgd_round_privacy
from shuffledp.optimizers.pgd import theory_learning_rate as pgd_lr
from shuffledp.optimizers.psgd import AveragingState, psgd
from shuffledp.optimizers.psgd import theory_learning_rate as psgd_lr
from shuffledp.protocols.pvec import PvecParams, decode_bits, decode_counts, pvec_params, pvec_variance_bound
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

log = logging.getLogger(__name__)

__all__ = [
    "RunManager",
    "RunNotFound",
    "RunStateError",
    "PlanError",
    "RunView",
    "plan_run",
    "round_spec",
    "open_bit_messages",
    "TERMINAL_STATES",
    "UNDECRYPTABLE",
    "MALFORMED_PLAINTEXT",
]

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "BUDGET_EXHAUSTED")
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
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_PROBE_SECONDS = 10.0  # GetPopulation before each round: is the shuffler there at all?
_MAX_BACKOFF_SECONDS = 30.0
_TEST_DATA_CACHE = 4  # held-out splits kept in memory
_RPC_GRACE_SECONDS = 30.0  # ExecuteRound returns at the deadline; allow this much for transfer and aggregation
_MAX_CONSECUTIVE_FAILURES = 3
_POPULATION_WAIT_SECONDS = 60.0
# The analyzer's own rejection reasons (design 5.3), counted per message in the round's metrics["rejected"]
UNDECRYPTABLE = "undecryptable"  # HPKE open failed: wrong key, wrong run/round, tampered or truncated
MALFORMED_PLAINTEXT = "malformed_plaintext"  # opened, but not one labelled bit of this round (length, bit, label)


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


class PlanError(ValueError):
    """The run cannot be planned (too few users, parameters out of the protocol's range)."""


# ------------------------------------------------------------------------------------------------- planning
def _pvec_sized(method: str, eps: float, delta: float, n_min: int, n_max: int, d: int, clip: float, rounds: int):
    """PVEC parameters whose noise is sized for n_min contributors, valid for up to n_max (module docstring)."""
    if method == "calibrated":
        # extension beyond the paper (spec 000 sec 8): exact numerical accountant for the binomial view
        from shuffledp.accountants.calibrated_pvec import calibrate_pvec

        params = calibrate_pvec(eps, delta, n_min, d, clip, rounds=rounds)
    else:
        params = pvec_params(eps, delta, n_min, d, clip)  # proof of Thm 3.2, paper 000
    return replace(params, n=n_max)


def plan_run(cfg: RunConfig, admitted: int, unused: int, model: Model) -> dict[str, Any]:
    """The round plan of a run from the population sizes (JSON-able dict, stored in the ledger).

    Resolves the run-dependent defaults of the configuration: an unset privacy.delta and schedule.rounds (below).
    """
    p, s = cfg.privacy, cfg.schedule
    d = model.dim
    if admitted < 1:
        raise PlanError("no users are admitted at the shuffler")
    if p.delta is not None:
        delta = p.delta
    else:
        # Unset delta: 1/n (issue 4: practitioner-acceptable delta <= 1/n), capped by the users' own [policy] so that
        # default users accept every round (issue 10). A user's per-round delta is <= delta (_per_user_claim:
        # sequential rounds claim delta, calibrated fully interactive ones delta/T, paper ones delta_r = delta/(T+1),
        # Alg 5) and its run total is <= delta (sequential: one round; fully interactive: T such claims, basic
        # composition as in clients/policy.py). The total cap is shrunk by 1e-9 (relative) so that a client's float
        # sum of T claims delta/T (up to T ulps above delta) still fits it.
        pol = cfg.policy
        delta = min(1.0 / admitted, pol.max_delta_per_round, pol.max_total_delta * (1.0 - 1e-9))
        if not delta > 0.0:
            raise PlanError(
                "privacy.delta is unset and [policy] max_delta_per_round or max_total_delta is 0, so every user "
                "would refuse every round: set privacy.delta or raise those limits"
            )
    sequential = s.kind == "sequential"
    if sequential:
        n_pool = unused
        if s.cohort_size:
            B = s.cohort_size
        else:
            # Thm 4.1 of paper 000: B = sqrt(d) ln(d/delta) / eps
            B = math.ceil(math.sqrt(d) * math.log(d / delta) / p.eps)
        B = min(B, n_pool)
        if B < 1:
            raise PlanError(f"no unused users left for a sequential run (unused={unused})")
        T = n_pool // B  # T = n / B fresh cohorts (spec 000 sec 4, Alg 3)
        if s.rounds is not None:
            T = min(T, s.rounds)  # schedule.rounds set: at most that many of them (issue 10)
    else:
        B, T = admitted, (s.rounds if s.rounds is not None else DEFAULT_ROUNDS)  # all n users for T rounds (Alg 5)
    n_min = max(1, math.ceil(p.min_contributors_fraction * B))
    slack = 0.0
    if sequential:
        composition = "parallel"  # disjoint cohorts (spec 000 sec 5)
        eps_r, delta_r, rounds_for_calibration = (p.round_eps or p.eps), delta, 1
    elif p.calibration == "calibrated":
        composition = "rdp"
        if p.round_eps is not None:
            eps_r, delta_r, rounds_for_calibration = p.round_eps, delta, 1
        else:
            eps_r, delta_r, rounds_for_calibration = p.eps, delta, T
    else:
        composition = "advanced"
        slack = delta / (T + 1)  # delta' of advanced composition (spec 000 sec 4)
        eps_r, delta_r = pgd_round_privacy(p.eps, delta, T)  # Alg 5 per-round budget
        if p.round_eps is not None:
            eps_r = p.round_eps
        rounds_for_calibration = 1
    try:
        params = _pvec_sized(p.calibration, eps_r, delta_r, n_min, B, d, p.clip_norm, rounds_for_calibration)
    except ValueError as exc:
        raise PlanError(f"cannot size PVEC for eps={eps_r}, delta={delta_r}, n={n_min}, d={d}: {exc}") from exc
    if s.learning_rate is not None:
        lr = s.learning_rate
    else:
        noise_sq = d * pvec_variance_bound(params, n_min)  # E||decoded sum - sum||^2 (spec 000 sec 2, exact bound)
        rule = psgd_lr if sequential else pgd_lr
        lr = rule(2.0 * cfg.model.radius, p.clip_norm, T, noise_sq, n_min)
    return {
        "kind": s.kind,
        "admitted": admitted,
        "cohort": B,
        "rounds": T,
        "min_contributors": n_min,
        "eps": p.eps,
        "delta": delta,
        "composition": composition,
        "advanced_slack": slack,
        "params": asdict(params),
        "learning_rate": lr,
        "radius": cfg.model.radius,
        "dim": d,
        "task": model.task,
        "num_features": model.num_features,
        "num_classes": model.num_classes,
        "transport": cfg.transport.mode,
        "deadline": cfg.deployment.round_deadline_seconds,
        "output": s.output,
    }


def _per_user_claim(plan: dict[str, Any], params: PvecParams, event: PrivacyEvent) -> tuple[float, float]:
    """What one round costs a participating user on its own (RoundSpec.per_user_cost; clients check it).

    Sequential and paper rounds: the round's own (eps, delta). Fully interactive calibrated rounds are composed in
    RDP by the ledger; for the clients' per-round policy (which adds deltas over rounds) we state the round's eps
    at delta/T, so T such claims add up to at most the run's delta. Clients can recompute the eps from (g, m, p).
    """
    if plan["kind"] == "sequential" or params.method != "calibrated":
        return round_cost(event)
    from shuffledp.accountants.calibrated_pvec import pvec_round_epsilon

    delta_claim = plan["delta"] / plan["rounds"]
    return float(pvec_round_epsilon(params, event.contributors, delta_claim)), delta_claim


# ---------------------------------------------------------------------------------------------- BITS batches
def open_bit_messages(
    private_key: Any, ciphertexts: Sequence[bytes], info: bytes, d: int
) -> tuple[np.ndarray, np.ndarray, Counter[str]]:
    """Open and validate a BITS batch message by message (design 5.1, 5.3): (labels, bits, rejected by reason).

    A ciphertext that does not open (SealingError) counts as UNDECRYPTABLE; one that opens to anything but a
    5-byte (label < d, bit in {0, 1}) message counts as MALFORMED_PLAINTEXT; both are skipped, so one bad message
    cannot void the others. Nothing of a message (ciphertext, plaintext) is logged or kept.
    """
    labels: list[int] = []
    bits: list[int] = []
    rejected: Counter[str] = Counter()
    for c in ciphertexts:
        try:
            plain = sealing.open_sealed(private_key, c, info)
        except sealing.SealingError:
            rejected[UNDECRYPTABLE] += 1
            continue
        try:
            (label,), (bit,) = sealing.unpack_labelled_bits([plain])
        except ValueError:
            rejected[MALFORMED_PLAINTEXT] += 1
            continue
        if label >= d:
            rejected[MALFORMED_PLAINTEXT] += 1
            continue
        labels.append(int(label))
        bits.append(int(bit))
    return np.asarray(labels, dtype=np.int64), np.asarray(bits, dtype=np.uint8), rejected


def round_spec(
    run_id: str,
    r: int,
    plan: dict[str, Any],
    params: PvecParams,
    event: PrivacyEvent,
    theta: np.ndarray,
    analyzer_public_key: bytes = b"",
) -> pb.RoundSpec:
    """The RoundSpec the analyzer sends for round r of a planned run at model theta (the key is used in BITS)."""
    eps_r, delta_r = _per_user_claim(plan, params, event)
    bits = plan["transport"] == "bits"
    return pb.RoundSpec(
        run_id=run_id,
        round=r,
        schedule=pb.SEQUENTIAL if plan["kind"] == "sequential" else pb.FULLY_INTERACTIVE,
        trust_model=pb.SHUFFLE,
        transport=pb.BITS if bits else pb.COUNTS,
        randomizer=pb.RandomizerSpec(
            protocol="pvec",
            clip_norm=params.delta2,
            dim=params.d,
            g=params.g,
            m=params.m,
            p=params.p,
            messages_per_user=params.messages_per_user if bits else params.d,
            message_bytes=sealing.BIT_MESSAGE_BYTES if bits else 0,
            extra={"eps": params.eps, "delta": params.delta, "n": float(params.n)},
        ),
        model=_tensor(theta),
        task=plan["task"],
        num_classes=plan["num_classes"] if plan["task"] == "logreg" else 0,
        cohort_size=plan["cohort"] if plan["kind"] == "sequential" else 0,
        min_contributors=plan["min_contributors"],
        deadline_seconds=plan["deadline"],
        per_user_cost=pb.PrivacyCost(
            eps=eps_r, delta=delta_r, accountant=f"pvec-{params.method}", trust_model=pb.SHUFFLE
        ),
        analyzer_public_key=analyzer_public_key if bits else b"",
        local_batch=1,
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


@dataclass
class _Live:
    thread: threading.Thread | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    private_key: Any = None
    public_key: bytes = b""


def _encode_state(state: AveragingState) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **state.to_arrays())
    return buf.getvalue()


def _decode_state(blob: bytes) -> AveragingState:
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return AveragingState.from_arrays({k: z[k] for k in z.files})


def _tensor(x: np.ndarray) -> pb.Tensor:
    x = np.ascontiguousarray(x, dtype="<f8")
    return pb.Tensor(shape=list(x.shape), f64=x.tobytes())


class RunManager:
    """Owns the ledger and the runs' threads; talks to the shuffler through an injected stub."""

    def __init__(
        self,
        ledger: Ledger,
        shuffler: pbg.ShufflerStub,
        clock: Callable[[], float] = time.monotonic,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex[:16],
        population_wait_seconds: float = _POPULATION_WAIT_SECONDS,
    ):
        self.ledger = ledger
        self.shuffler = shuffler
        self._clock = clock
        self._new_id = new_id
        self._population_wait = population_wait_seconds
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        # held-out splits by data source: a few, least recently used first (every CreateRun loads one, and
        # configurations that differ elsewhere must not each keep a copy)
        self._test_data: OrderedDict[str, tuple[Model, np.ndarray, np.ndarray]] = OrderedDict()

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
        run = self._run(run_id)
        if run["state"] != "CREATED":
            raise RunStateError(f"run {run_id} is {run['state']}; only a CREATED run can be started")
        self.ledger.set_state(run_id, "RUNNING", "waiting for the population")
        self._spawn(run_id)

    def cancel_run(self, run_id: str) -> None:
        run = self._run(run_id)
        if run["state"] in TERMINAL_STATES:
            raise RunStateError(f"run {run_id} already ended ({run['state']})")
        with self._lock:
            live = self._live.get(run_id)
        if live is not None and live.thread is not None and live.thread.is_alive():
            live.cancel.set()  # the thread stops before reserving its next round
            live.thread.join(timeout=0.1)
        if self._run(run_id)["state"] not in TERMINAL_STATES:
            self.ledger.set_state(run_id, "CANCELLED", "cancelled by the operator")

    def resume(self) -> list[str]:
        """At start-up: charge in-flight rounds of a crashed process and resume RUNNING runs."""
        lost = self.ledger.recover()
        for run_id, r in lost:
            log.warning("run %s round %d had an unknown outcome: counted as spent", run_id, r)
        running = self.ledger.runs_in_state("RUNNING")
        for run_id in running:
            self._spawn(run_id)
        return running

    def wait(self, run_id: str, timeout: float | None = None) -> None:
        with self._lock:
            live = self._live.get(run_id)
        if live is not None and live.thread is not None:
            live.thread.join(timeout)

    def _spawn(self, run_id: str) -> None:
        live = _Live()
        with self._lock:
            self._live[run_id] = live
        live.thread = threading.Thread(target=self._thread_main, args=(run_id, live), name=f"run-{run_id}", daemon=True)
        live.thread.start()

    # -------------------------------------------------------------------------------------------- views
    def view(self, run_id: str, with_result: bool = False) -> RunView:
        run = self._run(run_id)
        plan = run["plan"] or {}
        metrics = [m for m in self.ledger.metrics(run_id) if m.get("round", -1) >= 0]
        budget = self.ledger.totals(run_id) if run["limit"] else None
        view = RunView(
            run_id=run_id,
            state=run["state"],
            rounds_done=sum(1 for r in self.ledger.rounds(run_id) if r["state"] != "reserved"),
            rounds_planned=int(plan.get("rounds", 0)),
            budget=budget,
            metrics=metrics,
            message=run["message"],
            config_toml=run["config_toml"],
        )
        if with_result:
            ck = self.ledger.last_checkpoint(run_id)
            if ck is not None:
                st = _decode_state(ck[1])
                view.model = st.last if plan.get("output") == "last" else st.mean()
                model, X, y = self._evaluation_data(parse_config(run["config_toml"]))
                view.loss, view.accuracy = model.loss(view.model, X, y), model.accuracy(view.model, X, y)
            view.ledger_json = self.ledger.export_json(run_id)
        return view

    def budget(self, run_id: str) -> BudgetTotals | None:
        run = self._run(run_id)
        return self.ledger.totals(run_id) if run["limit"] else None

    # ------------------------------------------------------------------------------------------ helpers
    def _evaluation_data(self, cfg: RunConfig) -> tuple[Model, np.ndarray, np.ndarray]:
        """Model and the public held-out split (the analyzer never uses the training split)."""
        key = repr((cfg.data, cfg.model.task))
        with self._lock:
            hit = self._test_data.get(key)
            if hit is not None:
                self._test_data.move_to_end(key)
                return hit
        try:
            ds = load_dataset(cfg.data, cfg.model.task)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"data: {exc}") from exc
        entry = (make_model(cfg.model.task, ds.num_features, ds.num_classes), ds.X_test, ds.y_test)
        with self._lock:
            self._test_data[key] = entry
            while len(self._test_data) > _TEST_DATA_CACHE:
                self._test_data.popitem(last=False)
        return entry

    def _population(self, run_id: str, want_nodes: int, cancel: threading.Event) -> pb.PopulationStatus:
        """Wait (bounded) until the configured client nodes are connected and the admitted count is stable."""
        deadline = self._clock() + self._population_wait
        last = None
        while True:
            try:
                pop = self.shuffler.GetPopulation(pb.PopulationRequest(run_id=run_id), timeout=_PROBE_SECONDS)
            except grpc.RpcError as exc:
                if exc.code() not in _UNREACHABLE:
                    raise
                why = f"shuffler unreachable ({exc.code().name})"
                if self._clock() > deadline or cancel.is_set():
                    raise PlanError(f"{why} for {self._population_wait:.0f} s") from exc
                self.ledger.set_state(run_id, "RUNNING", f"waiting for the population: {why}")
                cancel.wait(1.0)
                continue
            stable = last is not None and pop.admitted_users == last.admitted_users
            if pop.connected_nodes >= want_nodes and pop.admitted_users > 0 and stable:
                return pop
            if self._clock() > deadline or cancel.is_set():
                if pop.admitted_users > 0:
                    return pop
                raise PlanError(f"no users admitted at the shuffler after {self._population_wait:.0f} s")
            last = pop
            time.sleep(0.2)

    def _plan(self, run_id: str, cfg: RunConfig, live: _Live) -> dict[str, Any]:
        run = self._run(run_id)
        if run["plan"]:
            return run["plan"]
        model, _, _ = self._evaluation_data(cfg)
        pop = self._population(run_id, cfg.deployment.client_nodes, live.cancel)
        plan = plan_run(cfg, pop.admitted_users, pop.unused_users, model)
        limit = BudgetLimit(plan["eps"], plan["delta"], plan["composition"], plan["advanced_slack"])
        self.ledger.set_budget(run_id, limit, plan)
        state = psgd(plan["learning_rate"], plan["radius"]).init(model.init_params())
        self.ledger.save_checkpoint(run_id, -1, _encode_state(state), self._evaluate(model, cfg, state, -1))
        return plan

    def _evaluate(self, model: Model, cfg: RunConfig, state: AveragingState, r: int) -> dict[str, Any]:
        """Held-out loss/accuracy of the model after round r (r = -1: the initial model theta_0).

        After k steps the iterates are theta_0..theta_k. "last" is theta_k; "mean" is mean(theta_0..theta_k), which
        includes the iterate round r produced, so round 0 already shows a trained model. The released output (view)
        stays the papers' mean(theta_0..theta_{T-1}) (spec 000 sec 4, Alg 3 / Alg 5), i.e. state.mean().
        """
        _, X, y = self._evaluation_data(cfg)
        last = state.last
        mean = (state.iterate_sum + last) / (state.steps + 1)  # mean(theta_0..theta_k), k = state.steps
        return {
            "round": r,
            "loss_mean": model.loss(mean, X, y),
            "accuracy_mean": model.accuracy(mean, X, y),
            "loss_last": model.loss(last, X, y),
            "accuracy_last": model.accuracy(last, X, y),
        }

    # ------------------------------------------------------------------------------------------ the loop
    def _thread_main(self, run_id: str, live: _Live) -> None:
        try:
            self._execute(run_id, live)
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
        model, _, _ = self._evaluation_data(cfg)
        params = PvecParams(**plan["params"])
        step_fn = (psgd if plan["kind"] == "sequential" else pgd)(plan["learning_rate"], plan["radius"]).step
        ck = self.ledger.last_checkpoint(run_id)
        assert ck is not None  # _plan always writes the initial checkpoint
        state = _decode_state(ck[1])
        if plan["transport"] == "bits":
            # a fresh key per analyzer process: a round in flight during a crash is charged anyway
            live.private_key, live.public_key = sealing.generate_keypair()
        self.ledger.set_state(run_id, "RUNNING", "")
        failures = 0
        r = self.ledger.next_round(run_id)
        while r < plan["rounds"]:
            # no round is reserved while the shuffler cannot be reached: an outage costs no budget (issue 10 item 7)
            need = plan["cohort"] if plan["kind"] != "sequential" else 0  # fully interactive: every user
            if live.cancel.is_set() or not self._await_shuffler(run_id, live, need):
                self.ledger.set_state(run_id, "CANCELLED", "cancelled by the operator")
                return
            event = PrivacyEvent.pvec(params, plan["min_contributors"], plan["kind"])
            self.ledger.reserve(run_id, r, event)  # BudgetExceeded propagates: no spec leaves
            t0 = self._clock()
            outcome, state = self._round(run_id, r, cfg, plan, params, model, state, step_fn, event, live)
            failures = 0 if outcome == "ok" else failures + 1
            if outcome == "exhausted":
                self.ledger.set_state(run_id, "COMPLETED", f"stopped after round {r}: no fresh cohort left")
                return
            if failures >= _MAX_CONSECUTIVE_FAILURES:
                self.ledger.set_state(run_id, "FAILED", f"{failures} consecutive rounds failed (last: round {r})")
                return
            log.info("run %s round %d: %s (%.2f s)", run_id, r, outcome, self._clock() - t0)
            r += 1
        self.ledger.set_state(run_id, "COMPLETED", "")

    def _await_shuffler(self, run_id: str, live: _Live, need_users: int = 0) -> bool:
        """Return once the shuffler answers GetPopulation, retrying with exponential backoff while it is unreachable
        (the run's status message says so meanwhile), and once need_users users are connected again (after an
        outage nodes reconnect with a backoff of their own; waited for up to the population wait, then the round
        is tried anyway). False if the run is cancelled while waiting."""
        delay, since, waited_users = 0.5, None, None
        while not live.cancel.is_set():
            try:
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
            if pop.admitted_users < need_users:
                waited_users = self._clock() if waited_users is None else waited_users
                if self._clock() - waited_users < self._population_wait:
                    why = f"waiting for users to reconnect: {pop.admitted_users} of {need_users} connected"
                    self.ledger.set_state(run_id, "RUNNING", why)
                    live.cancel.wait(0.2)
                    continue
            if waited_users is not None:
                self.ledger.set_state(run_id, "RUNNING", "")
            return True
        return False

    def _round(self, run_id, r, cfg, plan, params, model, state, step_fn, event, live):
        """One round after its reservation. Returns (outcome, state)."""
        spec = round_spec(run_id, r, plan, params, event, state.last, live.public_key)
        t0 = self._clock()
        try:
            batch = self.shuffler.ExecuteRound(spec, timeout=plan["deadline"] + _RPC_GRACE_SECONDS)
        except grpc.RpcError as exc:
            code = exc.code()
            if _refused_before_collection(exc):
                # the shuffler refused the spec: no batch exists -> nothing to charge
                why = f"shuffler refused the round: {code.name}: {exc.details()}"
                self.ledger.release(run_id, r, why)
                self._metrics(run_id, r, model, cfg, state, False, 0, self._clock() - t0, failure=why)
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
            self._metrics(run_id, r, model, cfg, state, False, 0, self._clock() - t0, failure=failure)
            return "error", state
        rep = batch.report
        if not batch.released:
            if batch.label_totals or batch.ciphertexts:
                raise RuntimeError("the shuffler sent data in a batch marked not released")
            self.ledger.release(run_id, r, f"below threshold: {rep.contributors} contributors")
            seconds = self._clock() - t0
            n_rep, rejected = rep.contributors, dict(rep.rejected)
            self._metrics(run_id, r, model, cfg, state, False, n_rep, seconds, rejected, rep)
            return "below_threshold", state
        n = int(rep.contributors)
        if batch.run_id != run_id or batch.round != r:
            raise RuntimeError(f"batch for run {batch.run_id!r} round {batch.round} answered round {r}")
        if not plan["min_contributors"] <= n <= plan["cohort"]:
            # the threshold is what bounds the cost; a batch outside it is charged honestly and the run stops
            self.ledger.commit(run_id, r, max(n, 1))
            raise RuntimeError(f"batch has {n} contributors, outside [{plan['min_contributors']}, {plan['cohort']}]")
        if plan["transport"] == "bits":
            return self._bits_round(run_id, r, batch, n, cfg, plan, params, model, state, step_fn, live, t0)
        self.ledger.commit(run_id, r, n)  # the batch is used from here on
        total = decode_counts(np.asarray(batch.label_totals, dtype=np.int64), n, params)
        return self._step(run_id, r, total, n, cfg, model, state, step_fn, t0, dict(rep.rejected), rep)

    def _step(self, run_id, r, total, n, cfg, model, state, step_fn, t0, rejected: dict[str, int], report):
        grad = total / n  # paper divides by B; n' keeps the estimate unbiased under dropouts (spec 000 sec 3)
        _, state = step_fn(grad, state, state.last)
        self._metrics(run_id, r, model, cfg, state, True, n, self._clock() - t0, rejected, report)
        return "ok", state

    def _bits_round(self, run_id, r, batch, n, cfg, plan, params, model, state, step_fn, live, t0):
        """A released BITS batch: open every ciphertext, skip and count bad ones, decode the rest with their n'.

        Messages cannot be attributed to users (that is the shuffle), so the good messages are decoded only when
        they form whole contributions: n' = good / (d (g + m)) with every label carrying n' (g + m) messages, which
        is what a contributor whose messages all fail (wrong key, stale round, corrupt node) leaves. The batch was
        delivered and opened, so the round is always charged (never released, design 6), with the contributors
        whose messages the analyzer could read: n' when n' >= n_min (cost <= reservation); a round with
        n' < n_min fails like a below-threshold batch (nothing released, no optimizer step) but is committed at
        max(n', 1), which may cost MORE than the reservation: those n' users' messages were read with only n' users'
        noise. Scattered bad messages (labels unbalanced) cannot be decoded without bias: the round fails, charged
        at the contributions certainly intact, max(n - bad, 1) (each bad message spoils at most one contribution).
        """
        per_user = params.messages_per_user
        if len(batch.ciphertexts) != n * per_user:
            self.ledger.commit(run_id, r, n)  # delivered: charged at what the shuffler reported; the run stops
            raise RuntimeError(f"{len(batch.ciphertexts)} bit messages do not match {n} contributors")
        info = sealing.round_info(run_id, r)
        labels, bits, rejected_counter = open_bit_messages(live.private_key, batch.ciphertexts, info, params.d)
        n_bad = sum(rejected_counter.values())
        rejected = dict(Counter(dict(batch.report.rejected)) + rejected_counter)  # the shuffler's and ours
        if n_bad:
            log.warning("run %s round %d: skipped %d of %d bit messages %s", run_id, r, n_bad, n * per_user, rejected)
        n_min = plan["min_contributors"]
        whole = labels.size % per_user == 0
        n_good, total = (labels.size // per_user if whole else 0), None
        if n_good:
            try:
                # also checks every label carries n'(g+m) messages; the estimate is used only if n' >= n_min
                total = decode_bits(labels, bits, params)
            except ValueError:
                whole, n_good = False, 0
        if total is None or n_good < n_min:
            if whole:
                failure, charged = f"below threshold after rejecting bad messages: {n_good} < {n_min}", max(n_good, 1)
            else:
                failure, charged = "bad messages left incomplete contributions: not decodable", max(n - n_bad, 1)
            self.ledger.commit(run_id, r, charged)
            log.warning("run %s round %d failed: %s; charged with %d contributors", run_id, r, failure, charged)
            seconds = self._clock() - t0
            self._metrics(run_id, r, model, cfg, state, False, n_good, seconds, rejected, batch.report, failure=failure)
            return "below_threshold", state
        self.ledger.commit(run_id, r, n_good)  # the batch is used from here on
        return self._step(run_id, r, total, n_good, cfg, model, state, step_fn, t0, rejected, batch.report)

    def _metrics(
        self,
        run_id,
        r,
        model,
        cfg,
        state,
        released: bool,
        n: int,
        seconds: float,
        rejected: dict[str, int] | None = None,
        report: pb.BatchReport | None = None,
        failure: str = "",
    ) -> None:
        m = self._evaluate(model, cfg, state, r)
        totals = self.ledger.totals(run_id)
        m.update(
            released=released,
            contributors=n,
            seconds=seconds,
            eps_spent=totals.eps_spent,
            delta_spent=totals.delta_spent,
            rejected=dict(rejected or {}),  # messages rejected by reason, by the shuffler and the analyzer
            # users who refused the round (their policy, or their node could not deliver), total and by reason
            refused=int(report.refused) if report is not None else 0,
            refused_reasons=dict(report.refused_reasons) if report is not None else {},
        )
        if failure:
            m["failure"] = failure
        self.ledger.save_checkpoint(run_id, r, _encode_state(state), m)
