"""Sweeps: a grid of runs (settings x variants x repetitions), one table and one plot (`shuffledp sweep`).

    from shuffledp.api import sweep
    s = sweep("base.toml", {"privacy.eps": [1, 4, 8], "privacy.protocol": ["pvec", "gaussian"]}, seeds=3,
              out="results/my-sweep")
    s.table      # one row per run: its settings, repetition, seed, accuracy, loss, excess risk, eps spent, seconds
    s.summary    # mean and std over the repetitions (and the best value of `best_of` keys, e.g. a learning rate)
    s.plot       # OUT/plot.png: the metric against eps, error bars over repetitions, one line per protocol/variant

The grid is the product of `grid`'s values, times `variants` when given (named groups of settings, each value a list
that expands too: methods that differ in several keys, e.g. DP-FTRL with and without momentum and their own
learning-rate grids), times the repetitions. A sweep file is a run configuration with a [sweep] table (seeds,
grid, variants, best_of, metric, x); `--set` on the command line adds to its grid. Settings are dotted keys with
shuffledp.api.settings' rules for privacy.protocol.

On disk (OUT): runs/<name>/ each run's own results directory (as `shuffledp run --out`, plus output.log, the run's
printed lines, and sweep_run.json, written when it ended: its settings, seconds, exit status, seed); runs.csv (the
table; runs.parquet too with parquet=True and pyarrow installed); summary.csv; plot.png; sweep.json (what was asked);
services/<i>/ the logs and state of each set of local services started.

Resumable: a run whose sweep_run.json exists with the same configuration is skipped (and said so); one interrupted
or failed is run again in its directory. A run directory holding another configuration stops the sweep (one line):
choose another OUT.

Services are reused, as the benchmarks do: consecutive runs whose [data], [deployment], [policy] and model
(task, module, args) agree, which is what the client nodes and the shuffler are started with, run on one set of
services, as long as it is safe: the nodes keep each user's recorded spend across runs (that is their job), so a
later run's users would refuse rounds once the earlier runs took them near their [policy] max_total_eps /
max_total_delta. A set of services therefore takes runs only while the sum of their worst-case per-user charges
(basic composition of each round's claimed per-user cost over the planned rounds, and at least the run's own
(eps, delta)) stays within the users' totals; the next run starts fresh services. With the embedded default's
policy (64 in all) that is one or two runs; a sweep configuration with generous users (e.g. max_total_eps = 1e6, as
the benchmarks and examples/sweep_*.toml) runs everything on one set. reuse_services=False starts fresh services
for every run.

Seeds: each run records its repetition and its seed. A run's seed is `seed + repetition` when a base `seed` is given:
the run gets local services of its own started with that seed (start_local_cluster(seed=): every service's
generators keyed from it, issue 46 item 3), so seeded runs never share services. Without a base seed the seed
column is empty: repetitions differ by the services' own CSPRNG draws.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import math
import os
import re
import sys
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shuffledp.api.result import load_result, require_pandas
from shuffledp.api.settings import ConfigSource, apply_settings, config_document, dumps

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SweepSpec", "SweepResult", "SweepError", "Point", "sweep", "load_sweep_file", "plan_points"]

# the sections a run's services are started with (serve client/fleet --config reads [data], [policy], [model] for the
# data's task and a plug-in, [deployment] for the nodes; the shuffler and the analyzer take the rest per run)
SERVICE_SECTIONS = ("data", "deployment", "policy")
SERVICE_MODEL_KEYS = ("task", "module", "args")
CHARGE_MARGIN = 1.05  # on the worst-case charge: the nodes round sums up, and charge the larger of claim and check
FIGURES = ("accuracy", "loss", "excess_risk", "eps_spent", "delta_spent", "seconds")


class SweepError(ValueError):
    """A sweep that cannot run as asked (one line: a bad setting, a grid point the configuration refuses, an OUT
    holding another sweep's runs)."""


@dataclass(frozen=True)
class SweepSpec:
    """What to sweep: grid (dotted key -> values, crossed), variants (name -> settings, list values crossed within
    the variant), seeds (repetitions of every point), best_of (keys summarised by their best value per line and x,
    e.g. a learning rate grid), metric (accuracy, loss or excess_risk; default accuracy where it is evaluated), x
    (the plot's abscissa, default privacy.eps)."""

    grid: dict[str, list[Any]] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    seeds: int = 1
    seed: int | None = None
    best_of: tuple[str, ...] = ()
    metric: str | None = None
    x: str = "privacy.eps"


@dataclass(frozen=True)
class Point:
    """One run of the sweep: its variant (or ""), its settings (dotted keys), its repetition and seed."""

    variant: str
    settings: dict[str, Any]
    repetition: int
    seed: int | None

    @property
    def name(self) -> str:
        """Its directory under OUT/runs: the variant and the settings, readable (a digest when too long)."""
        parts = [self.variant] if self.variant else []
        parts += [f"{k}={_short(v)}" for k, v in sorted(self.settings.items())]
        name = re.sub(r"[^A-Za-z0-9_.=+,-]", "_", ",".join(parts)) or "run"
        if len(name) > 150:
            digest = hashlib.sha256(json.dumps([self.variant, self.settings], sort_keys=True).encode()).hexdigest()
            name = f"{name[:120]}-{digest[:12]}"
        return f"{name},rep={self.repetition}"


def _short(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v).replace(" ", "")


@dataclass
class SweepResult:
    """A sweep's outcome: OUT, the table of every run (one row each), the summary (per point over repetitions), the
    plot's path, and how many runs ran now and were found finished (skipped)."""

    out: Path
    table: pd.DataFrame
    summary: pd.DataFrame
    plot: Path | None
    ran: int
    skipped: int
    failed: int

    @property
    def csv(self) -> Path:
        return self.out / "runs.csv"


def load_sweep_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], SweepSpec]:
    """A sweep file: a run configuration with a [sweep] table (seeds, seed, grid, variants, best_of, metric, x).
    (the configuration document without [sweep], the spec)."""
    doc, _, _ = config_document(path)
    table = doc.pop("sweep", {})
    return doc, spec_from_table(table, str(path))


