"""MLflow run tracking (issue 46 item 4): `[tracking] mlflow = true` (or a tracking URI), or `shuffledp run --mlflow
[URI]`, logs each run as one MLflow run, named after its results directory, in the experiment `[tracking]
experiment`:

- params: at the start the configuration with every key resolved (`privacy.eps`, `schedule.kind`, the protocol's own
  table as `privacy.<protocol>.<key>`, an unset key as "unset"); at the end summary.json's plan, the analyzer's
  (`plan.protocol`, `plan.eps`, `plan.delta` as planned, `plan.rounds`, `plan.optimizer`, `plan.learning_rate`,
  `plan.protocol_params.*`, ...) and `spend.accountant`, `spend.trust_model`;
- metrics, step = the round (1-based, as in metrics.json), logged as each round ends: the scalars TensorBoard gets
  (tracking.TAGS: loss, accuracy, eps_spent, delta_spent, contributors, refused, rejected, released, seconds; loss and
  accuracy only where defined), excess_risk and eps_spent_local where the run has them, refused_by_reason/<reason>;
  at the end the released model's and the spend's figures from summary.json (final/accuracy, final/loss,
  final/excess_risk, final/eps_spent, final/delta_spent, final/eps_limit, final/delta_limit, final/eps_robust);
- artifacts, at the end, after the results directory is written: its files (model.npz, plot.png, summary.json,
  metrics.json, metrics.csv, ledger.json, config.toml, a model plug-in's export);
- tags: shuffledp.run_id (the analyzer's), shuffledp.state, shuffledp.protocol, shuffledp.results; the MLflow run
  ends FINISHED (COMPLETED), KILLED (cancelled or interrupted) or FAILED (anything else, or a CLI that ended without
  results: atexit).

`mlflow = true` keeps a store of the run's own in its results directory, offline: OUT/mlflow/mlflow.db (SQLite) with
the artifacts in OUT/mlflow/artifacts; `mlflow ui --backend-store-uri sqlite:///OUT/mlflow/mlflow.db` shows it. A
URI is MLflow's own (sqlite:///PATH/mlflow.db for a project's store, whose new experiments keep their artifacts in
PATH/artifacts; http://HOST:5000 for a tracking server, which keeps them where it is configured to). SQLite,
not MLflow's ./mlruns file store: MLflow 3 refuses that one (maintenance mode) unless MLFLOW_ALLOW_FILE_STORE=true.

A tracker never costs the run its results: they are written before anything is logged at the end, and any MLflow
failure is one line on stderr, after which the tracker logs nothing more. MLflow is imported here only (optional
extra `mlflow`: mlflow-skinny, SQLAlchemy, alembic), its usage telemetry is off unless MLFLOW_DISABLE_TELEMETRY /
DO_NOT_TRACK say otherwise, and against an HTTP server it retries twice with a 30 s timeout unless
MLFLOW_HTTP_REQUEST_MAX_RETRIES / MLFLOW_HTTP_REQUEST_TIMEOUT say otherwise (not for minutes while a run waits).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["MlflowTracker", "check_mlflow", "config_params", "store_uri", "EXTRA_HINT"]

EXTRA_HINT = "pip install 'shuffledp[mlflow]' (mlflow-skinny, SQLAlchemy, alembic)"
STORE_DIR = "mlflow"  # OUT/mlflow: the store of `mlflow = true`
_MAX_PARAMS, _MAX_METRICS = 100, 1000  # MLflow's log_batch limits
_END_STATUS = {pb.COMPLETED: "FINISHED", pb.CANCELLED: "KILLED"}


def _environment(target: bool | str) -> None:
    """MLflow's environment, before it is imported: no telemetry; bounded retries against a server."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    if isinstance(target, str) and target.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def check_mlflow(target: bool | str) -> str | None:
    """Why MLflow tracking to `target` cannot be done here, as the end of a line that names what asked for it
    ("--mlflow needs the optional extra ..."), or None."""
    _environment(target)
    needs = ["mlflow"]
    if target is True or (isinstance(target, str) and target.startswith("sqlite:")):
        needs += ["sqlalchemy", "alembic"]  # MLflow's SQL store (mlflow-skinny leaves them out)
    for name in needs:
        try:  # found, not imported: the import (~3 s) is the tracker's, while the services start
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # ValueError: sys.modules[name] is None (blocked)
            found = False
        if not found:
            return f"needs the optional extra 'mlflow' (no module {name}): {EXTRA_HINT}"
    return None


def store_uri(target: bool | str, out: Path) -> tuple[str, str | None]:
    """(tracking URI, artifact location of a new experiment or None = the store's default) of `target`. A SQLite
    store keeps a new experiment's artifacts beside its database (DIR/mlflow.db: DIR/artifacts), not in MLflow's
    default ./mlruns of whichever directory the first run happened to start in."""
    if target is True:
        store = Path(out).resolve() / STORE_DIR
        return f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
    uri = str(target)
    db = uri.removeprefix("sqlite:///").split("?", 1)[0]
    if uri.startswith("sqlite:///") and db not in ("", ":memory:"):
        return uri, (Path(db).resolve().parent / "artifacts").as_uri()
    return uri, None


