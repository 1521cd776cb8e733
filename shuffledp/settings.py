"""Typed configuration tables: declared once as frozen dataclasses, read strictly, printed with their comments.

A table is a frozen dataclass whose fields are declared with ``setting(default, doc, ...)``: the type comes from the
annotation (float, int, bool, str, or one of them "| None" for a key that may stay unset), the range or the choices
from the metadata. ``read_table`` validates a TOML table against it (one-line ConfigError naming the key: an unknown
key, a wrong type, a value out of range) and ``render_table`` writes it back as TOML with each key's comment, which is
what ``shuffledp run --print-default`` shows. Each protocol plug-in declares its own table this way
(``[privacy.<protocol>]``, shuffledp/protocols/base.py); shuffledp/config.py reads the common sections.

Why not pydantic: these tables need ints, floats, bools and short strings with ranges, and a message that names the
TOML key in one line; this module does that in ~150 lines with no import cost in every service's start-up.
"""

from __future__ import annotations

import math
import textwrap
import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache
from typing import Any

__all__ = [
    "ConfigError",
    "setting",
    "read_table",
    "render_table",
    "table_keys",
    "toml_value",
    "number",
    "integer",
    "choice",
    "string",
    "boolean",
    "NoSettings",
    "DataConfig",
    "ModelConfig",
    "PrivacyConfig",
    "ScheduleConfig",
    "TransportConfig",
    "DeploymentConfig",
    "PolicyConfig",
    "TrackingConfig",
    "RunConfig",
]


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range; the message names the key.
    `key`: the key whose own value is wrong (None: a combination of keys, or not a key); `errors`: each message of a
    configuration with several mistakes (shuffledp.config.parse_config reports all at once), listed by str()."""

    def __init__(self, message: str = "", key: str | None = None, errors: list[str] | None = None):
        self.key = key
        self.errors = errors or [message]
        if len(self.errors) > 1:
            message = f"{len(self.errors)} errors:\n" + "\n".join(f"  {e}" for e in self.errors)
        super().__init__(message)


def setting(
    default: Any,
    doc: str,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    choices: tuple[str, ...] = (),
    example: Any = None,
    read: Callable[[str, Any], Any] | None = None,
) -> Any:
    """A field of a table. ``doc`` is the key's comment in --print-default; ``example`` the value printed (commented
    out) for a key whose default is None (unset); ``read(key, value)`` replaces the typed reader for a key whose
    value is not one plain type (a list, a number or a word)."""
    meta = {"doc": doc, "lo": lo, "hi": hi, "lo_open": lo_open, "hi_open": hi_open, "choices": choices}
    meta.update(example=example, read=read)
    return field(default=default, metadata=meta)


def number(
    key: str, v: object, lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False
) -> float:
    """A finite number in the range (a bound None = unbounded); ConfigError naming the key otherwise."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ConfigError(f"{key} must be a number, got {v!r}", key)
    x = float(v)
    if not math.isfinite(x):
        raise ConfigError(f"{key} must be finite, got {v!r}", key)
    bad_lo = lo is not None and (x <= lo if lo_open else x < lo)
    bad_hi = hi is not None and (x >= hi if hi_open else x > hi)
    if bad_lo or bad_hi:
        lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ConfigError(f"{key} must lie in {lb}{lo}, {hi}{rb}, got {x}", key)
    return x


def integer(key: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key} must be an integer, got {v!r}", key)
    if not lo <= v <= hi:
        raise ConfigError(f"{key} must lie in [{lo}, {hi}], got {v}", key)
    return v


def choice(key: str, v: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(repr(a) for a in allowed)}, got {v!r}", key)
    return v


def string(key: str, v: object) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key} must be a string, got {v!r}", key)
    return v


def boolean(key: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}", key)
    return v


@cache
def _declared(cls: type) -> tuple[tuple[Field, type], ...]:
    """(field, its plain type) of each declared key, in declaration order; "X | None" counts as X."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        if "doc" not in f.metadata:
            continue
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        out.append((f, args[0] if args else hints[f.name]))
    return tuple(out)


def table_keys(cls: type) -> tuple[str, ...]:
    """The keys a table declares."""
    return tuple(f.name for f, _ in _declared(cls))


def _read(key: str, v: object, kind: type, meta: dict[str, Any]) -> Any:
    if meta["read"] is not None:
        return meta["read"](key, v)
    if kind is bool:
        return boolean(key, v)
    if kind is int:
        return integer(key, v, meta["lo"], meta["hi"])
    if kind is float:
        return number(key, v, meta["lo"], meta["hi"], meta["lo_open"], meta["hi_open"])
    if kind is str:
        return choice(key, v, meta["choices"]) if meta["choices"] else string(key, v)
    raise TypeError(f"{key}: a table field of type {kind} needs read=")  # a declaration error, not the user's


def read_table(cls: type, table: object, where: str) -> Any:
    """``cls`` from a TOML table at ``where`` ("privacy.tree"): every key declared, typed and in range."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table ([{where}]), got {table!r}")
    declared = {f.name: (f, kind) for f, kind in _declared(cls)}
    for key in table:
        if key not in declared:
            allowed = ", ".join(sorted(declared)) or "none"
            raise ConfigError(f"unknown key {where}.{key}; allowed: {allowed}", f"{where}.{key}")
    values = {k: _read(f"{where}.{k}", v, declared[k][1], dict(declared[k][0].metadata)) for k, v in table.items()}
    return cls(**values)