def spec_from_table(table: Mapping[str, Any], where: str = "[sweep]") -> SweepSpec:
    allowed = {"seeds", "seed", "grid", "variants", "best_of", "metric", "x"}
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise SweepError(f"{where}: unknown key sweep.{unknown[0]}; allowed: {', '.join(sorted(allowed))}")
    grid = {k: _values(v) for k, v in (table.get("grid") or {}).items()}
    variants = {str(k): dict(v) for k, v in (table.get("variants") or {}).items()}
    best = table.get("best_of", ())
    return SweepSpec(
        grid=grid,
        variants=variants,
        seeds=int(table.get("seeds", 1)),
        seed=table.get("seed"),
        best_of=(best,) if isinstance(best, str) else tuple(best),
        metric=table.get("metric"),
        x=str(table.get("x", "privacy.eps")),
    )


def _values(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list | tuple) else [v]


def plan_points(spec: SweepSpec) -> list[Point]:
    """Every run of the sweep, in order: variants, then the grid (first key slowest), then the repetitions."""
    if spec.seeds < 1:
        raise SweepError(f"seeds must be >= 1, got {spec.seeds}")
    variants = spec.variants or {"": {}}
    points = []
    for variant, settings in variants.items():
        both = sorted(set(settings) & set(spec.grid))
        if both:
            raise SweepError(f"variant {variant!r} sets {both[0]}, which the grid sweeps too: set it in one place")
        own = {k: _values(v) for k, v in settings.items()}
        keys = list(spec.grid) + list(own)
        for combo in itertools.product(*(spec.grid[k] for k in spec.grid), *(own[k] for k in own)):
            point = dict(zip(keys, combo, strict=True))
            for rep in range(spec.seeds):
                seed = None if spec.seed is None else int(spec.seed) + rep
                points.append(Point(variant, point, rep, seed))
    return points