def _text(v: Any) -> str:
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | tuple | dict):
        return json.dumps(v)
    return str(v)


def config_params(config_toml: str) -> dict[str, str]:
    """The configuration as MLflow params: every key of every section resolved (RunConfig; not [tracking] itself),
    the protocol's table as privacy.<protocol>.<key>, model.args as model.args.<name>. A document this installation
    cannot parse (a fetched run of another version): its keys as written."""
    from shuffledp.config import ConfigError, parse_config

    try:
        cfg = parse_config(config_toml)
    except ConfigError:
        import tomllib

        return _flat(tomllib.loads(config_toml))
    out: dict[str, str] = {}
    for section in fields(cfg):
        table = getattr(cfg, section.name)
        if not is_dataclass(table) or section.name == "tracking":
            continue
        for f in fields(table):
            value = getattr(table, f.name)
            if is_dataclass(value):  # [privacy.<protocol>]
                for g in fields(value):
                    out[f"{section.name}.{cfg.privacy.protocol}.{g.name}"] = _text(getattr(value, g.name))
            elif section.name == "model" and f.name == "args":
                out.update({f"model.args.{k}": _text(v) for k, v in value})
            else:
                out[f"{section.name}.{f.name}"] = _text(value)
    return out


def _flat(table: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            if prefix or key != "tracking":
                out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = _text(value)
    return out


def _chunks(items: list, n: int) -> Iterable[list]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class MlflowTracker:
    """One results directory's MLflow run: `update` for each status as the run goes (drive_run's on_status),
    `finish` once the results directory is written. Any MLflow failure: one line on `warn`, then nothing more."""

    def __init__(
        self,
        target: bool | str,
        out: Path,
        config_toml: str,
        experiment: str = "shuffledp",
        warn: Callable[[str], None] | None = None,
        tags: Mapping[str, Callable[[pb.RoundMetrics], float]] | None = None,
    ) -> None:
        self.out = Path(out)
        # each round's scalars, by TensorBoard's tag (tracking.TAGS: the two trackers log the same figures)
        self._tags = dict(tags or {})
        self.uri, self._artifacts = store_uri(target, self.out)
        self.run_id: str | None = None  # MLflow's
        self._warn = warn or (lambda line: print(line, file=sys.stderr))
        self._client: Any = None
        self._failed = False
        self._steps: set[int] = set()
        self._params: set[str] = set()
        self._tagged = False
        # MLflow's import and a new SQLite store's migrations take seconds: they run while the services start; the
        # first status waits for them
        self._starting = threading.Thread(
            target=self._guard, args=("start", self._start, config_toml, experiment, target), daemon=True
        )
        self._starting.start()

    # ------------------------------------------------------------------ the run's life
    def update(self, status: pb.RunStatus, new: Sequence[pb.RoundMetrics], seen: int) -> None:
        """drive_run's on_status: the rounds that are new."""
        self._starting.join()
        self._guard("a round", self._update, status, new)

    def finish(self, result: pb.RunResult) -> None:
        """The rounds not seen yet (a fetched or interrupted run), the plan, the final figures and the results
        directory's files; the MLflow run ends."""
        self._starting.join()
        self._guard("the end", self._finish, result)
        atexit.unregister(self._abandoned)

    def _start(self, config_toml: str, experiment: str, target: bool | str) -> None:
        _environment(target)
        with _quiet():  # its warnings
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        with _quiet():  # after the import, which sets MLflow's loggers up
            if target is True:
                (self.out / STORE_DIR).mkdir(parents=True, exist_ok=True)
            client = MlflowClient(tracking_uri=self.uri)
            found = client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:
                try:
                    experiment_id = client.create_experiment(experiment, artifact_location=self._artifacts)
                except MlflowException:  # created meanwhile by another run on the same store
                    again = client.get_experiment_by_name(experiment)
                    if again is None:
                        raise
                    experiment_id = again.experiment_id
            params = config_params(config_toml)
            tags = {"shuffledp.results": str(self.out.resolve())}
            if "privacy.protocol" in params:
                tags["shuffledp.protocol"] = params["privacy.protocol"]
            run = client.create_run(experiment_id, run_name=self.out.resolve().name, tags=tags)
            self._client, self.run_id = client, run.info.run_id
            atexit.register(self._abandoned)
            self._log_params(params)

    def _update(self, status: pb.RunStatus, new: Sequence[pb.RoundMetrics]) -> None:
        if not self._tagged and status.run_id:
            self._tagged = True
            with _quiet():
                self._client.set_tag(self.run_id, "shuffledp.run_id", status.run_id)
        self._log_rounds(new)

    def _finish(self, result: pb.RunResult) -> None:
        from mlflow.entities import Metric

        status = result.status
        self._update(status, status.metrics)  # what was not seen while the run went (fetched, interrupted)
        summary = json.loads((self.out / "summary.json").read_text()) if (self.out / "summary.json").is_file() else {}
        model, spend = summary.get("released_model") or {}, summary.get("spend") or {}
        # the analyzer's plan (the planned eps and delta, the protocol's sizing, ...) and how the spend is accounted
        plan = _flat(summary.get("plan") or {}, "plan.")
        self._log_params(
            {**plan, **{f"spend.{k}": _text(spend[k]) for k in ("accountant", "trust_model") if k in spend}}
        )
        final = {
            "final/accuracy": model.get("accuracy"),
            "final/loss": model.get("loss"),
            "final/excess_risk": model.get("excess_risk"),
            "final/eps_spent": spend.get("eps", status.budget.eps_spent),
            "final/delta_spent": spend.get("delta", status.budget.delta_spent),
            "final/eps_limit": spend.get("eps_limit"),
            "final/delta_limit": spend.get("delta_limit"),
            "final/eps_robust": spend.get("eps_robust"),
        }
        step, now = max(self._steps, default=0), _now_ms()
        metrics = [
            Metric(k, float(v), now, step)
            for k, v in final.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        ]
        with _quiet():
            self._client.log_batch(self.run_id, metrics=metrics)
            self._client.set_tag(self.run_id, "shuffledp.state", pb.RunState.Name(status.state))
            for path in sorted(self.out.iterdir()):
                # the results, not logs/, state/, this store nor the services' port files
                if path.is_file() and path.suffix != ".port" and not path.name.startswith("."):
                    self._client.log_artifact(self.run_id, str(path))
            self._client.set_terminated(self.run_id, _END_STATUS.get(status.state, "FAILED"))

    def _abandoned(self) -> None:
        """At exit without finish (the CLI gave up: a lost analyzer, a service that failed): the run FAILED."""
        self._starting.join(timeout=30)
        self._guard("exit", lambda: self._client.set_terminated(self.run_id, "FAILED"))

    # ------------------------------------------------------------------ logging
    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # a param is written once (MLflow refuses another value): the first source wins
        todo = [Param(k, v) for k, v in params.items() if k not in self._params]
        with _quiet():
            for chunk in _chunks(todo, _MAX_PARAMS):
                self._client.log_batch(self.run_id, params=chunk)
        self._params.update(p.key for p in todo)

    def _log_rounds(self, rounds: Sequence[pb.RoundMetrics]) -> None:
        from mlflow.entities import Metric

        metrics, now = [], _now_ms()
        for m in rounds:
            step = m.round + 1  # metrics.json's numbering: 0 is the initial model
            if step in self._steps:
                continue
            self._steps.add(step)
            values = {tag.rsplit("/", 1)[-1]: float(get(m)) for tag, get in self._tags.items()}
            for name in ("excess_risk", "eps_spent_local"):
                if m.HasField(name):
                    values[name] = float(getattr(m, name))
            values.update({f"refused_by_reason/{r}": float(n) for r, n in sorted(m.refused_reasons.items())})
            metrics += [Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v)]
        with _quiet():
            for chunk in _chunks(metrics, _MAX_METRICS):
                self._client.log_batch(self.run_id, metrics=chunk)

    def _guard(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        if self._failed or (self._client is None and what != "start"):
            return
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - MLflow, its store or the network: whatever it raises, the run goes on
            self._failed = True
            words = (str(exc).strip().splitlines() or [""])[0][:300]
            self._warn(
                f"MLflow tracking failed ({what}, {self.uri}): {type(exc).__name__}: {words}; nothing more is logged "
                f"to MLflow, the run's results are in {self.out} all the same"
            )
            if self.run_id is not None and what != "exit":  # the MLflow run ends as FAILED if the store still can
                atexit.unregister(self._abandoned)
                try:
                    with _quiet():
                        self._client.set_terminated(self.run_id, "FAILED")
                except Exception:  # noqa: BLE001 - said already; the store may be gone
                    pass


def _now_ms() -> int:
    return int(time.time() * 1000)


_WARNINGS_OFF: list[bool] = []


class _quiet:
    """MLflow's INFO lines (a new SQLite store's migrations) and the warnings of MLflow and its store's libraries
    (filtered by module, for good: warnings.catch_warnings is not for threads) stay out of the run's output."""

    def __enter__(self) -> None:
        if not _WARNINGS_OFF:
            _WARNINGS_OFF.append(True)
            warnings.filterwarnings("ignore", module=r"(mlflow|sqlalchemy|alembic|pydantic)(\.|$)")
        self._levels = {}
        for name in ("mlflow", "alembic"):
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(logging.WARNING)

    def __exit__(self, *exc: object) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
