"""`shuffledp account PROTOCOL ...`: what does a run cost, and how many rounds / how much noise fits a budget.

Each protocol is a sub-command; the same three queries work for all of them:

    cost (default)   eps at --delta of --rounds rounds with the given noise
    --max-rounds     the largest number of rounds whose cost fits (--eps, --delta)
    --min-noise      the least noise (largest eps0 for subsampled-shuffle) for which --rounds fit (--eps, --delta)

--accountant tight (default) or paper chooses the bound (shuffledp.accountants.ledger_accounting); --json prints
one JSON object (eps, delta, accountant, optimal_order, trust, ...) instead of a table. Bad arguments print one
line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from shuffledp.accountants import ledger_accounting as la
from shuffledp.accountants.events import (
    GaussianRound,
    LdpShuffleRound,
    PnsgdRun,
    PrivacyEvent,
    PvecRound,
    TreeAggregation,
)
from shuffledp.lazy import OnFirstUse

# imported at first use: `--help` and argument errors need none of them (dp_accounting and scipy are ~3 s)
gaussian = OnFirstUse("shuffledp.accountants.gaussian")
pnsgd = OnFirstUse("shuffledp.accountants.pnsgd")
gaussian_round = OnFirstUse("shuffledp.protocols.gaussian_round")
mechanism_calibration = OnFirstUse("dp_accounting.mechanism_calibration")
dp_event = OnFirstUse("dp_accounting.dp_event")
dpa_pld = OnFirstUse("dp_accounting.pld.pld_privacy_accountant")
dpa_rdp = OnFirstUse("dp_accounting.rdp.rdp_privacy_accountant")

__all__ = ["add_parser", "run"]

PROTOCOLS: dict[str, str] = {
    "pvec": "seed 000: PVEC binomial vector sum; paper or calibrated noise, sequential or PGD",
    "subsampled-shuffle": "seed 001: eps0-LDP reports of k of n clients, shuffled (CLDP-SGD)",
    "gaussian": "seed 002: Gaussian noise per round, local or central (DP-mu2-FL)",
    "tree": "seed 003: DP-FTRL tree aggregation, restarts, multiple participations",
    "pnsgd": "seed 004: shuffled projected noisy SGD, one or more epochs",
    "mf": "DP-FTRL with matrix-factorization noise (banded, BLT): k participations xi rounds apart",
}

_GAUSSIAN_NOTE = (
    "Three accountants: no sampling (exact Gaussian, or its RDP conversion for discrete noise); "
    "--sampling-probability q (Poisson, add-or-remove-one, sensitivity C; continuous noise only); --sample-size k "
    "--dataset-size n (a fixed cohort drawn without replacement, replace-one: what the ledger charges protocol "
    "gaussian with sampling fixed). z is always per clip norm C (noise std z C); under replace-one one user moves "
    "the sum by up to 2C, so the fixed-cohort accountant sees multiplier z/2. --noise: the noise the protocols add "
    "(the runs' default: discrete without sampling, continuous with --sampling-probability or --sample-size)."
)
_NOISE_HELP = (
    "the noise added (the noise key of the protocol's table): discrete (default; the discrete Gaussian, charged by "
    "its RDP curve, CKS20) or continuous (the exact Gaussian curve / PLD)"
)

_EPILOG = """\
queries (every protocol):
  cost            default: eps at --delta of --rounds rounds
  --max-rounds    largest number of rounds that fits --eps at --delta
  --min-noise     least noise for which --rounds fit --eps at --delta
                  (subsampled-shuffle: the largest eps0; pvec: re-derived (g, m, p))

examples:
  shuffledp account gaussian --sigma 20 --rounds 100 --delta 1e-5
  shuffledp account gaussian --noise-multiplier 1.1 --sampling-probability 0.01 --rounds 1000 --delta 1e-5
  shuffledp account gaussian --sample-size 100 --dataset-size 10000 --rounds 1000 --eps 1 --delta 1e-5 --min-noise
  shuffledp account subsampled-shuffle --eps0 1 --n 60000 --k 10000 --rounds 600 --delta 1e-5
  shuffledp account subsampled-shuffle --eps0 1 --n 60000 --k 10000 --eps 1 --delta 1e-5 --max-rounds
  shuffledp account pvec --n 1000 --d 100 --schedule pgd --rounds 16 --eps 8 --delta 1e-3 --min-noise
  shuffledp account tree --noise-multiplier 1 --leaves-per-tree 1000 --max-participations 4 --min-separation 100 \
      --delta 1e-6
  shuffledp account pnsgd --noise gaussian --n 10000 --lipschitz 1 --eta 0.1 --diameter 1 --eps 1 --delta 1e-5 \\
      --min-noise
  shuffledp account mf --rounds 12 --bands 3 --max-participations 2 --min-separation 2 --eps 8 --delta 1e-5 \\
      --min-noise