def _services_key(doc: Mapping[str, Any]) -> str:
    model = doc.get("model") or {}
    part = {s: doc.get(s) or {} for s in SERVICE_SECTIONS}
    part["model"] = {k: model[k] for k in SERVICE_MODEL_KEYS if k in model}
    return json.dumps(part, sort_keys=True, default=str)


def _worst_charge(config: Any, plan: dict[str, Any]) -> tuple[float, float]:
    """An upper bound on what one run can add to a user's recorded (eps, delta): basic composition of the first
    round's claimed per-user cost over the planned rounds (the nodes' own first bound), at least the run's (eps,
    delta), with a margin."""
    from shuffledp.protocols.registry import round_protocol
    from shuffledp.services.run_manager import round_event

    protocol = round_protocol(plan["protocol"])
    cost = protocol.spec_fields(plan, protocol.params(plan), round_event(protocol, plan, 0), b"")["per_user_cost"]
    rounds = int(plan.get("rounds") or 1)
    eps = max(float(plan["eps"]), rounds * float(cost.eps))
    delta = max(float(plan["delta"]), rounds * float(cost.delta))
    return CHARGE_MARGIN * eps, CHARGE_MARGIN * delta


@dataclass
class _Services:
    """One set of local services of the sweep and what its users may still have been charged."""

    key: str
    cluster: Any
    analyzer: str
    eps: float = 0.0
    delta: float = 0.0
    index: int = 0


def sweep(
    config: ConfigSource = None,
    grid: Mapping[str, Sequence[Any] | Any] | None = None,
    *,
    seeds: int | None = None,
    out: str | os.PathLike[str] | None = None,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    best_of: Sequence[str] | str | None = None,
    metric: str | None = None,
    x: str | None = None,
    seed: int | None = None,
    reuse_services: bool = True,
    parquet: bool = False,
    echo: Callable[[str], object] = print,
    on_run: Callable[[dict[str, Any]], object] | None = None,
) -> SweepResult:
    """Run a sweep (module docstring) and return its table, summary and plot.

    config: a run configuration (file, dict, None: the embedded default) or a sweep file (a [sweep] table in it gives
    the spec; the arguments given here win: grid keys are added to its grid, seeds/best_of/metric/x replace its).
    grid: dotted key -> values. seeds: repetitions (default 1). out: the sweep's directory (default
    results/sweep-<label>-<time>; give the same one again to resume). on_run sees each run's table row as it ends.
    SweepError (one line) when a grid point is refused before anything runs."""
    doc, spec, label = _inputs(config, grid, seeds, variants, best_of, metric, x, seed)
    points = plan_points(spec)
    out = Path(out) if out is not None else Path("results") / f"sweep-{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    texts = {p.name: dumps(apply_settings(doc, {**p.settings, **_seed_settings(p)})) for p in points}
    if len(set(texts)) != len(points):
        raise SweepError("two grid points have the same name: give distinct values")
    _record(out, doc, spec, points)
    runs_dir = out / "runs"
    done, todo = [], []
    for p in points:
        state = _finished(runs_dir / p.name, texts[p.name])
        (done if state else todo).append(p)
    echo(
        f"sweep: {len(points)} runs in {out}"
        + (f"; {len(done)} finished already (skipped), {len(todo)} to run" if done else "")
    )
    checks = _check_all(todo, texts)  # every mistake before anything starts
    ran = failed = 0
    # the progress line names what varies: the grid's keys and each variant's swept ones (its name says the rest)
    varying = set(spec.grid) | {k for v in spec.variants.values() for k, val in v.items() if isinstance(val, list)}
    services: _Services | None = None
    started_sets = len(list((out / "services").glob("*"))) if (out / "services").exists() else 0
    try:
        for i, p in enumerate(todo):
            text = texts[p.name]
            cfg, plan = checks[text]
            key = _services_key(tomllib.loads(text))
            charge = _worst_charge(cfg, plan)
            # a seeded run keys its services' generators (serve --simulation-seed): services of its own
            reuse = reuse_services and p.seed is None
            if services is not None and not _fits(services, key, charge, cfg, reuse):
                services.cluster.stop()
                services = None
            if services is None:
                services = _start_services(out, text, cfg, started_sets, p.seed)
                started_sets += 1
            services.eps += charge[0]
            services.delta += charge[1]
            row = _run_point(p, text, runs_dir / p.name, services, i + 1 + len(done), len(points), echo, varying)
            ran += 1
            failed += row["state"] != "COMPLETED"
            if on_run is not None:
                on_run(row)
    finally:
        if services is not None:
            services.cluster.stop()
    return _collect(out, points, spec, ran, len(done), failed, parquet, echo)


