"""shuffledp's Python API: run experiments and sweeps from Python or a notebook, on the same machinery as the
`shuffledp run` and `shuffledp sweep` commands (shuffledp.cli.run's RunSession: the same checks, processes, progress
lines, results directory and Ctrl-C behaviour).

The main names are re-exported here, so that `from shuffledp.api import run, start, sweep, Result` is all a
notebook needs; the package top (`import shuffledp`) stays import-free of the services and the accountants (the
command's start-up time), so the API lives in this subpackage rather than at the top.

- `run(config, settings, **options) -> Result`: a whole run (shuffledp.api.experiment)
- `start(...) -> Experiment`: a started run to iterate over (RoundResult per round), then `.result()`
- `load_result(DIR) -> Result`: any results directory (shuffledp.api.result)
- `sweep(config, grid, seeds=...) -> SweepResult`: a grid of runs, one table and one plot (shuffledp.api.sweep)

Floor: the top one, beside shuffledp.cli (shuffledp/__init__.py's layer order). May import: anything; it drives runs
with shuffledp.cli.run's engine, and only `shuffledp sweep` (shuffledp.cli.sweep, this package's sweep behind a command
line) imports it.
"""

from shuffledp.api.experiment import Experiment, RunInterrupted, RunRefused, run, start
from shuffledp.api.result import ReleasedModel, Result, RoundResult, Spend, load_result
from shuffledp.api.sweep import SweepResult, sweep

__all__ = [
    "Experiment",
    "ReleasedModel",
    "Result",
    "RoundResult",
    "RunInterrupted",
    "RunRefused",
    "Spend",
    "SweepResult",
    "load_result",
    "run",
    "start",
    "sweep",
]