Run `shuffledp account PROTOCOL --help` for the options of one protocol.
"""


# ------------------------------------------------------------------------------------------ argparse glue
class _OneLineParser(argparse.ArgumentParser):
    """Errors are ONE line on stderr and exit status 2 (no usage block); unknown options are errors here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        text = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {text} (see --help)\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = super().parse_known_args(args, namespace)
        if extras:  # report them here, in one line, instead of the top-level parser's usage block
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _unit(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}") from None
    if not 0.0 < v < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in the open interval (0, 1), got {text}")
    return v


def _prob(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return v


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return v


def _common(
    p: argparse.ArgumentParser, rounds_help: str = "number of rounds (default 1)", rounds_flags: tuple[str, ...] = ()
) -> None:
    g = p.add_argument_group("budget and query")
    g.add_argument("--delta", type=_unit, required=True, help="target delta, in (0, 1)")
    g.add_argument("--eps", type=_positive, help="eps budget (needed by --max-rounds and --min-noise)")
    g.add_argument(*(rounds_flags or ("--rounds",)), dest="rounds", type=_count, default=None, help=rounds_help)
    q = g.add_mutually_exclusive_group()
    q.add_argument("--max-rounds", action="store_true", help="largest number of rounds that fits (--eps, --delta)")
    q.add_argument("--min-noise", action="store_true", help="least noise for which --rounds fit (--eps, --delta)")
    g.add_argument(
        "--accountant",
        choices=la.ACCOUNTANTS,
        default="tight",
        help="tight: tightest rigorous bound (default); paper: the paper's own bound",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `account` with one sub-command per protocol (shuffledp/cli/__init__.py convention)."""
    parser = subparsers.add_parser(
        "account",
        help="privacy cost of a protocol; rounds or noise that fit a budget",
        description="What does a run of a protocol cost, and how many rounds / how much noise fit a budget "
        "(--accountant tight: the tightest rigorous bound; paper: each paper's own bound).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.__class__ = _OneLineParser  # the dispatcher creates it as a plain ArgumentParser
    sub = parser.add_subparsers(
        dest="protocol", metavar="PROTOCOL", required=True, parser_class=_OneLineParser, title="protocols"
    )
    fmt = argparse.ArgumentDefaultsHelpFormatter

    p = sub.add_parser("pvec", help=PROTOCOLS["pvec"], description=PROTOCOLS["pvec"] + ".", formatter_class=fmt)
    p.add_argument("--n", type=_count, required=True, help="users per round (cohort; PGD: all users)")
    p.add_argument("--d", type=_count, required=True, help="dimension of the summed vectors")
    p.add_argument("--delta2", type=_positive, default=1.0, help="l2 clip bound of one user's vector")
    p.add_argument(
        "--schedule",
        choices=("sequential", "pgd", "fully-interactive"),
        default="sequential",
        help="sequential: disjoint cohorts (rounds compose in parallel); pgd = fully-interactive: every user in "
        "every round",
    )
    p.add_argument(
        "--method",
        choices=("calibrated", "paper"),
        default="calibrated",
        help="how (g, m, p) are derived: calibrated (exact accountant, beyond the paper) or paper (Thm 3.2)",
    )
    p.add_argument("--round-eps", type=_positive, help="per-round target the parameters are derived for (cost)")
    p.add_argument("--round-delta", type=_unit, help="per-round target delta (default: --delta, PGD --delta/(T+1))")
    p.add_argument("--g", type=_count, help="explicit fixed-point precision g (with --m and --p)")
    p.add_argument("--m", type=_count, help="explicit binomial trials per user and coordinate")
    p.add_argument("--p", type=_unit, help="explicit binomial success probability")
    p.add_argument("--contributors", type=_count, help="users actually aggregated per round (default --n)")
    _common(p)
    p.set_defaults(func=run, _parser=p)

    p = sub.add_parser(
        "subsampled-shuffle",
        help=PROTOCOLS["subsampled-shuffle"],
        description=PROTOCOLS["subsampled-shuffle"] + ".",
        formatter_class=fmt,
    )
    p.add_argument("--eps0", type=_positive, help="LDP parameter of each report (not with --min-noise)")
    p.add_argument("--n", type=_count, required=True, help="number of clients")
    p.add_argument("--k", type=_count, required=True, help="clients sampled per round (k <= n)")
    p.add_argument(
        "--bound",
        choices=la.LDP_SHUFFLE_BOUNDS,
        default=None,
        help="upper: Thm 1 as printed; upper-tightened: + envelope and pure-DP cap (tight default); lower: Thm 2 "
        "(NOT a guarantee); baseline: FMT20 numeric + subsampling + KOV15 (paper default); tight-pld: FMT20 "
        "dominating pair composed as a PLD",
    )
    p.add_argument("--randomizer", default="generic", help="label of the eps0-LDP randomizer (informational)")
    _common(p)
    p.set_defaults(func=run, _parser=p)

    p = sub.add_parser(
        "gaussian",
        help=PROTOCOLS["gaussian"],
        description=PROTOCOLS["gaussian"] + ". " + _GAUSSIAN_NOTE,
        formatter_class=fmt,
    )
    noise = p.add_mutually_exclusive_group()
    noise.add_argument("--sigma", type=_positive, help="noise std per round (not with --min-noise)")
    noise.add_argument(
        "--noise-multiplier",
        type=_positive,
        help="z = sigma / sensitivity; fixed cohort: z = sigma / C per clip norm C, while the replace-one "
        "sensitivity is 2C (dp_accounting is given z/2)",
    )
    p.add_argument("--sensitivity", type=_positive, help="l2 sensitivity of one round's release (default 1)")
    p.add_argument(
        "--lipschitz-increment",
        type=_positive,
        help="seed 002's S = G + 2 L D: sensitivity 2S (local) or 2S/M (central), instead of --sensitivity",
    )
    p.add_argument("--machines", type=_count, default=1, help="M, machines averaged by the server (central)")
    p.add_argument("--trust", choices=("central", "local"), default="central", help="who adds the noise")
    p.add_argument(
        "--sampling-probability",
        "--sampling-rate",
        dest="sampling_rate",
        type=_prob,
        help="Poisson sampling probability q per round, add-or-remove-one (dp_accounting's PoissonSampledDpEvent; "
        "--sampling-rate is the old name)",
    )
    p.add_argument(
        "--sample-size",
        "--k",
        dest="sample_size",
        type=_count,
        help="fixed cohort: k users drawn without replacement per round, replace-one (the ledger's accountant for "
        "protocol gaussian, sampling fixed; with --dataset-size)",
    )
    p.add_argument("--dataset-size", "--n", dest="dataset_size", type=_count, help="fixed cohort: n users drawn from")
    p.add_argument("--noise", dest="gaussian_noise", choices=("discrete", "continuous"), help=_NOISE_HELP)
    p.add_argument(
        "--neighboring",
        choices=("add_or_remove_one", "replace_one"),
        help="neighbouring relation (dp_accounting's names); default and only choice per query: add_or_remove_one "
        "(Poisson, unsampled), replace_one (fixed cohort)",
    )
    _common(p)
    p.set_defaults(func=run, _parser=p)

    p = sub.add_parser("tree", help=PROTOCOLS["tree"], description=PROTOCOLS["tree"] + ".", formatter_class=fmt)
    p.add_argument("--noise-multiplier", type=_positive, help="z: node noise std / leaf sensitivity")
    p.add_argument(
        "--leaves-per-tree",
        "--steps",
        dest="leaves_per_tree",
        type=_count,
        help="rounds (leaves) in each tree; --max-rounds without it: the most leaves in one tree (--steps: old name)",
    )
    p.add_argument("--max-participations", type=_count, default=1, help="E: leaves per record in one tree")
    p.add_argument("--min-separation", type=_nonneg_int, default=0, help="xi: leaves between two participations")
    p.add_argument("--completion", action="store_true", help="trees padded to a power of two before a restart")
    p.add_argument("--fixed-order", action="store_true", help="same data order every epoch (E epochs per tree)")
    p.add_argument("--noise", dest="gaussian_noise", choices=("discrete", "continuous"), help=_NOISE_HELP)
    _common(p, "number of trees, i.e. restarts + 1 (default 1; --rounds: old name)", ("--trees", "--rounds"))
    p.set_defaults(func=run, _parser=p)

    p = sub.add_parser("pnsgd", help=PROTOCOLS["pnsgd"], description=PROTOCOLS["pnsgd"] + ".", formatter_class=fmt)
    p.add_argument("--noise", choices=("gaussian", "laplace"), default="gaussian", help="noise distribution")
    p.add_argument("--n", type=_count, required=True, help="records (steps per epoch)")
    p.add_argument("--lipschitz", type=_positive, required=True, help="L, Lipschitz constant of the loss")
    p.add_argument("--sigma", "--scale", dest="scale", type=_positive, help="noise std (Gaussian) or scale v")
    p.add_argument("--eta", type=_positive, required=True, help="step size")
    p.add_argument("--diameter", type=_positive, required=True, help="D_K (Gaussian) or b - a (Laplace)")
    p.add_argument("--contraction", type=_prob, help="M (default 1, or from --beta and --rho)")
    p.add_argument("--beta", type=_positive, help="smoothness (with --rho: M = sqrt(1 - 2 eta beta rho/(beta+rho)))")
    p.add_argument("--rho", type=float, default=0.0, help="strong convexity (with --beta)")
    _common(p, "number of epochs (default 1)")
    p.add_argument("--epochs", dest="rounds", type=_count, help="alias of --rounds")
    p.set_defaults(func=run, _parser=p)

    p = sub.add_parser("mf", help=PROTOCOLS["mf"], description=PROTOCOLS["mf"] + ".", formatter_class=fmt)
    p.add_argument("--strategy", choices=("banded", "blt"), default="banded", help="the factorization C")
    p.add_argument(
        "--bands",
        type=_count,
        help="b of the banded strategy (default: min separation + 1, or --rounds for one participation)",
    )
    p.add_argument("--max-participations", type=_count, default=1, help="k: rounds a user may join in the run")
    p.add_argument("--min-separation", type=_nonneg_int, default=0, help="xi: rounds strictly between two of them")
    p.add_argument("--noise-multiplier", type=_positive, help="z: std of Z / clip norm")
    _common(
        p,
        "T, the rows of C (required; --max-rounds: the most of them a run stopped early may release within --eps)",
    )
    p.set_defaults(func=run, _parser=p)


# ------------------------------------------------------------------------------------------ the queries
class _Usage(Exception):
    """A missing or inconsistent option (reported like an argparse error)."""


def _require(args: argparse.Namespace, *names: str, why: str) -> None:
    missing = [n for n in names if getattr(args, n.lstrip("-").replace("-", "_"), None) is None]
    if missing:
        raise _Usage(f"{why} needs {' and '.join(missing)}")


def _query(args: argparse.Namespace) -> str:
    if args.max_rounds:
        _require(args, "--eps", why="--max-rounds")
        return "max_rounds"
    if args.min_noise:
        _require(args, "--eps", why="--min-noise")
        return "min_noise"
    return "cost"


def _template(args: argparse.Namespace, query: str) -> tuple[PrivacyEvent, dict[str, Any]]:
    """The event a query is about (noise filled with a starting value for --min-noise) and the inputs to echo."""
    proto = args.protocol
    if proto == "subsampled-shuffle":
        if query != "min_noise":
            _require(args, "--eps0", why=f"the {query.replace('_', '-')} query")
        eps0 = args.eps0 if args.eps0 is not None else 1.0
        ev = LdpShuffleRound(args.randomizer, eps0, args.n, args.k)
        return ev, {"n": args.n, "k": args.k, "randomizer": args.randomizer}
    if proto == "gaussian":
        if args.lipschitz_increment is not None and args.sensitivity is not None:
            raise _Usage("give --sensitivity or --lipschitz-increment, not both")
        if args.lipschitz_increment is not None:
            sens = gaussian.sensitivity(args.lipschitz_increment, args.machines, args.trust == "central")
        else:
            sens = args.sensitivity if args.sensitivity is not None else 1.0
        if args.noise_multiplier is not None:
            sigma = args.noise_multiplier * sens
        elif args.sigma is not None:
            sigma = args.sigma
        elif query == "min_noise":
            sigma = sens
        else:
            raise _Usage(f"the {query.replace('_', '-')} query needs --sigma or --noise-multiplier")
        sampling = "poisson" if args.sampling_rate is not None else "none"
        ev = GaussianRound(sigma, sens, args.trust, sampling, args.sampling_rate or 1.0)
        return ev, {"sensitivity": sens, "sampling_rate": ev.sampling_rate}
    if proto == "tree":
        if query != "min_noise":
            _require(args, "--noise-multiplier", why=f"the {query.replace('_', '-')} query")
        if query != "max_rounds":
            _require(args, "--leaves-per-tree", why=f"the {query.replace('_', '-')} query")
        ev = TreeAggregation(
            args.noise_multiplier or 1.0,
            args.leaves_per_tree or 1,
            args.max_participations,
            args.min_separation,
            args.completion,
            "fixed" if args.fixed_order else "any",
        )
        return ev, {
            "steps": args.leaves_per_tree,
            "max_participations": args.max_participations,
            "min_separation": args.min_separation,
            "completion": args.completion,
            "order": ev.order,
            "zeta": la.tree_zeta(ev) if args.leaves_per_tree else None,
        }
    if proto == "pnsgd":
        if query != "min_noise":
            if args.scale is None:  # dest of --sigma/--scale
                raise _Usage(f"the {query.replace('_', '-')} query needs --sigma (or --scale)")
        if args.contraction is not None and args.beta is not None:
            raise _Usage("give --contraction or --beta/--rho, not both")
        m = args.contraction if args.contraction is not None else 1.0
        if args.beta is not None:
            m = pnsgd.contraction_factor(args.eta, args.beta, args.rho)
        ev = PnsgdRun(args.noise, args.n, args.lipschitz, args.scale or 1.0, args.eta, args.diameter, m)
        return ev, {"noise": args.noise, "n": args.n, "contraction": m}
    return _pvec_template(args, query)


def _pvec_schedule(args: argparse.Namespace) -> str:
    return "sequential" if args.schedule == "sequential" else "fully_interactive"


def _pvec_template(args: argparse.Namespace, query: str) -> tuple[PrivacyEvent, dict[str, Any]]:
    from shuffledp.mechanisms.pvec import PvecParams, pvec_params

    schedule = _pvec_schedule(args)
    rounds = args.rounds or 1
    explicit = [args.g, args.m, args.p]
    echo: dict[str, Any] = {"n": args.n, "d": args.d, "delta2": args.delta2, "schedule": schedule}
    if query == "min_noise":
        if any(v is not None for v in explicit) or args.round_eps is not None:
            raise _Usage("--min-noise derives (g, m, p); do not give --g/--m/--p or --round-eps")
        # a placeholder event carrying n, d, delta2 and the schedule; min_noise re-derives the parameters
        params = pvec_params(1.0, 0.25, args.n, args.d, args.delta2)
        return PvecRound.from_params(params, None, schedule), echo
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise _Usage("explicit parameters need all of --g, --m and --p")
        if args.round_eps is None:
            raise _Usage("explicit --g/--m/--p also need --round-eps (the per-round target they were sized for)")
    elif args.round_eps is None:
        raise _Usage(f"the {query.replace('_', '-')} query needs --round-eps (or explicit --g --m --p)")
    rd = args.round_delta
    if rd is None:
        rd = args.delta if schedule == "sequential" else args.delta / (rounds + 1)  # PGD: delta_r = delta/(T+1)
    if any(v is not None for v in explicit):
        params = PvecParams(
            d=args.d,
            n=args.n,
            delta2=args.delta2,
            g=args.g,
            m=args.m,
            p=args.p,
            eps=args.round_eps,
            delta=rd,
            method=args.method,
        )
    elif args.method == "paper":
        params = pvec_params(args.round_eps, rd, args.n, args.d, args.delta2)
    else:
        params = la.calibrate_pvec_round(args.round_eps, rd, args.n, args.d, args.delta2)
    echo.update({"round_eps": params.eps, "round_delta": params.delta})
    return PvecRound.from_params(params, args.contributors, schedule), echo


def _nothing(
    ev: PrivacyEvent, delta: float, acc: str, bound: str | None, noise: str = "continuous"
) -> la.AccountResult:
    """Zero rounds cost nothing: (0, 0) under the accountant that would account one round."""
    one = la.account([ev], delta, acc, ldp_bound=bound, noise=noise)
    return la.AccountResult(0.0, 0.0, one.accountant_name, None, one.trust, {})


def _noise_report(ev: PrivacyEvent) -> dict[str, Any]:
    if isinstance(ev, GaussianRound):
        return {"sigma": ev.sigma, "noise_multiplier": ev.noise_multiplier}
    if isinstance(ev, TreeAggregation):
        return {"noise_multiplier": ev.noise_multiplier}
    if isinstance(ev, PnsgdRun):
        return {"scale": ev.scale}
    if isinstance(ev, LdpShuffleRound):
        return {"eps0": ev.eps0}
    if isinstance(ev, PvecRound):
        return la.pvec_report(ev)
    return {}


_WOR = {
    "continuous": "sampled-without-replacement-gaussian-rdp (dp_accounting, replace-one; the ledger's for a fixed "
    "cohort)",
    "discrete": "sampled-without-replacement-discrete-gaussian-rdp (WBK19 Thm 9, CKS20 Thm 14, replace-one; the "
    "ledger's for a fixed cohort)",
}


def _gaussian_noise(args: argparse.Namespace) -> str:
    """--noise of gaussian / tree: the runs' default (discrete; continuous for sampled DP-SGD, Poisson or fixed
    cohort, as protocol gaussian); "continuous" for the other protocols (no Gaussian-mechanism event)."""
    if args.protocol not in ("gaussian", "tree"):
        return "continuous"
    poisson = getattr(args, "sampling_rate", None) is not None
    sampled = poisson or getattr(args, "sample_size", None) is not None
    noise = args.gaussian_noise or ("continuous" if sampled else "discrete")
    if noise == "discrete" and poisson:
        raise _Usage("--noise discrete has no proven accountant with --sampling-probability: use --noise continuous")
    return noise


def _fixed_cohort(args: argparse.Namespace, query: str) -> dict[str, Any]:
    """k of n drawn without replacement per round, replace-one: gaussian_round.wor_epsilon, the ledger's own
    accountant for protocol "gaussian" with sampling "fixed" (Wang, Balle & Kasiviswanathan 2019, Thm 27)."""
    n, k = args.dataset_size, args.sample_size
    if n is None or k is None:
        raise _Usage("a fixed cohort needs --sample-size and --dataset-size")
    if args.sampling_rate is not None:
        raise _Usage("give --sampling-probability (Poisson) or --sample-size/--dataset-size (fixed cohort), not both")
    if args.neighboring == "add_or_remove_one":
        raise _Usage("the fixed-cohort accountant is replace-one (n is public): --neighboring replace_one")
    if k > n:
        raise _Usage(f"--sample-size {k} must be <= --dataset-size {n}")
    if args.sigma is not None or args.sensitivity is not None or args.lipschitz_increment is not None:
        raise _Usage(
            "a fixed cohort takes --noise-multiplier z (noise std z C per clip norm C), not --sigma/--sensitivity"
        )
    if args.trust != "central" or args.machines != 1:
        raise _Usage("a fixed cohort is central DP-SGD: no --trust local or --machines")
    delta, z, t = args.delta, args.noise_multiplier, args.rounds or 1
    noise = _gaussian_noise(args)
    out: dict[str, Any] = {"protocol": "gaussian", "query": query}
    if query != "min_noise" and z is None:
        raise _Usage(f"the {query.replace('_', '-')} query needs --noise-multiplier")

    def wor(x: float, r: int) -> float:
        return gaussian_round.wor_epsilon(x, n, k, r, delta, noise)

    if query == "cost":
        eps = wor(z, t)
        out["rounds"] = t
        if args.eps is not None:
            out["fits"] = eps <= args.eps
    elif query == "max_rounds":
        t = la.composition.max_rounds(lambda r: wor(z, r) <= args.eps)
        eps = wor(z, t) if t else 0.0
        out["max_rounds"] = t
        out["eps_next"] = wor(z, t + 1)
    elif noise == "discrete":  # the ledger's own calibration (gaussian_round.plan): bisection on its figure
        z = gaussian_round.least_noise_multiplier(lambda x: wor(x, t) <= args.eps, f"eps = {args.eps} over {t} rounds")
        eps = wor(z, t)
        out["rounds"] = t
    else:
        z = _calibrated_z(
            lambda: dpa_rdp.RdpAccountant(neighboring_relation=dpa_rdp.NeighborRel.REPLACE_ONE),
            # sensitivity 2C under replace-one: the accountant's multiplier is z C / (2 C) (gaussian_round docstring)
            lambda x: dp_event.SampledWithoutReplacementDpEvent(n, k, dp_event.GaussianDpEvent(x / 2.0)),
            lambda x: wor(x, t),
            t,
            args.eps,
            delta,
        )
        eps = wor(z, t)
        out["rounds"] = t
    result: dict[str, Any] = {"eps": eps, "delta": delta, "accountant": _WOR[noise], "optimal_order": None}
    result["trust"] = "central"
    result.update(out)
    if args.eps is not None:
        result["eps_budget"] = args.eps
    result.update({"dataset_size": n, "sample_size": k, "neighboring": "replace_one", "noise_multiplier": z})
    result["noise"] = noise
    return result


def _calibrated_z(
    make_accountant: Any, make_round: Any, eps_of: Any, rounds: int, eps: float, delta: float, bracket: Any = None
) -> float:
    """Least noise multiplier z with eps_of(z) <= eps: dp_accounting's calibrate_dp_mechanism (Brent's method) on
    the accountant the ledger uses, then checked with eps_of itself and raised by 1e-6 relative steps until it fits
    (never below the requirement)."""

    def event(x: float) -> Any:
        return dp_event.SelfComposedDpEvent(make_round(x), rounds)

    bracket = bracket or mechanism_calibration.LowerEndpointAndGuess(1e-3, 1.0)
    try:
        z = float(mechanism_calibration.calibrate_dp_mechanism(make_accountant, event, eps, delta, bracket))
    except mechanism_calibration.NoBracketIntervalFoundError:
        raise ValueError(f"no noise multiplier fits eps={eps}, delta={delta} over {rounds} rounds") from None
    for _ in range(64):
        if eps_of(z) <= eps:
            return z
        z *= 1.0 + 1e-6
    raise ValueError(f"the calibrated noise multiplier {z:.6g} does not fit eps={eps} under the ledger's accountant")


def _poisson_min_noise(ev: GaussianRound, rounds: int, eps: float, delta: float, acc: str) -> GaussianRound:
    """Least sigma of a Poisson-sampled Gaussian: calibrated with dp_accounting's PLD (tight) or RDP (paper)
    accountant, then checked with ledger_accounting.account (min of PLD and RDP, or RDP over extended orders)."""
    q, sens = ev.sampling_rate, ev.sensitivity

    def one(x: float) -> Any:
        return dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(x))

    def eps_of(x: float) -> float:
        return la.account([(_with_sigma(ev, x * sens), rounds)], delta, acc).eps

    # RDP first (cheap at any z); the ledger's tight figure is at most the RDP one, so the PLD's z lies below it
    z = _calibrated_z(dpa_rdp.RdpAccountant, one, eps_of, rounds, eps, delta)
    if acc == "tight":
        lower = 0.5 * z
        while eps_of(lower) <= eps:  # the bracket must hold the answer (PLD far below RDP: tiny q, few rounds)
            lower *= 0.5
        bracket = mechanism_calibration.ExplicitBracketInterval(lower, z)
        pld = lambda: dpa_pld.PLDAccountant(value_discretization_interval=la._PLD_INTERVAL)  # noqa: E731
        z = _calibrated_z(pld, one, eps_of, rounds, eps, delta, bracket)
    return _with_sigma(ev, z * sens)


def _with_sigma(ev: GaussianRound, sigma: float) -> GaussianRound:
    return GaussianRound(sigma, ev.sensitivity, ev.trust, ev.sampling, ev.sampling_rate)


def _mf(args: argparse.Namespace, query: str) -> dict[str, Any]:
    """The planner's own C, sensitivity and noise multiplier (protocols.mf_round.planned_strategy; JAX), charged as
    the ledger charges it: one Gaussian mechanism at Delta / z (accountants.matrix_factorization, exact curve)."""
    from shuffledp.accountants import matrix_factorization as mfa
    from shuffledp.protocols.mf_round import ACCOUNTANT, planned_strategy

    _require(args, "--rounds", why="protocol mf (the rows of C)")
    if args.accountant != "tight":
        raise _Usage("protocol mf has one accountant, the Gaussian mechanism's exact curve: --accountant tight")
    if args.bands is not None and args.strategy != "banded":
        raise _Usage(f'--bands applies to --strategy banded only, not "{args.strategy}"')
    if args.bands is not None and args.bands > args.rounds:
        raise _Usage(f"--bands {args.bands} exceeds --rounds {args.rounds}")
    if query != "min_noise":
        _require(args, "--noise-multiplier", why=f"the {query.replace('_', '-')} query")
    T, k, xi, delta = args.rounds, args.max_participations, args.min_separation, args.delta
    strategy, sens, prefix = planned_strategy(args.strategy, T, k, xi, args.bands)
    z = args.noise_multiplier
    out: dict[str, Any] = {"protocol": "mf", "query": query}
    if query == "min_noise":
        z = mfa.min_noise_multiplier(sens, args.eps, delta)
    if query == "max_rounds":
        # a run stopped after t rounds is charged C[:t, :t]'s sensitivity (the ledger's prefix table)
        fits = [t for t in range(1, T + 1) if mfa.epsilon(z, prefix[t - 1], delta) <= args.eps]
        t = max(fits, default=0)
        out["max_rounds"] = t
        eps = mfa.epsilon(z, prefix[t - 1], delta) if t else 0.0
        if t < T:
            out["eps_next"] = mfa.epsilon(z, prefix[t], delta)
        sens_charged = prefix[t - 1] if t else 0.0
    else:
        eps, sens_charged = mfa.epsilon(z, sens, delta), sens
        out["rounds"] = T
        if args.eps is not None and query == "cost":
            out["fits"] = eps <= args.eps
    result: dict[str, Any] = {
        "eps": eps,
        "delta": delta,
        "accountant": ACCOUNTANT,
        "optimal_order": None,
        "trust": "central",
        **out,
    }
    if args.eps is not None:
        result["eps_budget"] = args.eps
    result.update(
        {
            "strategy": strategy.kind,
            "bands": len(strategy.coefs) if strategy.kind == "banded" else None,
            "max_participations": k,
            "min_separation": xi,
            "sensitivity": sens_charged,
            "noise_multiplier": z,
        }
    )
    return result


def _answer(args: argparse.Namespace) -> dict[str, Any]:
    query = _query(args)
    if args.protocol == "mf":
        return _mf(args, query)
    if args.protocol == "gaussian":
        if args.sample_size is not None or args.dataset_size is not None:
            return _fixed_cohort(args, query)
        if args.neighboring == "replace_one":
            raise _Usage(
                "replace_one is accounted here for a fixed cohort (--sample-size/--dataset-size); Poisson and "
                "unsampled queries are add_or_remove_one"
            )
    ev, echo = _template(args, query)
    acc = args.accountant
    bound = getattr(args, "bound", None)
    noise = _gaussian_noise(args)
    out: dict[str, Any] = {"protocol": args.protocol, "query": query}
    if args.protocol in ("gaussian", "tree"):
        out["noise"] = noise
    if query == "cost":
        t = args.rounds or 1
        res = la.account([(ev, t)], args.delta, acc, ldp_bound=bound, noise=noise)
        out["rounds"] = t
        if args.eps is not None:
            out["fits"] = res.eps <= args.eps
    elif query == "max_rounds":
        if isinstance(ev, TreeAggregation) and args.leaves_per_tree is None:
            steps = la.max_tree_steps(ev.noise_multiplier, args.eps, args.delta, acc, noise)
            out["max_steps"] = steps
            echo["steps"] = steps
            ev = TreeAggregation(ev.noise_multiplier, max(steps, 1))
            echo["zeta"] = la.tree_zeta(ev) if steps else 0
            if steps:
                res = la.account([ev], args.delta, acc, noise=noise)
            else:
                res = _nothing(ev, args.delta, acc, bound, noise)
        else:
            t = la.max_rounds(ev, args.eps, args.delta, acc, ldp_bound=bound, noise=noise)
            unbounded = t == math.inf
            out["max_rounds"] = None if unbounded else int(t)
            if unbounded:
                out["note"] = "sequential rounds compose in parallel: rounds are limited by fresh users, not privacy"
            shown = 1 if unbounded else int(t)
            res = (
                la.account([(ev, shown)], args.delta, acc, ldp_bound=bound, noise=noise)
                if shown
                else _nothing(ev, args.delta, acc, bound, noise)
            )
            if not unbounded:
                out["eps_next"] = la.account([(ev, shown + 1)], args.delta, acc, ldp_bound=bound, noise=noise).eps
    else:
        t = args.rounds or 1
        if isinstance(ev, GaussianRound) and ev.sampling == "poisson":
            ev = _poisson_min_noise(ev, t, args.eps, args.delta, acc)
            res = la.account([(ev, t)], args.delta, acc)
        else:
            ev, res = la.min_noise(ev, t, args.eps, args.delta, acc, ldp_bound=bound, noise=noise)
        out["rounds"] = t
    base = res.to_dict()
    details = {k: v for k, v in base.items() if k not in ("eps", "delta", "accountant", "optimal_order", "trust")}
    result: dict[str, Any] = {
        "eps": res.eps,
        "delta": res.delta,
        "accountant": res.accountant_name,
        "optimal_order": res.optimal_order,
        "trust": res.trust,
    }
    result.update(out)
    if args.eps is not None:
        result["eps_budget"] = args.eps
    result.update(echo)
    result.update(_noise_report(ev))
    for k, v in details.items():
        if not (query == "max_rounds" and k == "rounds"):  # already reported as max_rounds
            result.setdefault(k, v)
    return result


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "-"}[v]
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True)
    return str(v)


def _json_safe(v: Any) -> Any:
    """inf (no finite guarantee) is written as the string "inf"; JSON has no infinity."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    return v


def _table(result: dict[str, Any]) -> str:
    width = max(len(k) for k in result)
    return "\n".join(f"{k.replace('_', ' '):<{width}}  {_fmt(v)}" for k, v in result.items())


def run(args: argparse.Namespace) -> int:
    """Answer one query; argparse-style errors (one line, exit 2) for bad or inconsistent values."""
    parser: argparse.ArgumentParser = args._parser
    try:
        result = _answer(args)
    except (_Usage, ValueError) as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps({k: _json_safe(v) for k, v in result.items()}, allow_nan=False))
    else:
        print(_table(result))
    sys.stdout.flush()
    return 0
