"""Prometheus metrics of the services (issue 29 item 1): `shuffledp serve ... --metrics-port PORT`.

One CollectorRegistry per service (never the process-global one), so several services in one process do not clash.
Most values are read when Prometheus scrapes, from the state the service keeps anyway (the analyzer's ledger, the
shuffler's counters, the node's counters): they agree with the ledger and metrics.json by construction, and the
analyzer's survive its restart. Observed live: planning time, and the shuffler's round phases, batch sizes and
round outcomes (hooks the services call; a failing hook is logged and never fails a round).

What a label or value may carry: run ids, node identities (certificate names), reasons (refusals: the known set;
rejections: lower-case words), states and numbers. Never a user id, a node's user list or message content: reasons
forwarded from nodes (free text at the shuffler, bounded) are mapped to the node policy's known reasons, anything
else to "other".

How many series a label makes is bounded whatever the other parties send (issue 43 item 6: 3000 RegisterUsers with
made-up node ids made 3000 series): at most MAX_NODE_SERIES nodes (those holding a stream first), MAX_RUN_SERIES
runs (the newest) and MAX_REASON_SERIES rejection reasons per run have a series of their own; the rest are summed
under the label value OTHER ("other"), and a run's gauges (budget, plan) are shown for its own series only.

Naming follows the Prometheus conventions: `shuffledp_<service>_` prefix, `_total` counters, base units
(`_seconds`), and no unit for counts and privacy parameters (eps, delta are dimensionless).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from shuffledp.clients.node import SUBMIT_FAILED_PREFIX
from shuffledp.clients.policy import Refusal

__all__ = [
    "analyzer_registry",
    "shuffler_registry",
    "node_registry",
    "serve_metrics",
    "metrics_host",
    "safe_reason",
    "RUN_STATES",
    "ROUND_SECONDS_BUCKETS",
    "MAX_NODE_SERIES",
    "MAX_RUN_SERIES",
    "MAX_REASON_SERIES",
    "OTHER",
]

log = logging.getLogger(__name__)

RUN_STATES = ("CREATED", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "BUDGET_EXHAUSTED")
# a round lasts from ~0.05 s (loopback, small cohorts) to its deadline (minutes in a deployment)
ROUND_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PLANNING_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (0, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000)
# label cardinality (module docstring): per-node series for at most 100 nodes (a shuffler holds up to 10^4: the rest
# summed under "other"); runs and reasons a scrape of a few hundred kB at most shows (about 12 series a run)
MAX_NODE_SERIES = 100
MAX_RUN_SERIES = 100
MAX_REASON_SERIES = 32
OTHER = "other"
# the run manager's failure text of a round the shuffler refused before any batch existed (services/run_manager.py)
_SHUFFLER_REFUSED = "shuffler refused the round"
# every reason a node of this project gives (clients/policy.Refusal, clients/node.SUBMIT_FAILED_PREFIX + a status)
_KNOWN_REASONS = frozenset(
    [v for k, v in vars(Refusal).items() if k.isupper() and isinstance(v, str)]
    + [SUBMIT_FAILED_PREFIX + c.name.lower() for c in grpc.StatusCode]
    + ["unspecified", "other"]
)


def safe_reason(reason: str) -> str:
    """A node's refusal reason as a label value: one of the known reasons, else "other" (a node's free text must
    not reach a label: it could carry a user id)."""
    return reason if reason in _KNOWN_REASONS else "other"


def metrics_host(listen: str) -> str:
    """The host part of a gRPC `--listen` address, where the metrics port binds too (ValueError for a unix socket,
    which has no host for an HTTP port)."""
    if listen.startswith(("unix:", "unix-abstract:")) or ":" not in listen:
        raise ValueError(f"--metrics-port needs a host:port --listen, got {listen!r}")
    host = listen.rsplit(":", 1)[0].strip("[]")
    return host or "0.0.0.0"  # ":50051" is every address, as in gRPC


def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """Serve `registry` as plain HTTP on host:port (/metrics); returns (server, bound port). server.shutdown() stops
    it."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_port)


