"""`shuffledp account`: help, one-line errors with exit status 2, JSON and table output agreeing with the
accountants, and consistent inverse queries. A few cases run the real CLI in a subprocess."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import shuffledp.accountants.ledger_accounting as la
from shuffledp import cli
from shuffledp.accountants import composition, gaussian, pnsgd, pvec_pld, tree_aggregation
from shuffledp.accountants.events import GaussianRound, LdpShuffleRound, PvecRound, TreeAggregation
from shuffledp.cli.account import PROTOCOLS
from shuffledp.mechanisms.pvec import pvec_params

KEYS = ("eps", "delta", "accountant", "optimal_order", "trust")


def _run(capsys, *argv: str) -> dict:
    assert cli.main(["account", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def _subprocess(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "account", *argv], capture_output=True, text=True, timeout=120
    )


# ---------------------------------------------------------------------------------------------- help
def test_help_lists_every_protocol_and_query() -> None:
    proc = _subprocess("--help")
    assert proc.returncode == 0, proc.stderr
    for name in PROTOCOLS:
        assert name in proc.stdout
    for text in ("--max-rounds", "--min-noise", "seed 000", "seed 001", "seed 002", "seed 003", "seed 004"):
        assert text in proc.stdout
    assert set(PROTOCOLS) == {"pvec", "subsampled-shuffle", "gaussian", "tree", "pnsgd", "mf"}


@pytest.mark.parametrize(
    ("protocol", "options"),
    [
        ("pvec", ("--n", "--d", "--delta2", "--schedule", "--method", "--round-eps", "--contributors")),
        ("subsampled-shuffle", ("--eps0", "--n", "--k", "--rounds", "--bound", "tight-pld", "baseline")),
        ("gaussian", ("--sigma", "--noise-multiplier", "--sensitivity", "--trust", "--sampling-rate")),
        ("tree", ("--noise-multiplier", "--steps", "--max-participations", "--min-separation", "--completion")),
        ("pnsgd", ("--noise", "--n", "--lipschitz", "--sigma", "--eta", "--diameter", "--epochs")),
        ("mf", ("--strategy", "--bands", "--max-participations", "--min-separation", "--noise-multiplier")),
    ],
)
def test_protocol_help_documents_its_options(capsys, protocol, options) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["account", protocol, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for opt in (*options, "--delta", "--eps", "--accountant", "--json", "--max-rounds", "--min-noise"):
        assert opt in out, opt


# ------------------------------------------------------------------------------------------- bad input
BAD = [
    (["foo"], "invalid choice: 'foo'"),
    ([], "required: PROTOCOL"),
    (["gaussian", "--sigma", "1", "--delta", "1"], "--delta: must lie in the open interval (0, 1)"),
    (["gaussian", "--sigma", "1", "--delta", "1.5"], "--delta"),
    (["gaussian", "--sigma", "1", "--delta", "0"], "--delta"),
    (["gaussian", "--sigma", "1", "--delta", "1e-5", "--eps", "0", "--max-rounds"], "--eps: must be a finite"),
    (["gaussian", "--sigma", "1", "--delta", "1e-5", "--eps", "-2", "--max-rounds"], "--eps"),
    (["gaussian", "--sigma", "-1", "--delta", "1e-5"], "--sigma"),
    (["gaussian", "--sigma", "1"], "required: --delta"),
    (["gaussian", "--delta", "1e-5"], "needs --sigma or --noise-multiplier"),
    (["gaussian", "--sigma", "1", "--delta", "1e-5", "--max-rounds"], "--max-rounds needs --eps"),
    (["gaussian", "--sigma", "1", "--delta", "1e-5", "--bogus", "3"], "unrecognized arguments: --bogus 3"),
    (["gaussian", "--sigma", "1", "--delta", "1e-5", "--sensitivity", "1", "--lipschitz-increment", "2"], "not both"),
    (["subsampled-shuffle", "--eps0", "1", "--n", "10", "--k", "20", "--delta", "1e-5"], "k must satisfy"),
    (["subsampled-shuffle", "--eps0", "0", "--n", "10", "--k", "2", "--delta", "1e-5"], "--eps0"),
    (["subsampled-shuffle", "--n", "10", "--k", "2", "--delta", "1e-5"], "needs --eps0"),
    (["subsampled-shuffle", "--eps0", "1", "--k", "2", "--delta", "1e-5"], "required: --n"),
    (["subsampled-shuffle", "--eps0", "1", "--n", "9", "--k", "2", "--delta", "1e-5", "--bound", "x"], "--bound"),
    (["tree", "--noise-multiplier", "1", "--delta", "1e-5"], "needs --leaves-per-tree"),
    (
        [
            "tree",
            "--noise-multiplier",
            "1",
            "--steps",
            "10",
            "--max-participations",
            "3",
            "--fixed-order",
            "--delta",
            "1e-5",
        ],
        "multiple of max_participations",
    ),  # fmt: skip
    (
        [
            "pnsgd",
            "--n",
            "10",
            "--lipschitz",
            "1",
            "--eta",
            "5",
            "--diameter",
            "1",
            "--sigma",
            "1",
            "--beta",
            "1",
            "--delta",
            "1e-5",
        ],
        "eta must be <= 2/(beta+rho)",
    ),  # fmt: skip
    (["pvec", "--n", "100", "--d", "4", "--delta", "1e-5"], "needs --round-eps"),
    (["pvec", "--n", "100", "--d", "4", "--delta", "1e-5", "--round-eps", "20", "--method", "paper"], "eps must"),
    (["pvec", "--n", "100", "--d", "4", "--delta", "1e-5", "--round-eps", "1", "--g", "5"], "all of --g, --m"),
    (
        [
            "pvec",
            "--n",
            "100",
            "--d",
            "4",
            "--delta",
            "1e-5",
            "--round-eps",
            "1",
            "--contributors",
            "101",
            "--method",
            "paper",
        ],
        "contributors must be <= n = 100",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_arguments_give_one_line_and_status_2(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["account", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("shuffledp account") and "error:" in lines[0]
    assert message in lines[0]
    assert captured.out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["nosuch"],
        ["subsampled-shuffle", "--eps0", "1", "--n", "10", "--k", "20", "--delta", "1e-5"],
        ["gaussian", "--sigma", "1", "--delta", "1"],
        ["gaussian", "--sigma", "1", "--delta", "1e-5", "--eps", "0", "--max-rounds"],
        ["pnsgd", "--n", "10", "--eta", "0.1", "--diameter", "1", "--sigma", "1", "--delta", "1e-5"],
        ["pnsgd", "--n", "10", "--lipschitz", "1", "--eta", "0.1", "--diameter", "1", "--delta", "1e-5"],
    ],
)
def test_real_cli_bad_arguments(argv) -> None:
    proc = _subprocess(*argv)
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------------------------- outputs
def test_json_cost_matches_accountant(capsys) -> None:
    # default noise: the discrete Gaussian the runs add (issue 24 D19), charged the RDP conversion
    out = _run(capsys, "gaussian", "--sigma", "20", "--rounds", "100", "--delta", "1e-5")
    for k in KEYS:
        assert k in out
    res = la.account([(GaussianRound(20.0), 100)], 1e-5, noise="discrete")
    assert (out["eps"], out["delta"], out["accountant"], out["trust"], out["noise"]) == (
        res.eps,
        1e-5,
        res.accountant_name,
        "central",
        "discrete",
    )
    assert out["eps"] == gaussian.epsilon_for_rho(0.5, 1e-5, "rdp")  # rho = sqrt(100) / 20
    cont = _run(capsys, "gaussian", "--sigma", "20", "--rounds", "100", "--delta", "1e-5", "--noise", "continuous")
    assert (
        cont["eps"]
        == la.account([(GaussianRound(20.0), 100)], 1e-5).eps
        == gaussian.epsilon_for_rho(0.5, 1e-5, "exact")
    )
    assert cont["eps"] < out["eps"] and "gaussian-exact" in cont["accountant"]
    paper = _run(capsys, "gaussian", "--noise-multiplier", "10", "--sensitivity", "2", "--rounds", "100",
                 "--delta", "1e-5", "--accountant", "paper", "--eps", "6")  # fmt: skip
    assert paper["eps"] == la.account([(GaussianRound(20.0, 2.0), 100)], 1e-5, "paper").eps
    assert paper["optimal_order"] > 1 and paper["fits"] is True
    # seed 002 sensitivity from S and M: 2S/M for the trusted server
    s002 = _run(capsys, "gaussian", "--sigma", "1", "--lipschitz-increment", "3", "--machines", "6", "--delta", "1e-5")
    assert s002["sensitivity"] == gaussian.sensitivity(3.0, 6, trusted=True) == 1.0


def test_table_output_is_human_readable(capsys) -> None:
    argv = ["account", "tree", "--noise-multiplier", "2", "--steps", "1000", "--delta", "1e-6"]
    for noise, name in (("discrete", "gaussian-rdp"), ("continuous", "gaussian-exact")):
        assert cli.main([*argv, "--noise", noise]) == 0
        out = capsys.readouterr().out
        eps = la.account([TreeAggregation(2.0, 1000)], 1e-6, noise=noise).eps
        rows = dict(line.split(None, 1) if " " in line else (line, "") for line in out.splitlines())
        assert float(rows["eps"]) == pytest.approx(eps, rel=1e-5)
        assert name in out and "zeta" in out and "{" not in out


def test_subsampled_shuffle_max_rounds_is_consistent(capsys) -> None:
    out = _run(capsys, "subsampled-shuffle", "--eps0", "1", "--n", "60000", "--k", "10000", "--eps", "1",
               "--delta", "1e-5", "--max-rounds")  # fmt: skip
    ev = LdpShuffleRound("generic", 1.0, 60000, 10000)
    t = out["max_rounds"]
    assert t == la.max_rounds(ev, 1.0, 1e-5)
    assert out["eps"] <= 1.0 < out["eps_next"] and out["optimal_order"] >= 2
    assert out["eps"] == la.account([(ev, t)], 1e-5).eps
    baseline = _run(capsys, "subsampled-shuffle", "--eps0", "1", "--n", "60000", "--k", "10000", "--rounds", "600",
                    "--delta", "1e-5", "--bound", "baseline")  # fmt: skip
    assert baseline["eps"] == pytest.approx(1.282, abs=5e-4) and baseline["optimal_order"] is None


def test_min_noise_queries(capsys) -> None:
    g = _run(capsys, "gaussian", "--rounds", "100", "--eps", "2", "--delta", "1e-5", "--min-noise")
    assert g["sigma"] == pytest.approx(gaussian.min_sigma(1.0, 100, 2.0, 1e-5, "rdp"), rel=1e-8)  # discrete noise
    assert g["eps"] <= 2.0
    g = _run(capsys, "gaussian", "--rounds", "100", "--eps", "2", "--delta", "1e-5", "--min-noise", "--noise",
             "continuous")  # fmt: skip
    assert g["sigma"] == pytest.approx(gaussian.min_sigma(1.0, 100, 2.0, 1e-5, "exact"), rel=1e-8)
    assert g["eps"] <= 2.0
    p = _run(capsys, "pnsgd", "--n", "10000", "--lipschitz", "1", "--eta", "0.1", "--diameter", "1", "--eps", "1",
             "--delta", "1e-5", "--min-noise")  # fmt: skip
    assert p["scale"] == pytest.approx(pnsgd.calibrate_scale("gaussian", 1e-5, 1.0, 10000, 1.0, 0.1, 1.0), rel=1e-8)
    assert p["scale"] == pytest.approx(3.28531, rel=1e-5)  # spec 004 sec 4 calibration value
    t = _run(capsys, "tree", "--noise-multiplier", "5", "--eps", "1", "--delta", "1e-6", "--max-rounds")
    assert t["max_steps"] == tree_aggregation.max_steps_single_tree(5.0, 1.0, 1e-6, "rdp")
    t = _run(capsys, "tree", "--noise-multiplier", "5", "--eps", "1", "--delta", "1e-6", "--max-rounds", "--noise",
             "continuous")  # fmt: skip
    assert t["max_steps"] == tree_aggregation.max_steps_single_tree(5.0, 1.0, 1e-6, "exact")


def test_pvec_queries(capsys) -> None:
    paper = _run(capsys, "pvec", "--n", "1000", "--d", "10", "--round-eps", "1", "--method", "paper",
                 "--accountant", "paper", "--rounds", "5", "--delta", "1e-6")  # fmt: skip
    assert paper["eps"] == 1.0 and paper["g"] == pvec_params(1.0, 1e-6, 1000, 10, 1.0).g  # parallel composition
    pgd = _run(capsys, "pvec", "--n", "1000", "--d", "10", "--schedule", "pgd", "--rounds", "15", "--eps", "1",
               "--delta", "1e-6", "--accountant", "paper", "--min-noise")  # fmt: skip
    ref = pvec_params(*composition.pgd_round_budget(1.0, 1e-6, 15), 1000, 10, 1.0)
    assert (pgd["g"], pgd["m"], pgd["p"]) == (ref.g, ref.m, ref.p)
    assert pgd["eps"] == pytest.approx(composition.pgd_total(1.0, 1e-6, 15)[0], rel=1e-12)
    tight = _run(capsys, "pvec", "--n", "100", "--d", "2", "--round-eps", "1", "--rounds", "3", "--schedule", "pgd",
                 "--delta", "1e-5", "--round-delta", "1e-5")  # fmt: skip
    params = pvec_pld.calibrate_pvec_pld(1.0, 1e-5, 100, 2, 1.0)  # the ledger's calibration (issue 16)
    assert tight["m"] == params.m and tight["method"] == "calibrated"
    assert tight["eps"] == pvec_pld.composed_epsilon([(params, 100)] * 3, 1e-5)
    assert tight["variance_per_coordinate"] > 0
    seq = _run(capsys, "pvec", "--n", "1000", "--d", "10", "--round-eps", "1", "--method", "paper", "--eps", "1",
               "--delta", "1e-6", "--max-rounds")  # fmt: skip
    assert seq["max_rounds"] is None and "parallel" in seq["note"]
    assert seq["eps"] == la.account([PvecRound.from_params(pvec_params(1.0, 1e-6, 1000, 10, 1.0))], 1e-6).eps


def test_real_cli_json(tmp_path) -> None:
    proc = _subprocess("gaussian", "--sigma", "5", "--rounds", "10", "--delta", "1e-5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(KEYS) <= set(out) and math.isfinite(out["eps"]) and out["eps"] > 0


# ------------------------------------------------------------------------- issue 24 C14: names, fixed cohort, speed
def test_fixed_cohort_query_is_the_ledgers_accountant(capsys) -> None:
    """--sample-size k --dataset-size n: gaussian_round.wor_epsilon (what the ledger charges protocol gaussian with a
    fixed cohort), for cost, --max-rounds and --min-noise."""
    from shuffledp.protocols.gaussian_round import wor_epsilon

    base = ["gaussian", "--sample-size", "50", "--dataset-size", "2000", "--delta", "1e-5", "--noise", "discrete"]
    cost = _run(capsys, *base, "--noise-multiplier", "2", "--rounds", "100")
    assert cost["eps"] == wor_epsilon(2.0, 2000, 50, 100, 1e-5, "discrete")
    assert cost["neighboring"] == "replace_one"
    most = _run(capsys, *base, "--noise-multiplier", "2", "--eps", "1", "--max-rounds")
    t = most["max_rounds"]
    assert wor_epsilon(2.0, 2000, 50, t, 1e-5, "discrete") <= 1.0 < wor_epsilon(2.0, 2000, 50, t + 1, 1e-5, "discrete")
    least = _run(capsys, *base, "--rounds", "100", "--eps", "1", "--min-noise")
    z = least["noise_multiplier"]
    assert least["eps"] == wor_epsilon(z, 2000, 50, 100, 1e-5, "discrete") <= 1.0  # never below the requirement
    assert wor_epsilon(z * (1 - 1e-4), 2000, 50, 100, 1e-5, "discrete") > 1.0  # and near-least
    # --noise continuous: dp_accounting's bound for the continuous Gaussian (WBK19 Thm 27), never above the discrete
    cont = _run(capsys, *base[:-2], "--noise-multiplier", "2", "--rounds", "100")  # the default: continuous
    assert cont["eps"] == wor_epsilon(2.0, 2000, 50, 100, 1e-5, "continuous") <= cost["eps"]
    assert cost["noise"] == "discrete" and cont["noise"] == "continuous" and cont["accountant"] != cost["accountant"]


def test_fixed_cohort_refuses_add_or_remove_and_mixed_sampling(capsys) -> None:
    for extra, msg in (
        (["--neighboring", "add_or_remove_one"], "replace-one"),
        (["--sampling-probability", "0.1"], "not both"),
        (["--sigma", "2"], "--noise-multiplier z"),
    ):
        argv = ["gaussian", "--sample-size", "5", "--dataset-size", "50", "--delta", "1e-5", *extra]
        with pytest.raises(SystemExit):
            cli.main(["account", *argv])
        assert msg in capsys.readouterr().err


def test_poisson_min_noise_fits_the_ledgers_accountant(capsys) -> None:
    """dp_accounting's calibration, checked with ledger_accounting.account: never above the budget, near-least."""
    out = _run(capsys, "gaussian", "--sampling-probability", "0.05", "--rounds", "50", "--eps", "2", "--delta", "1e-5",
               "--min-noise")  # fmt: skip
    ev = GaussianRound(out["sigma"], 1.0, "central", "poisson", 0.05)
    assert la.account([(ev, 50)], 1e-5).eps == out["eps"] <= 2.0
    worse = GaussianRound(out["sigma"] * (1 - 1e-4), 1.0, "central", "poisson", 0.05)
    assert la.account([(worse, 50)], 1e-5).eps > 2.0