def _inputs(config, grid, seeds, variants, best_of, metric, x, seed) -> tuple[dict[str, Any], SweepSpec, str]:
    doc, _, label = config_document(config)
    table = doc.pop("sweep", {}) if isinstance(doc.get("sweep"), dict) else {}
    base = spec_from_table(table, f"{config}")
    merged = dict(base.grid)
    for k, v in (grid or {}).items():
        merged[k] = _values(v)
    spec = SweepSpec(
        grid=merged,
        variants={k: dict(v) for k, v in (variants or base.variants).items()},
        seeds=seeds if seeds is not None else base.seeds,
        seed=seed if seed is not None else base.seed,
        best_of=((best_of,) if isinstance(best_of, str) else tuple(best_of)) if best_of is not None else base.best_of,
        metric=metric or base.metric,
        x=x or base.x,
    )
    if not spec.grid and not spec.variants:
        raise SweepError("nothing to sweep: give a grid (--set KEY=V1,V2,...) or variants")
    return doc, spec, label


def _seed_settings(p: Point) -> dict[str, Any]:
    """What a run's seed changes in its configuration: nothing yet, the seed is a run option (see _run_point)."""
    return {}


def _record(out: Path, doc: dict[str, Any], spec: SweepSpec, points: list[Point]) -> None:
    manifest = {
        "command": sys.argv,
        "base": doc,
        "spec": {
            "grid": spec.grid,
            "variants": spec.variants,
            "seeds": spec.seeds,
            "seed": spec.seed,
            "best_of": list(spec.best_of),
            "metric": spec.metric,
            "x": spec.x,
        },
        "runs": [p.name for p in points],
    }
    (out / "sweep.json").write_text(json.dumps(manifest, indent=2, default=str))


def _finished(run_dir: Path, text: str) -> bool:
    """Whether the run in run_dir ended (sweep_run.json) with this configuration; SweepError when the directory
    holds another configuration's run."""
    config = run_dir / "config.toml"
    if not config.exists():
        return False
    if config.read_text() != text:
        raise SweepError(
            f"{run_dir} holds a run of another configuration (the base or the grid changed): give the sweep a new "
            "--out, or remove that directory"
        )
    return (run_dir / "sweep_run.json").exists()


