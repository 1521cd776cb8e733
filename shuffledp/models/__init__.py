"""Models: what a party trains and evaluates, as a plug-in over flat float64 parameter vectors.

- `builtin`: the built-in convex tasks (logistic regression, least squares, hinge, absolute, distance) and the
  one-hidden-layer mlp, with clipping and the l2-ball projection (spec 000 section 0).
- `plugin`: the `ModelPlugin` interface's registry: only entry points in the group `shuffledp.models` (or the party's
  own `SHUFFLEDP_MODEL_PLUGINS`) are ever imported.
- `flax_adapter`: your own Flax module as a plug-in (the `jax` extra; imported only where a config names one).
- `examples`: the Flax CNN and MLP the examples/ configs use.

May import: the foundation (`shuffledp.settings`, `shuffledp.lazy`) and numpy. Never a party, the wire or the
accountants: a model knows nothing of privacy, and both kinds of party use it.
"""

from shuffledp.models.builtin import (
    ALL_TASKS,
    CLASSIFIERS,
    DEFAULT_HIDDEN,
    MLP_INIT_SEED,
    NONCONVEX_TASKS,
    NONSMOOTH_TASKS,
    SMOOTH_TASKS,
    TASKS,
    Model,
    ModelPlugin,
    builtin,
    clip_l2,
    make_model,
    model_digest,
    model_factory,
    project_l2_ball,
)

__all__ = [
    "ALL_TASKS",
    "CLASSIFIERS",
    "DEFAULT_HIDDEN",
    "MLP_INIT_SEED",
    "NONCONVEX_TASKS",
    "NONSMOOTH_TASKS",
    "SMOOTH_TASKS",
    "TASKS",
    "Model",
    "ModelPlugin",
    "builtin",
    "clip_l2",
    "make_model",
    "model_digest",
    "model_factory",
    "project_l2_ball",
]
