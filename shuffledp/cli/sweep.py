"""`shuffledp sweep CONFIG --set KEY=V1,V2,... [--set ...] --seeds N`: a grid of local runs, one table and one plot.

CONFIG is a run configuration, or a sweep file (a run configuration with a [sweep] table: seeds, seed, grid,
variants, best_of, metric, x; examples/sweep_*.toml), or nothing (the embedded default). Every combination of the
--set values (and of the file's grid and variants) runs --seeds times, each run in its own results directory under
OUT/runs; OUT/runs.csv holds every run (its settings, repetition, seed, accuracy, loss, excess risk, eps spent,
seconds), OUT/summary.csv the mean and std over the repetitions, OUT/plot.png the metric against eps with error bars,
one line per protocol or variant. Run the same command again to resume: finished runs are skipped. The engine and
its rules (reused services, privacy.protocol settings) are shuffledp.api.sweep's.

Exit status: 0 every run completed, 1 some run did not, 2 bad usage or a grid point the configuration refuses
(before anything runs), 130 Ctrl-C (the finished runs stay; the next invocation resumes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sweep", help="run a grid of experiments (eps x protocols x seeds): one table, one plot, resumable"
    )
    parser.add_argument(
        "config", nargs="?", type=Path, help="run configuration or sweep file (default: the embedded default run)"
    )
    parser.add_argument(
        "--set",
        dest="grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="sweep a setting (a dotted key of the configuration, e.g. privacy.eps=0.5,1,2,4,8 or "
        "privacy.protocol=pvec,gaussian); repeat for a product",
    )
    parser.add_argument("--seeds", type=int, help="repetitions of every point (default: the file's, else 1)")
    parser.add_argument(
        "--seed",
        type=int,
        help="base seed: repetition r runs with seed BASE + r (needs `shuffledp run --seed`); default: none recorded",
    )
    parser.add_argument("--out", type=Path, help="the sweep's directory (default results/sweep-<name>-<time>)")
    parser.add_argument(
        "--best-of",
        action="append",
        metavar="KEY",
        help="summarise KEY by its best value per line and eps (e.g. schedule.learning_rate: best of grid)",
    )
    parser.add_argument("--metric", choices=["accuracy", "loss", "excess_risk"], help="the summary's and plot's")
    parser.add_argument("--x", metavar="KEY", help="the plot's abscissa (default privacy.eps)")
    parser.add_argument(
        "--fresh-services",
        action="store_true",
        help="start fresh local services for every run (default: reuse them where the users' policy allows)",
    )
    parser.add_argument("--parquet", action="store_true", help="also write runs.parquet (needs pyarrow)")
    parser.set_defaults(func=_sweep_command)


def parse_set(items: list[str]) -> dict[str, list]:
    """--set KEY=V1,V2,... -> {KEY: [V1, V2, ...]}, each value as TOML reads it (else a string); ValueError."""
    from shuffledp.api.settings import parse_value

    grid: dict[str, list] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--set takes KEY=V1,V2,... (e.g. privacy.eps=1,4,8), got {item!r}")
        grid[key] = [parse_value(v.strip()) for v in _split_values(values)]
    return grid


def _split_values(text: str) -> list[str]:
    """Split on the commas outside brackets ([1, 2] is one value)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _sweep_command(args: argparse.Namespace) -> int:
    from shuffledp.api.sweep import SweepError, sweep
    from shuffledp.config import ConfigError

    try:
        grid = parse_set(args.grid)
    except ValueError as exc:
        print(f"shuffledp sweep: {exc}", file=sys.stderr)
        return 2
    try:
        result = sweep(
            args.config,
            grid,
            seeds=args.seeds,
            seed=args.seed,
            out=args.out,
            best_of=args.best_of,
            metric=args.metric,
            x=args.x,
            reuse_services=not args.fresh_services,
            parquet=args.parquet,
        )
    except (SweepError, ConfigError) as exc:
        print(f"shuffledp sweep: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "shuffledp sweep: interrupted (Ctrl-C); the finished runs stay: run the same command to resume",
            file=sys.stderr,
        )
        return 130
    return 0 if result.failed == 0 else 1