def _check_all(points: list[Point], texts: dict[str, str]) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each distinct configuration parsed and planned as `shuffledp run` checks it (check_before_start)."""
    from shuffledp.cli.run import check_before_start
    from shuffledp.config import ConfigError, parse_config

    checked: dict[str, tuple[Any, dict[str, Any]]] = {}
    for p in points:
        text = texts[p.name]
        if text in checked:
            continue
        where = f"{p.variant + ': ' if p.variant else ''}{', '.join(f'{k}={v}' for k, v in p.settings.items())}"
        try:
            cfg = parse_config(text)
            if not cfg.deployment.insecure:
                raise ConfigError("a sweep runs local services in insecure mode (deployment.insecure = true)")
            checked[text] = (cfg, check_before_start(cfg))
        except ConfigError as exc:
            raise SweepError(f"{where}: {exc}") from None
    return checked


def _fits(services: _Services, key: str, charge: tuple[float, float], cfg: Any, reuse: bool) -> bool:
    if not reuse or services.key != key:
        return False
    pol = cfg.policy
    return services.eps + charge[0] <= pol.max_total_eps and services.delta + charge[1] <= pol.max_total_delta


def _start_services(out: Path, text: str, cfg: Any, index: int, seed: int | None = None) -> _Services:
    from shuffledp.cli.run import FLEET_PROCESSES, start_local_cluster

    work = out / "services" / str(index)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.toml").write_text(text)  # the nodes read its [data], [policy], [model] and [deployment]
    nodes = cfg.deployment.client_nodes
    fleets = min(FLEET_PROCESSES, nodes) if cfg.deployment.users_per_node == 1 else 0
    seeded = {} if seed is None else {"seed": seed}
    try:
        cluster, _, analyzer = start_local_cluster(
            work / "config.toml", work, nodes, wait_nodes=False, fleets=fleets, **seeded
        )
    except TypeError as exc:
        if "seed" not in str(exc):
            raise
        raise SweepError("seeded runs need seeded local services (issue 46 item 3), not in this version") from None
    return _Services(_services_key(tomllib.loads(text)), cluster, analyzer, index=index)


def _run_point(
    p: Point,
    text: str,
    run_dir: Path,
    services: _Services,
    number: int,
    total: int,
    echo: Callable[[str], object],
    varying: set[str] | None = None,
) -> dict[str, Any]:
    """One run on the sweep's services, its printed lines in run_dir/output.log; its table row."""
    from shuffledp.api.experiment import RunInterrupted, start

    what = ", ".join(f"{k}={_short(v)}" for k, v in p.settings.items() if varying is None or k in varying)
    echo(f"[{number}/{total}] {p.variant + ': ' if p.variant else ''}{what}, rep {p.repetition} ...")
    run_dir.mkdir(parents=True, exist_ok=True)
    log = io.StringIO()
    t0 = time.monotonic()
    status, error = None, ""
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            exp = start(
                config_toml=text,
                out=run_dir,
                reuse_out=True,
                services=(services.cluster, services.analyzer),
                checked=True,
                label=p.name,
            )
            status = exp.result().exit_status
    except RunInterrupted:
        (run_dir / "output.log").write_text(log.getvalue())
        raise KeyboardInterrupt from None
    except SweepError:
        raise
    except Exception as exc:  # noqa: BLE001 - one failed run is a row of the table, not the end of the sweep
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        (run_dir / "output.log").write_text(log.getvalue())
    seconds = time.monotonic() - t0
    record = {
        "variant": p.variant,
        "settings": p.settings,
        "repetition": p.repetition,
        "seed": p.seed,
        "seconds": seconds,
        "exit_status": status,
        "error": error,
        "services": services.index,
    }
    (run_dir / "sweep_run.json").write_text(json.dumps(record, indent=2, default=str))
    row = _row(p, run_dir)
    acc = row.get("accuracy")
    shown = f"accuracy {acc:.4f}" if isinstance(acc, float) and math.isfinite(acc) else f"loss {row.get('loss')}"
    echo(
        f"    {row['state']}: {shown}, eps spent {row['eps_spent']:.4f}, {seconds:.1f} s"
        + (f"; {error}" if error else "")
    )
    return row