def test_old_option_names_are_aliases(capsys) -> None:
    new = _run(capsys, "gaussian", "--noise-multiplier", "1.5", "--sampling-probability", "0.05", "--rounds", "20",
               "--delta", "1e-5")  # fmt: skip
    old = _run(capsys, "gaussian", "--noise-multiplier", "1.5", "--sampling-rate", "0.05", "--rounds", "20",
               "--delta", "1e-5")  # fmt: skip
    assert new == old
    tree_new = _run(capsys, "tree", "--noise-multiplier", "3", "--leaves-per-tree", "64", "--trees", "3",
                    "--delta", "1e-6")  # fmt: skip
    tree_old = _run(capsys, "tree", "--noise-multiplier", "3", "--steps", "64", "--rounds", "3", "--delta", "1e-6")
    assert tree_new == tree_old
    assert tree_new["rounds"] == 3 and tree_new["steps"] == 64


def test_help_imports_no_dp_accounting_and_states_the_noise_convention() -> None:
    """`shuffledp account --help` used to take 3.7 s, mostly importing dp_accounting and scipy it never used."""
    code = (
        "import sys\n"
        "from shuffledp import cli\n"
        "for argv in (['account', '--help'], ['account', 'gaussian', '--help']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('dp_accounting', 'scipy.stats', 'scipy.optimize') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    text = " ".join(proc.stdout.split())
    assert "noise std z C" in text and "2C" in text


# ------------------------------------------------------------------------------------ matrix factorization
MF = ("--rounds", "12", "--bands", "3", "--max-participations", "2", "--min-separation", "2", "--delta", "1e-5")


def test_mf_queries_are_the_planners_and_agree_with_each_other(capsys) -> None:
    """The three queries on the planner's own C (protocols.mf_round.planned_strategy): --min-noise gives the least z
    that fits, its cost is within the budget, and --max-rounds at that z is the whole run, at a lower z fewer."""
    from shuffledp.accountants import matrix_factorization as mfa
    from shuffledp.mechanisms import matrix_factorization as mfm
    from shuffledp.protocols.mf_round import planned_strategy

    least = _run(capsys, "mf", *MF, "--eps", "8", "--min-noise")
    strategy, sens, prefix = planned_strategy("banded", 12, 2, 2, 3)
    z = least["noise_multiplier"]
    assert z == mfa.min_noise_multiplier(sens, 8.0, 1e-5) and least["sensitivity"] == sens
    assert (least["strategy"], least["bands"], least["trust"]) == ("banded", 3, "central")
    assert sens == mfm.sensitivity(strategy, 2, 2)
    cost = _run(capsys, "mf", *MF, "--noise-multiplier", str(z), "--eps", "8")
    assert cost["eps"] == mfa.epsilon(z, sens, 1e-5) <= 8.0 and cost["fits"]
    assert mfa.epsilon(z * (1 - 1e-4), sens, 1e-5) > 8.0  # least: a little less noise does not fit
    assert _run(capsys, "mf", *MF, "--noise-multiplier", str(z), "--eps", "8", "--max-rounds")["max_rounds"] == 12
    fewer = _run(capsys, "mf", *MF, "--noise-multiplier", str(0.75 * z), "--eps", "8", "--max-rounds")
    t = fewer["max_rounds"]
    assert 0 < t < 12 and fewer["eps"] == mfa.epsilon(0.75 * z, prefix[t - 1], 1e-5) <= 8.0 < fewer["eps_next"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("mf", "--delta", "1e-5", "--noise-multiplier", "1"), "protocol mf (the rows of C) needs --rounds"),
        (("mf", *MF, "--noise-multiplier", "1", "--accountant", "paper"), "one accountant"),
        (("mf", *MF, "--strategy", "blt", "--noise-multiplier", "1"), "--bands applies to --strategy banded only"),
        (("mf", "--rounds", "2", "--bands", "3", "--delta", "1e-5", "--noise-multiplier", "1"), "exceeds --rounds"),
        (("mf", *MF), "the cost query needs --noise-multiplier"),
        (("mf", *MF, "--min-noise"), "--min-noise needs --eps"),
    ],
)
def test_mf_usage_errors_are_one_line(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["account", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.strip().splitlines()) <= 2, err
