"""Planning: a run's plan computed once, in one place (issue 47 item 3), and the RoundSpec each planned round sends.

- `planner`: `plan_run` (config + population sizes -> the JSON-able plan the ledger stores), `planned_optimizer`
  (the optimizer a stored plan names) and the optimizer part of a plan (`cohort_size`, `hyperparameters`), built on
  the optimizers' theory (pure functions in shuffledp/optimizers) and the protocols' own plan().
- `specs`: `round_spec`, the RoundSpec of round r of a planned run.

May import: config, data, models, optimizers, protocols and everything below them. Never a party: the analyzer's
run manager calls it, and so does `shuffledp run` to refuse a run that cannot plan before anything starts.
"""

from shuffledp.planning.planner import PlanError, cohort_size, hyperparameters, plan_run, planned_optimizer
from shuffledp.planning.specs import round_spec

__all__ = ["PlanError", "plan_run", "planned_optimizer", "cohort_size", "hyperparameters", "round_spec"]