def toml_value(v: Any) -> str:
    """A value as TOML text."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def render_table(cls: type, where: str, width: int = 118) -> str:
    """The table as TOML text with each key's comment: a key whose default is None is printed commented out with its
    example value (an unset key; its comment says what unset means)."""
    lines = [f"[{where}]"]
    for f, _ in _declared(cls):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        if default is None:
            head = f"# {f.name} = {toml_value(f.metadata['example'])}"
        else:
            head = f"{f.name} = {toml_value(default)}"
        head = head.ljust(28) if len(head) < 28 else head + "  "
        wrapped = textwrap.wrap(f.metadata["doc"], max(40, width - len(head) - 2)) or [""]
        lines.append(f"{head}# {wrapped[0]}")
        lines.extend(" " * 28 + f"# {rest}" for rest in wrapped[1:])
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class NoSettings:
    """The table of a protocol that has no keys of its own."""


# ---------------------------------------------------------------------- the run configuration's sections
@dataclass(frozen=True)
class DataConfig:
    dataset: str = "digits"
    path: str = ""  # data file (dataset = "path"); for idx the images file
    labels_path: str = ""  # idx only: the labels file
    format: str = ""  # csv | npz | libsvm | idx; "" = from the file extension
    test_fraction: float = 0.25
    examples_per_user: int = 1
    classes: tuple[int, ...] = ()  # keep only these labels (relabelled 0..k-1); () = all
    max_users: int = 0  # 0 = every training user; else the first max_users users
    # dataset = "synthetic" only (the parser fills unset ones from _SYNTHETIC_DEFAULTS; 0 / None = unset)
    n: int = 0  # training examples
    dim: int = 0  # features
    noise: float | None = None  # label noise scale
    seed: int = 0  # generator seed (public data)


@dataclass(frozen=True)
class ModelConfig:
    task: str = "logreg"
    radius: float = 4.0  # radius of the l2 ball Theta (diameter D = 2 radius)
    l2: float = 0.0  # lambda: adds lambda/2 ||theta||^2 (strongly convex task, spec 000 Thm 4.8)
    # beta of the Moreau envelope (spec 000 Def 4.5), non-smooth tasks only; 0 = off; "paper" = Thm 4.7's beta
    # (AC-SA) or Thm 4.9's (PGD), resolved by the analyzer when it plans
    smoothing: float | str = 0.0
    smoothness: float = 0.0  # beta of the loss for AC-SA's step rule; 0 = from the data's public bound on ||x||
    hidden: int = 32  # mlp: hidden units (tanh); ignored by the other tasks
    # a model plug-in (shuffledp/models/plugin.py): "package.module:factory" installed on every party; "" = task.
    # Its keyword arguments are the table [model.args] (TOML values), kept as sorted (key, value) pairs
    module: str = ""
    args: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class PrivacyConfig:
    """[privacy]: the keys every protocol reads; the chosen protocol's own keys are its table [privacy.<protocol>]
    (``settings``, declared by its plug-in: shuffledp/protocols/*_round.py)."""

    eps: float = 8.0
    # None = min(1/n, policy.max_delta_per_round, policy.max_total_delta), n = admitted users at StartRun: the
    # default users then accept every round (shuffledp/planning/planner.plan_run)
    delta: float | None = None
    protocol: str = "pvec"
    clip_norm: float = 1.0
    min_contributors_fraction: float = 0.9
    # robust accounting of shuffle-trust protocols (spec 000 A.3): None = min_contributors_fraction
    honest_fraction: float | None = None
    settings: Any = field(default_factory=NoSettings)  # the protocol's [privacy.<protocol>] table


@dataclass(frozen=True)
class ScheduleConfig:
    kind: str = "fully_interactive"
    optimizer: str = "auto"  # auto = psgd (sequential) / pgd (fully interactive) / sgd (subsampled)
    phases: int = 0  # strongly convex phased restarts (Thm 4.8); 0 = one phase
    cohort_size: int = 0  # sequential: users per round; 0 = Thm 4.1's B = sqrt(d) ln(d/delta)/eps
    # fully interactive: T (None = DEFAULT_ROUNDS); sequential: at most T rounds (None = floor(unused users / B))
    rounds: int | None = None
    learning_rate: float | None = None  # None = theory rule (Thm 4.1 / Lemma B.6), eta = D/(L_G sqrt(T))
    output: str = "mean"  # released model: mean of iterates (the papers' output) or the last iterate
    lr_steps: tuple[int, ...] = ()  # sgd: rounds after which the learning rate is multiplied by lr_step_factor
    lr_step_factor: float = 0.1
    momentum: float = 0.0  # ftrl: gamma of DP-FTRLM (0 = DP-FTRL; the paper's experiments use 0.9)
    sampling: str = "fixed"  # subsampled: "fixed" (uniform k of n) or "poisson" (each user with q = k/n)
    # over-selection (Bonawitz et al. 2019 sec 2): a round closes once max(min_contributors, ceil(this x users
    # invited)) reports arrived (RoundSpec.report_goal); 1.0 = it waits for every invitee until the deadline
    report_goal_fraction: float = 1.0


@dataclass(frozen=True)
class TransportConfig:
    mode: str = "counts"


@dataclass(frozen=True)
class DeploymentConfig:
    client_nodes: int = 2
    users_per_node: int = 0  # 1: every client node is a device hosting one user (clients/device.py); 0: users spread
    round_deadline_seconds: float = 60.0
    population_wait_seconds: float = 60.0
    min_round_seconds: float = 0.0  # pace: a round starts at least this long after the previous one started
    insecure: bool = True
    pki_dir: str = ""


@dataclass(frozen=True)
class PolicyConfig:
    """The simulated users' privacy policy (clients/policy.py UserPolicy; the client nodes enforce it, the analyzer
    reads it only to cap an unset privacy.delta). Defaults accept the embedded run and refuse eps > 8 in one round."""

    max_eps_per_round: float = 8.0
    max_delta_per_round: float = 1e-3
    max_total_eps: float = 64.0
    max_total_delta: float = 1e-2
    allowed_protocols: tuple[str, ...] = ()  # the randomizers the users run; () = every protocol
    # refuse rounds whose transport shows the shuffler a user's counts (COUNTS): PRIO3, BITS and SEALED only (issue 45)
    require_split_trust: bool = False


def _mlflow_target(key: str, v: object) -> bool | str:
    """[tracking] mlflow: true / false, or an MLflow tracking URI (a scheme, no credentials: the configuration is
    handed to every party and written to the results)."""
    if isinstance(v, bool):
        return v
    if not isinstance(v, str):
        raise ConfigError(f"{key} must be true, false or an MLflow tracking URI, got {v!r}", key)
    if v.strip().lower() in ("true", "false"):
        raise ConfigError(f"{key} must be true or false without quotes (or a tracking URI), got {v!r}", key)
    scheme = v.split(":", 1)[0] if ":" in v else ""
    if v in ("databricks", "databricks-uc"):
        return v
    if not v or any(c.isspace() for c in v) or not scheme[:1].isalpha() or len(scheme) < 2:
        raise ConfigError(
            f'{key} must be true, false or an MLflow tracking URI ("sqlite:///PATH/mlflow.db", "http://HOST:5000"), '
            f"got {v!r}",
            key,
        )
    netloc = v.split("://", 1)[1].split("/", 1)[0] if "://" in v else ""
    if "@" in netloc:
        raise ConfigError(
            f"{key}: no credentials in the URI (the configuration goes to every party and into the results); set "
            "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN instead",
            key,
        )
    return v


def _nonempty(key: str, v: object) -> str:
    if not string(key, v).strip():
        raise ConfigError(f"{key} must not be empty", key)
    return v  # type: ignore[return-value]


@dataclass(frozen=True)
class TrackingConfig:
    """[tracking]: where `shuffledp run` also logs the run (shuffledp/observability/; the services ignore it)."""

    mlflow: bool | str = setting(
        False,
        "MLflow tracking (pip install 'shuffledp[mlflow]'): true = a store of its own in the results directory "
        '(mlflow/mlflow.db, offline), or a tracking URI ("sqlite:///PATH/mlflow.db", "http://HOST:5000"); false = '
        "off. Params, per-round metrics, the results as artifacts",
        read=_mlflow_target,
    )
    experiment: str = setting("shuffledp", "the MLflow experiment the run is logged in", read=_nonempty)


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    toml_text: str = ""  # the exact text parsed (kept so every party can be given the same document)