def _row(p: Point, run_dir: Path) -> dict[str, Any]:
    record = json.loads((run_dir / "sweep_run.json").read_text())
    row: dict[str, Any] = {"run": p.name, "variant": p.variant, **p.settings}
    row.update(repetition=p.repetition, seed=record.get("seed"))
    try:
        result = load_result(run_dir)
        spend = result.spend
        row.update(
            state=result.state,
            accuracy=_nan(result.accuracy),
            loss=_nan(result.loss),
            excess_risk=_nan(result.excess_risk),
            eps_spent=spend.eps,
            delta_spent=spend.delta,
            rounds=len(result.rows),
        )
    except (OSError, ValueError):
        row.update(state="FAILED", accuracy=math.nan, loss=math.nan, excess_risk=math.nan)
        row.update(eps_spent=math.nan, delta_spent=math.nan, rounds=0)
    row.update(seconds=record["seconds"], exit_status=record.get("exit_status"), error=record.get("error", ""))
    return row


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


def _collect(
    out: Path, points: list[Point], spec: SweepSpec, ran: int, skipped: int, failed: int, parquet: bool, echo
) -> SweepResult:
    pd = require_pandas()
    rows = [_row(p, out / "runs" / p.name) for p in points if (out / "runs" / p.name / "sweep_run.json").exists()]
    table = pd.DataFrame(rows)
    if "seed" in table:
        table["seed"] = table["seed"].astype("Int64")  # empty (NA) until runs take a seed
    table.to_csv(out / "runs.csv", index=False)
    if parquet:
        try:
            table.to_parquet(out / "runs.parquet", index=False)
        except ImportError as exc:
            echo(f"sweep: runs.parquet not written ({exc}); runs.csv has the table")
    metric = spec.metric or _default_metric(table)
    summary = summarize(table, spec, metric)
    summary.to_csv(out / "summary.csv", index=False)
    plot = out / "plot.png"
    try:
        plot_summary(summary, spec, metric, plot)
    except Exception as exc:  # noqa: BLE001 - the tables are written already
        echo(f"sweep: plot not written: {type(exc).__name__}: {exc}")
        plot = None
    echo(render_summary(summary, spec, metric))
    echo(
        f"sweep: {ran} run(s) now, {skipped} skipped (finished before), {failed} not completed; "
        f"table {out / 'runs.csv'}, summary {out / 'summary.csv'}" + (f", plot {plot}" if plot else "")
    )
    return SweepResult(out, table, summary, plot, ran, skipped, failed)


def _default_metric(table: pd.DataFrame) -> str:
    for metric in ("accuracy", "excess_risk", "loss"):
        if metric in table and table[metric].notna().any():
            return metric
    return "accuracy"


def _line_keys(table_or_keys: Sequence[str], spec: SweepSpec) -> list[str]:
    """The settings that tell the plot's lines apart: the variant, and every swept key but x and best_of."""
    keys = ["variant"] if spec.variants else []
    keys += [k for k in spec.grid if k != spec.x and k not in spec.best_of]
    return [k for k in keys if k in table_or_keys]


def summarize(table: pd.DataFrame, spec: SweepSpec, metric: str) -> pd.DataFrame:
    """Per line and x: the metric's mean and std over the repetitions (and the other figures' means); with best_of,
    the value of those keys whose mean metric is best (highest accuracy, lowest loss or excess risk)."""
    pd = require_pandas()
    if table.empty:
        return pd.DataFrame()
    varying = [k for k in spec.grid if k in table] + [k for v in spec.variants.values() for k in v if k in table]
    point_keys = list(dict.fromkeys((["variant"] if spec.variants else []) + varying))
    figures = [f for f in FIGURES if f in table]
    done = table.assign(completed=table["state"] == "COMPLETED")
    group = done.groupby(point_keys, dropna=False, sort=False) if point_keys else [((), done)]
    rows = []
    for key, g in group:
        key = key if isinstance(key, tuple) else (key,)
        row = dict(zip(point_keys, key, strict=True))
        row.update(runs=len(g), completed=int(g["completed"].sum()))
        for f in figures:
            row[f] = float(g[f].mean())
        row[f"{metric}_std"] = float(g[metric].std(ddof=0)) if len(g) > 1 else 0.0
        rows.append(row)
    summary = pd.DataFrame(rows)
    best = [k for k in spec.best_of if k in summary]
    if not best:
        return summary
    lines = _line_keys(list(summary.columns), spec) + ([spec.x] if spec.x in summary else [])
    lower = metric in ("loss", "excess_risk")
    picked = []
    for _, g in summary.groupby(lines, dropna=False, sort=False) if lines else [((), summary)]:
        scores = g[metric].fillna(math.inf if lower else -math.inf)
        picked.append(g.loc[scores.idxmin() if lower else scores.idxmax()])
    out = pd.DataFrame(picked).reset_index(drop=True)
    return out.rename(columns={k: f"best {k}" for k in best})


