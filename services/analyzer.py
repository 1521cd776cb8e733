"""The analyzer service: a thin gRPC servicer over services.run_manager.RunManager.

The analyzer is the untrusted party of the shuffle model (design section 1): it dials only the shuffler
(GetPopulation, ExecuteRound) and never a client; what it learns about a round is the ShuffledBatch (per-label
totals or permuted ciphertexts plus the batch report). Operators dial it (CreateRun, StartRun, GetRunStatus,
GetRunResult, CancelRun, GetBudget). State (the privacy ledger with checkpoints) lives in state_dir/ledger.sqlite;
starting on an existing state_dir resumes RUNNING runs (in-flight rounds are charged as spent).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path

import grpc
from shuffledp.services.ledger import BudgetTotals, Ledger, LedgerError
from shuffledp.services.run_manager import RunManager, RunNotFound, RunStateError, RunView

from shuffledp.config import ConfigError
from shuffledp.planning import PlanError
from shuffledp.transport import grpc_options, tls
from shuffledp.transport.health import start_with_health
from shuffledp.transport.spec_signing import SpecSigner
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

log = logging.getLogger(__name__)

__all__ = ["AnalyzerServicer", "start_analyzer", "LEDGER_FILE"]

LEDGER_FILE = "ledger.sqlite"
MAX_STATUS_WAIT_MS = 10_000  # a GetRunStatus long poll holds a server thread for at most this long
_WORKERS = 8
# long polls holding a thread at once; one more is answered at once (what a poll with no wait gets): pollers
# cannot take every thread from the health checks and the operator's other calls
MAX_LONG_POLLS = _WORKERS // 2

# domain exception -> status code (one table; the first matching class wins)
_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (RunNotFound, grpc.StatusCode.NOT_FOUND),
    (RunStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (PlanError, grpc.StatusCode.FAILED_PRECONDITION),
    (LedgerError, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)
_STATES = {
    "CREATED": pb.CREATED,
    "RUNNING": pb.RUNNING,
    "COMPLETED": pb.COMPLETED,
    "FAILED": pb.FAILED,
    "CANCELLED": pb.CANCELLED,
    "BUDGET_EXHAUSTED": pb.BUDGET_EXHAUSTED,
}


def _abort(context: grpc.ServicerContext, exc: BaseException):
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            context.abort(code, tls.clip_details(str(exc)))
    raise exc


def _budget(b: BudgetTotals | None) -> pb.BudgetStatus:
    if b is None:
        return pb.BudgetStatus()
    return pb.BudgetStatus(
        eps_spent=b.eps_spent,
        delta_spent=b.delta_spent,
        eps_reserved=b.eps_reserved,
        delta_reserved=b.delta_reserved,
        eps_limit=b.eps_limit,
        delta_limit=b.delta_limit,
        accountant=b.accountant,
        trust_model=pb.TrustModel.Value(b.trust_model.upper()),
        rounds_committed=b.rounds_committed,
        honest_fraction=b.honest_fraction,
        eps_spent_robust=b.eps_spent_robust,
        views=b.views,
    )


def _status(v: RunView, output: str = "mean") -> pb.RunStatus:
    metrics = [
        pb.RoundMetrics(
            round=m["round"],
            contributors=m.get("contributors", 0),
            loss=m[f"loss_{output}"],
            accuracy=m[f"accuracy_{output}"],
            eps_spent=m.get("eps_spent", 0.0),
            delta_spent=m.get("delta_spent", 0.0),
            released=m.get("released", False),
            seconds=m.get("seconds", 0.0),
            rejected=m.get("rejected", {}),
            refused=m.get("refused", 0),
            refused_reasons=m.get("refused_reasons", {}),
            not_in_run=m.get("not_in_run", 0),
            checked_in=m.get("checked_in", 0),
            excluded_silent=m.get("excluded_silent", 0),
            failure=m.get("failure", ""),
            excess_risk=m.get(f"excess_risk_{output}"),
            eps_spent_local=m.get("eps_spent_local"),
        )
        for m in v.metrics
    ]
    return pb.RunStatus(
        run_id=v.run_id,
        state=_STATES[v.state],
        rounds_done=v.rounds_done,
        rounds_planned=v.rounds_planned,
        budget=_budget(v.budget),
        metrics=metrics,
        message=v.message,
        metrics_from=v.metrics_from,
    )


class AnalyzerServicer(pbg.AnalyzerServicer):
    """Operator API: converts messages, calls the run manager, maps domain errors to status codes."""

    def __init__(self, manager: RunManager):
        self.manager = manager
        self._long_polls = threading.BoundedSemaphore(MAX_LONG_POLLS)

    def _view(self, run_id: str, with_result: bool = False, metrics_from: int = 0) -> tuple[RunView, str]:
        v = self.manager.view(run_id, with_result, metrics_from)
        plan = self.manager.ledger.run(run_id)["plan"] or {}
        return v, plan.get("output", "mean")

    def CreateRun(self, request: pb.CreateRunRequest, context: grpc.ServicerContext) -> pb.RunStatus:
        try:
            run_id = self.manager.create_run(request.config_toml)
            return _status(*self._view(run_id))
        except Exception as exc:
            _abort(context, exc)

    def StartRun(self, request: pb.RunRef, context: grpc.ServicerContext) -> pb.RunStatus:
        try:
            self.manager.start_run(request.run_id)
            return _status(*self._view(request.run_id))
        except Exception as exc:
            _abort(context, exc)

    def GetRunStatus(self, request: pb.RunRef, context: grpc.ServicerContext) -> pb.RunStatus:
        # with wait_ms, a long poll: the status is answered once it differs from what the caller has seen, so an
        # operator sees each round as it ends without polling (answers are a complete status, but for the first
        # metrics_from rounds' metrics, which the caller asked to leave out: what it already holds)
        polling = request.wait_ms > 0 and self._long_polls.acquire(blocking=False)
        try:
            deadline = time.monotonic() + (min(request.wait_ms, MAX_STATUS_WAIT_MS) / 1000.0 if polling else 0.0)
            ledger = self.manager.ledger
            seen = (request.seen_rounds, request.seen_state, request.seen_message)
            while True:
                version = ledger.version
                left = deadline - time.monotonic()
                now = ledger.progress(request.run_id)  # cheap: the full view composes the budget
                if left <= 0 or not context.is_active() or now is None or (now[0], _STATES[now[1]], now[2]) != seen:
                    return _status(*self._view(request.run_id, metrics_from=request.metrics_from))
                ledger.wait_change(version, min(left, 1.0))
        except Exception as exc:
            _abort(context, exc)
        finally:
            if polling:
                self._long_polls.release()

    def GetRunResult(self, request: pb.RunRef, context: grpc.ServicerContext) -> pb.RunResult:
        try:
            v, output = self._view(request.run_id, with_result=True)
            result = pb.RunResult(
                status=_status(v, output),
                ledger_json=v.ledger_json,
                config_toml=v.config_toml,
                loss=v.loss,
                accuracy=v.accuracy,
                excess_risk=v.excess_risk,
            )
            if v.model is not None:
                result.model.CopyFrom(pb.Tensor(shape=[v.model.size], f64=v.model.astype("<f8").tobytes()))
            return result
        except Exception as exc:
            _abort(context, exc)

    def CancelRun(self, request: pb.RunRef, context: grpc.ServicerContext) -> pb.RunStatus:
        try:
            self.manager.cancel_run(request.run_id)
            return _status(*self._view(request.run_id))
        except Exception as exc:
            _abort(context, exc)

    def GetBudget(self, request: pb.RunRef, context: grpc.ServicerContext) -> pb.BudgetStatus:
        try:
            return _budget(self.manager.budget(request.run_id))
        except Exception as exc:
            _abort(context, exc)


def start_analyzer(
    listen: str,
    shuffler_address: str,
    state_dir: Path,
    server_credentials: grpc.ServerCredentials | None = None,
    channel_credentials: grpc.ChannelCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    signer: SpecSigner | None = None,
) -> tuple[grpc.Server, int]:
    """Start the analyzer on `listen` (port 0 = any); returns (started server, bound port).

    None credentials mean plain text (loopback only, the explicit insecure mode). `signer` signs every round spec
    with the analyzer's role key (give it with mTLS: nodes with a PKI act on signed specs only). Resumes RUNNING
    runs found in state_dir's ledger.
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    # batches up to grpc_options.BATCH_MESSAGE_BYTES, the shuffler's send limit (issue 10 item 5)
    options = grpc_options.analyzer_channel_options()
    if channel_credentials is None:
        channel = tls.plain_channel(shuffler_address, options)
    else:
        channel = grpc.secure_channel(shuffler_address, channel_credentials, options=options)
    manager = RunManager(Ledger(state_dir / LEDGER_FILE), pbg.ShufflerStub(channel), signer=signer)
    manager.recover()  # before any call can start a run: a round reserved by this process is never taken as lost
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=_WORKERS),
        interceptors=list(interceptors),
        options=grpc_options.server_options(max_receive=grpc_options.CLIENT_MESSAGE_BYTES),
    )
    pbg.add_AnalyzerServicer_to_server(AnalyzerServicer(manager), server)
    # with the standard gRPC health protocol: compose healthchecks and `shuffledp health` ask for it
    port, _ = start_with_health(server, listen, server_credentials, "shuffledp.v1.Analyzer")
    server.manager = manager  # type: ignore[attr-defined]  (tests and serve.py may inspect it)
    server.shuffler_channel = channel  # type: ignore[attr-defined]
    manager.resume()  # once the port is bound: a process that cannot serve runs no round
    log.info("analyzer listening on port %d, shuffler at %s", port, shuffler_address)
    return server, port