# ------------------------------------------------------------------------------------------------- analyzer
class _RoundStats:
    """What the analyzer's metrics sum over a run's per-round metrics, added to as rounds arrive: a scrape decodes
    only the rounds it has not read yet, so its cost does not grow with a long run's rounds (issue 30 item 4)."""

    def __init__(self) -> None:
        self.rows = 0  # rounds read (checkpoints with round >= 0)
        self.last = -1  # the highest round read
        self.le = [0] * len(ROUND_SECONDS_BUCKETS)  # rounds at most each bucket's bound long (cumulative)
        self.seconds_sum = 0.0
        self.refusals: Counter = Counter()
        self.rejected: Counter = Counter()

    def add(self, round_index: int, m: dict[str, Any]) -> None:
        s = float(m.get("seconds", 0.0))
        self.rows, self.last, self.seconds_sum = self.rows + 1, max(self.last, round_index), self.seconds_sum + s
        for i, bound in enumerate(ROUND_SECONDS_BUCKETS):
            self.le[i] += s <= bound
        for why, n in (m.get("refused_reasons") or {}).items():
            self.refusals[safe_reason(why)] += int(n)
        for why, n in (m.get("rejected") or {}).items():  # the shuffler's reasons too: free words on the wire
            self._reject(safe_label(why), int(n))

    def _reject(self, label: str, n: int) -> None:
        if label not in self.rejected and len(self.rejected) >= MAX_REASON_SERIES:
            label = OTHER
        self.rejected[label] += n

    def absorb(self, other: _RoundStats) -> None:
        """Add another run's figures (the sum over the runs without a series of their own)."""
        self.rows, self.seconds_sum = self.rows + other.rows, self.seconds_sum + other.seconds_sum
        self.le = [a + b for a, b in zip(self.le, other.le, strict=True)]
        self.refusals.update(other.refusals)
        for why, n in other.rejected.items():
            self._reject(why, n)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative histogram buckets (Prometheus: le = upper bound, the last +Inf = the count)."""
        out = [(str(b), float(n)) for b, n in zip(ROUND_SECONDS_BUCKETS, self.le, strict=True)]
        return [*out, ("+Inf", float(self.rows))]


class _AnalyzerCollector(Collector):
    """Read from the ledger at scrape time, through a read-only connection of its own (WAL lets readers run beside
    the writer; the ledger's lock is not held while rows are read), in one read transaction; the budget is composed
    by Ledger.totals (its memo: once per write). A run's per-round metrics are decoded once each (_RoundStats); the
    budget is asked for again only when the run's rounds changed."""

    def __init__(self, ledger) -> None:
        self.ledger = ledger
        self._stats: dict[str, _RoundStats] = {}
        self._lock = threading.Lock()  # scrapes may come at once (one thread per request): one reads, then the next
        self._budget: dict[str, tuple[tuple, tuple[float, ...]]] = {}  # run_id -> (its rounds when read, budget)

    def _stats_of(self, db: sqlite3.Connection, run_id: str) -> _RoundStats:
        (n_metrics,) = db.execute(
            "SELECT COUNT(*) FROM checkpoints WHERE run_id=? AND round >= 0", (run_id,)
        ).fetchone()
        stats = self._stats.get(run_id)
        if stats is not None and stats.rows == n_metrics:
            return stats
        new = []
        if stats is not None and stats.rows < n_metrics:
            new = db.execute(
                "SELECT round, metrics_json FROM checkpoints WHERE run_id=? AND round > ? ORDER BY round",
                (run_id, stats.last),
            ).fetchall()
        if stats is None or stats.rows + len(new) != n_metrics:  # none yet, or rows not only appended: all again
            stats = _RoundStats()
            new = db.execute(
                "SELECT round, metrics_json FROM checkpoints WHERE run_id=? AND round >= 0 ORDER BY round", (run_id,)
            ).fetchall()
        for r, text in new:
            stats.add(int(r), json.loads(text))
        self._stats[run_id] = stats
        return stats

    def _read(self, db: sqlite3.Connection, run_id: str, has_limit: bool) -> dict[str, Any]:
        rounds: Counter = Counter()
        for st, refused, n in db.execute(
            "SELECT state, reason LIKE ? || '%', COUNT(*) FROM rounds WHERE run_id=? GROUP BY 1, 2",
            (_SHUFFLER_REFUSED, run_id),
        ):
            rounds["refused" if st == "released" and refused else st] += int(n)
        out: dict[str, Any] = {"rounds": rounds, "stats": self._stats_of(db, run_id)}
        if has_limit:
            key = tuple(sorted(rounds.items()))
            cached = self._budget.get(run_id)
            if cached is None or cached[0] != key:
                t = self.ledger.totals(run_id)
                cached = self._budget[run_id] = (key, (t.eps_spent, t.eps_limit, t.delta_spent, t.delta_limit))
            out["budget"] = cached[1]
        return out

    def collect(self) -> Iterator[Metric]:
        runs = GaugeMetricFamily("shuffledp_analyzer_runs", "Runs in the ledger by state", labels=["state"])
        in_flight = GaugeMetricFamily(
            "shuffledp_analyzer_rounds_in_flight", "Rounds reserved and not yet closed", labels=["run_id"]
        )
        rounds = CounterMetricFamily(
            "shuffledp_analyzer_rounds",
            "Rounds closed, by outcome: committed (charged), released (no batch delivered: nothing charged), refused "
            "(the shuffler refused the round: nothing charged), spent_unknown (outcome unknown: charged)",
            labels=["run_id", "outcome"],
        )
        planned = GaugeMetricFamily("shuffledp_analyzer_rounds_planned", "Rounds in the run's plan", labels=["run_id"])
        gauges = {
            name: GaugeMetricFamily(f"shuffledp_analyzer_{name}", doc, labels=["run_id"])
            for name, doc in (
                ("epsilon_spent", "Privacy loss eps spent by the run (committed and unknown-outcome rounds)"),
                ("epsilon_limit", "The run's eps budget"),
                ("delta_spent", "Privacy loss delta spent by the run"),
                ("delta_limit", "The run's delta budget"),
            )
        }
        latency = HistogramMetricFamily(
            "shuffledp_analyzer_round_duration_seconds",
            "Duration of a round, from its request to the shuffler to its update applied",
            labels=["run_id"],
        )
        refusals = CounterMetricFamily(
            "shuffledp_analyzer_user_refusals",
            "Invited users who refused a round (their node's policy reason, or why their node could not deliver)",
            labels=["run_id", "reason"],
        )
        rejected = CounterMetricFamily(
            "shuffledp_analyzer_messages_rejected",
            "Messages of a round rejected by the shuffler or the analyzer, by reason",
            labels=["run_id", "reason"],
        )
        by_state: Counter = Counter()

        def add(label: str, closed: Counter, stats: _RoundStats) -> None:
            in_flight.add_metric([label], closed.get("reserved", 0))
            for outcome in ("committed", "released", "refused", "spent_unknown"):
                rounds.add_metric([label, outcome], closed.get(outcome, 0))
            latency.add_metric([label], stats.buckets(), stats.seconds_sum)
            for why, n in sorted(stats.refusals.items()):
                refusals.add_metric([label, why], n)
            for why, n in sorted(stats.rejected.items()):
                rejected.add_metric([label, why], n)

        older_rounds, older_stats = Counter(), _RoundStats()  # summed over the runs without a series of their own
        with self._lock:
            db = sqlite3.connect(Path(self.ledger.path).resolve().as_uri() + "?mode=ro", uri=True, timeout=5)
            try:
                db.execute("BEGIN")  # one snapshot: a run's rows as they were together
                q = "SELECT run_id, state, plan_json, limit_json FROM runs ORDER BY created_at"
                rows = db.execute(q).fetchall()
                for i, (run_id, state, plan_json, limit_json) in enumerate(rows):
                    by_state[state] += 1
                    own = i >= len(rows) - MAX_RUN_SERIES  # the newest runs (runs are never deleted: "other" grows)
                    got = self._read(db, run_id, own and bool(limit_json))
                    if not own:
                        older_rounds.update(got["rounds"])
                        older_stats.absorb(got["stats"])
                        continue
                    if plan_json:
                        planned.add_metric([run_id], float(json.loads(plan_json).get("rounds", 0)))
                    if "budget" in got:
                        for family, value in zip(gauges.values(), got["budget"], strict=True):
                            family.add_metric([run_id], value)
                    add(run_id, got["rounds"], got["stats"])
            finally:
                db.close()
        if len(rows) > MAX_RUN_SERIES:  # counts only: the older runs' budgets and plans make no sum
            add(OTHER, older_rounds, older_stats)
        for state in RUN_STATES:
            runs.add_metric([state], by_state.get(state, 0))
        yield from (runs, in_flight, rounds, planned, *gauges.values(), latency, refusals, rejected)


def safe_label(reason: str) -> str:
    """A rejection reason (shuffler_state.Reason or the analyzer's decode reasons: lower-case words) as a label
    value; anything else is "other"."""
    ok = 0 < len(reason) <= 64 and all(c.islower() or c == "_" for c in reason)
    return reason if ok else "other"


def _never_raises(hook: Callable[..., None]) -> Callable[..., None]:
    """A hook the service calls: a failure in it is logged, never lets a round or a plan fail."""

    def safe(*args) -> None:
        try:
            hook(*args)
        except Exception:
            log.exception("metrics hook failed")

    return safe


def analyzer_registry(manager) -> CollectorRegistry:
    """The analyzer's metrics over its RunManager (services/run_manager.py); installs the planning-time hook."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_AnalyzerCollector(manager.ledger))
    planning = Histogram(
        "shuffledp_analyzer_planning_seconds",
        "Time to plan a run (calibration and accounting of its rounds, once its population is known)",
        buckets=PLANNING_SECONDS_BUCKETS,
        registry=registry,
    )
    manager.on_planned = _never_raises(lambda run_id, seconds: planning.observe(seconds))
    return registry


# ------------------------------------------------------------------------------------------------- shuffler
class _ShufflerCollector(Collector):
    def __init__(self, state, limits=None) -> None:
        self.state = state
        self.limits = limits  # services.shuffler.CallLimits: the calls and nodes it refused

    def collect(self) -> Iterator[Metric]:
        users = GaugeMetricFamily(
            "shuffledp_shuffler_admitted_users", "Users admitted at the shuffler, per node identity", labels=["node"]
        )
        nodes = self.state.node_summary()
        # the nodes holding a stream first (the live ones), then by name; a node named "other" is summed there too
        ranked = sorted(nodes.items(), key=lambda kv: (not kv[1][1], kv[0]))
        own = [(node, n) for node, (n, _) in ranked if node != OTHER][:MAX_NODE_SERIES]
        for node, n in own:
            users.add_metric([node], n)
        if len(own) < len(nodes):
            users.add_metric([OTHER], sum(n for n, _ in nodes.values()) - sum(n for _, n in own))
        yield users
        yield GaugeMetricFamily(
            "shuffledp_shuffler_open_streams",
            "Nodes holding an invitation stream (Subscribe) now",
            value=sum(1 for _, streaming in nodes.values() if streaming),
        )
        counters = self.state.counters()
        yield CounterMetricFamily(
            "shuffledp_shuffler_messages_accepted",
            "User messages accepted into a round",
            value=counters.get("accepted", 0),
        )
        yield CounterMetricFamily(
            "shuffledp_shuffler_user_refusals",
            "Refusals relayed by nodes for their invited users",
            value=counters.get("refused", 0),
        )
        rejected = CounterMetricFamily(
            "shuffledp_shuffler_messages_rejected", "User messages rejected, by reason", labels=["reason"]
        )
        for why, n in sorted(counters.items()):
            if why not in ("accepted", "refused"):
                rejected.add_metric([safe_label(why)], n)
        yield rejected
        if self.limits is not None:
            yield from self._refused()

    def _refused(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "shuffledp_shuffler_refused_calls",
            "Calls the shuffler refused when they opened, by reason (capacity: a node over --max-nodes; node_streams, "
            "node_requests: a node over its quota; revoked; first_message_deadline: nothing sent in time)",
            labels=["reason"],
        )
        for why, n in sorted(self.limits.refusals().items())[:MAX_REASON_SERIES]:
            calls.add_metric([safe_label(why)], n)
        yield calls
        nodes = CounterMetricFamily(
            "shuffledp_shuffler_refused_node_calls",
            f"Calls refused per node and reason, for the {MAX_NODE_SERIES} nodes refused last (the rest under "
            f"node={OTHER!r})",
            labels=["node", "reason"],
        )
        refused = self.limits.refused_nodes()
        shown, rest = refused[-MAX_NODE_SERIES:], refused[:-MAX_NODE_SERIES]
        for r in shown:
            nodes.add_metric([r.node, safe_label(r.reason)], r.calls)  # a certificate name, or an id the state checked
        others: Counter = Counter()
        for r in rest:
            others[r.reason] += r.calls
        for why, n in sorted(others.items()):
            nodes.add_metric([OTHER, safe_label(why)], n)
        yield nodes


def shuffler_registry(state, limits=None) -> CollectorRegistry:
    """The shuffler's metrics over its ShufflerState and its CallLimits (services.shuffler: the calls and nodes it
    refused; none without); installs the round hook (phases' durations, batch sizes)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_ShufflerCollector(state, limits))
    phases = Histogram(
        "shuffledp_shuffler_round_phase_seconds",
        "Duration of a round's phases: select (cohort drawn, recorded, invited), collect (waiting for the "
        "contributions, check-ins included), release (threshold and shuffle)",
        labelnames=["phase"],
        buckets=ROUND_SECONDS_BUCKETS,
        registry=registry,
    )
    sizes = Histogram(
        "shuffledp_shuffler_batch_contributors",
        "Contributors in a round's batch (released or not)",
        buckets=BATCH_BUCKETS,
        registry=registry,
    )
    rounds = PromCounter(
        "shuffledp_shuffler_rounds",
        "Rounds executed, by outcome (released, below_threshold)",
        labelnames=["outcome"],
        registry=registry,
    )

    def on_round(batch, seconds: dict[str, float]) -> None:
        for phase, s in seconds.items():
            phases.labels(phase).observe(s)
        sizes.observe(batch.contributors)
        rounds.labels("released" if batch.released else "below_threshold").inc()

    state.on_round = _never_raises(on_round)
    return registry


# ------------------------------------------------------------------------------------------------- client node
class _NodeCollector(Collector):
    def __init__(self, handle) -> None:
        self.handle = handle

    def collect(self) -> Iterator[Metric]:
        core = self.handle.core
        st = core.status()  # under the node's lock: one consistent reading
        yield GaugeMetricFamily("shuffledp_node_users", "Users hosted by this node", value=st.users)
        yield GaugeMetricFamily(
            "shuffledp_node_connected",
            "1 while the node's invitation stream to the shuffler is up",
            value=1.0 if self.handle.connected.is_set() else 0.0,
        )
        yield CounterMetricFamily(
            "shuffledp_node_rounds_joined",
            "Rounds in which at least one of this node's users joined",
            value=st.rounds_joined,
        )
        refusals = CounterMetricFamily(
            "shuffledp_node_user_refusals",
            "Invited users of this node who refused a round, by reason",
            labels=["reason"],
        )
        by_reason: Counter = Counter()
        for why, n in st.refusals.items():
            by_reason[safe_reason(why)] += n
        for why, n in sorted(by_reason.items()):
            refusals.add_metric([why], n)
        yield refusals
        yield CounterMetricFamily(
            "shuffledp_node_spend_records",
            "Spend records written (one per charged user per round)",
            value=core.spend_records,
        )


def node_registry(handle) -> CollectorRegistry:
    """The client node's metrics over its ClientNodeHandle (clients/node.py)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_NodeCollector(handle))
    return registry