def render_summary(summary: pd.DataFrame, spec: SweepSpec, metric: str) -> str:
    """The summary as a Markdown table: x down, one column per line, cells "mean ± std (eps spent)"."""
    if summary.empty:
        return "sweep: no finished run"
    lines = _line_keys(list(summary.columns), spec)
    x = spec.x if spec.x in summary else None
    names = [_line_name(r, lines) for _, r in summary.iterrows()]
    summary = summary.assign(_line=names)
    columns = list(dict.fromkeys(names))
    xs = list(dict.fromkeys(summary[x])) if x else [None]
    best = [c for c in summary.columns if c.startswith("best ")]
    head = f"| {x or ''} | " + " | ".join(columns) + " |"
    out = [f"{metric}, mean ± std over the repetitions (eps spent)" + (f"; {', '.join(best)} chosen" if best else "")]
    out += [head, "|" + "---|" * (len(columns) + 1)]
    for xv in xs:
        cells = []
        for c in columns:
            sel = summary[(summary["_line"] == c) & ((summary[x] == xv) if x else True)]
            if sel.empty:
                cells.append("")
                continue
            r = sel.iloc[0]
            cell = f"{r[metric]:.3f} ± {r[f'{metric}_std']:.3f}"
            if "eps_spent" in r and math.isfinite(r["eps_spent"]):
                cell += f" ({r['eps_spent']:.4g})"
            cell += "".join(f" [{b.removeprefix('best ')} {_short(r[b])}]" for b in best)
            cells.append(cell)
        out.append(f"| {_short(xv) if x else ''} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _line_name(row: Any, keys: list[str]) -> str:
    parts = []
    for k in keys:
        v = row[k]
        parts.append(str(v) if k == "variant" else f"{k.rsplit('.', 1)[-1]}={_short(v)}")
    return ", ".join(parts) or "all"


def plot_summary(summary: pd.DataFrame, spec: SweepSpec, metric: str, path: Path) -> None:
    """The metric against x (log scale when x is privacy.eps), error bars = std over the repetitions, one line per
    protocol / variant / other swept setting."""
    from matplotlib.figure import Figure  # without pyplot: a notebook's backend is left as it was

    fig = Figure(figsize=(6, 4.2))
    ax = fig.subplots()
    lines = _line_keys(list(summary.columns), spec)
    x = spec.x if spec.x in summary else None
    if summary.empty or x is None:
        ax.text(0.5, 0.5, "no finished run" if summary.empty else f"{spec.x} is not swept", ha="center")
    else:
        groups = summary.groupby(lines, dropna=False, sort=False) if lines else [((), summary)]
        for key, g in groups:
            key = key if isinstance(key, tuple) else (key,)
            g = g.sort_values(x)
            label = _line_name(dict(zip(lines, key, strict=True)), lines)
            ax.errorbar(g[x], g[metric], yerr=g[f"{metric}_std"], marker="o", capsize=3, label=label)
        if x == "privacy.eps":
            ax.set_xscale("log", base=2)
            ticks = sorted(summary[x].unique())
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel(x)
        ax.legend(fontsize=8)
    best = f"; best of {', '.join(spec.best_of)}" if spec.best_of else ""
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(f"mean ± std over {spec.seeds} repetition(s){best}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
