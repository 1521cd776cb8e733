"""DP-mu2-FL (seed 002; spec 002 sec 8's testable properties): the machines' estimator on real client nodes, its
noise and sensitivity, the server's AnyTime update, the plan's accounting, the trust boundary over a real shuffler,
and runs over real processes whose ledger equals `shuffledp account gaussian`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from _intercept import Recorder
from _runs import run_cli, wait_for_run
from scipy import stats
from shuffledp.clients.node import NodeCore, UserShard, start_node, start_node_with_shard
from shuffledp.clients.policy import UserPolicy
from shuffledp.services.analyzer import LEDGER_FILE, start_analyzer
from shuffledp.services.ledger import Ledger
from shuffledp.services.shuffler import start_shuffler

from shuffledp.accountants import gaussian
from shuffledp.config import ConfigError, parse_config
from shuffledp.optimizers.mu2 import mu2
from shuffledp.protocols import mu2_round
from shuffledp.protocols.base import PlanRequest
from shuffledp.protocols.mu2_round import Mu2Round, Mu2Settings, mu2_epsilon
from shuffledp.security.rng import make_rng
from shuffledp.security.sealing import generate_keypair, open_sealed, round_info, sealed_length
from shuffledp.v1 import shuffledp_pb2 as pb
from shuffledp.v1 import shuffledp_pb2_grpc as pbg

F = 3
D = F + 1  # leastsq: weights and bias
ACCEPT_ALL = UserPolicy(max_total_eps=np.inf, max_total_delta=1.0, max_eps_per_round=np.inf)
WIRE = np.dtype(">f8")


def stream_shard(n: int, T: int, seed: int = 1) -> UserShard:
    rng = make_rng(seed)
    return UserShard([f"m{j}" for j in range(n)], rng.normal(size=(n, T, F)) * 2, rng.normal(size=(n, T)))


def grad(x: np.ndarray, w: np.ndarray, y: float) -> np.ndarray:
    """Independent reference: least-squares gradient (w.[x;1] - y)[x;1]."""
    z = np.append(x, 1.0)
    return (z @ w - y) * z


def xs_history(T: int, seed: int = 3) -> list[np.ndarray]:
    rng = make_rng(seed)
    return [rng.normal(size=D) * 0.5 for _ in range(T)]


def spec(protocol: Mu2Round, x: np.ndarray, x_prev: np.ndarray, key: bytes, r: int = 0, clip=1e9, sigma=1.0, M=1):
    s = pb.RoundSpec(
        run_id="run",
        round=r,
        schedule=pb.FULLY_INTERACTIVE,
        trust_model=protocol.trust_model,
        transport=pb.SEALED,
        randomizer=pb.RandomizerSpec(
            protocol=protocol.name,
            dim=D,
            clip_norm=clip,
            messages_per_user=1,
            message_bytes=8 * D,
            extra={"sigma": sigma, "sensitivity": 2 * clip, "machines": M, "rounds": 100, "delta": 1e-5},
        ),
        model=pb.Tensor(shape=[2, D], f64=np.stack([x, x_prev]).astype("<f8").tobytes()),
        task="leastsq",
        min_contributors=M,
        deadline_seconds=10,
        analyzer_public_key=key,
    )
    s.per_user_cost.CopyFrom(pb.PrivacyCost(eps=protocol.verify_epsilon(s), delta=1e-5, trust_model=s.trust_model))
    return s


def opened(con: pb.Contribution, priv, r: int = 0) -> np.ndarray:
    info = round_info("run", r)
    rows = [open_sealed(priv, m.sealed.ciphertexts[0], info) for m in con.messages]
    return np.array([np.frombuffer(b, dtype=WIRE) for b in rows])


TRUSTED, UNTRUSTED = Mu2Round(trusted=True), Mu2Round(trusted=False)


def test_machines_compute_the_storm_estimate_and_a_repeated_step_recomputes_it():
    """Property 1: q_t = t d_t with d_1 = g_1, d_t = g_t + (1 - 1/t)(d_{t-1} - g~_t) (the d-recursion, computed here
    independently), on a real NodeCore; a step asked again (same x_t, x_{t-1}) gives the same q_t and the run goes
    on from it."""
    n, T = 5, 6
    shard = stream_shard(n, T)
    core = NodeCore("node", shard, ACCEPT_ALL, rng=make_rng(2))
    priv, pub = generate_keypair()
    xs = xs_history(T)
    d_prev = np.zeros((n, D))
    for t in range(1, T + 1):
        x, x_prev = xs[t - 1], xs[max(t - 2, 0)]
        g = np.array([grad(shard.X[i, t - 1], x, shard.y[i, t - 1]) for i in range(n)])
        g_t = np.array([grad(shard.X[i, t - 1], x_prev, shard.y[i, t - 1]) for i in range(n)])
        d = g if t == 1 else g + (1 - 1 / t) * (d_prev - g_t)
        con = core.handle(pb.Invitation(spec=spec(TRUSTED, x, x_prev, pub, r=t), user_ids=shard.user_ids))
        assert not con.refusals
        np.testing.assert_allclose(opened(con, priv, t), t * d, rtol=1e-9, atol=1e-9)
        if t == 3:  # the round was not released: asked again, same answer
            again = core.handle(pb.Invitation(spec=spec(TRUSTED, x, x_prev, pub, r=t), user_ids=shard.user_ids))
            np.testing.assert_allclose(opened(again, priv, t), t * d, rtol=1e-9, atol=1e-9)
        d_prev = d


def test_a_spec_out_of_sync_or_past_the_stream_is_refused_without_a_message():
    shard = stream_shard(2, 2)
    core = NodeCore("node", shard, ACCEPT_ALL, rng=make_rng(2))
    _, pub = generate_keypair()
    a, b, c = xs_history(3)

    def answer(x, x_prev, r):
        con = core.handle(pb.Invitation(spec=spec(UNTRUSTED, x, x_prev, pub, r=r), user_ids=shard.user_ids))
        return len(con.messages), [f.reason for f in con.refusals]

    assert answer(a, b, 0) == (0, ["invalid_round_spec"] * 2)  # a first step must have x_0 = x_1
    assert answer(a, a, 1) == (2, [])
    assert answer(c, b, 2) == (0, ["invalid_round_spec"] * 2)  # x_(t-1) is not the x_t answered last
    assert answer(b, a, 3) == (2, [])
    assert answer(c, b, 4) == (0, ["invalid_round_spec"] * 2)  # step 3, but the streams hold 2 examples


def test_replacing_one_example_moves_every_later_message_by_one_bounded_vector():
    """Property 4: fixed x history, streams differing in machine 0's example tau = 3 only: q_t(S) - q_t(S') is 0
    before tau and the same vector, of norm <= 2S, from tau on (S = clip_norm 0.5, clipping active)."""
    T, tau, clip = 6, 3, 0.5
    shard = stream_shard(1, T)
    X2, y2 = shard.X.copy(), shard.y.copy()
    X2[0, tau - 1] *= -3.0
    y2[0, tau - 1] += 5.0
    other = UserShard(shard.user_ids, X2, y2)
    cores = [NodeCore(f"n{i}", s, ACCEPT_ALL, rng=make_rng(i)) for i, s in enumerate((shard, other))]
    priv, pub = generate_keypair()
    xs = xs_history(T)
    diffs = []
    for t in range(1, T + 1):
        sp = spec(TRUSTED, xs[t - 1], xs[max(t - 2, 0)], pub, r=t, clip=clip)
        q = [opened(c.handle(pb.Invitation(spec=sp, user_ids=["m0"])), priv, t)[0] for c in cores]
        diffs.append(q[0] - q[1])
    assert all(np.all(diffs[t] == 0) for t in range(tau - 1))
    assert np.linalg.norm(diffs[tau - 1]) > 0.1 and np.linalg.norm(diffs[tau - 1]) <= 2 * clip * (1 + 1e-12)
    for t in range(tau, T):
        np.testing.assert_allclose(diffs[t], diffs[tau - 1], atol=1e-12)


def test_untrusted_machines_add_their_own_noise_of_the_given_std():
    """Property 5: (q~ - q)/sigma of 300 machines has ||.||^2 ~ chi2_d (KS test, p > 0.001; fixed seed), and is
    independent across machines (the mean of the first coordinate over machines has std 1/sqrt(300), |z| < 4)."""
    n, sigma = 300, 2.5
    shard = stream_shard(n, 1)
    noisy = NodeCore("a", shard, ACCEPT_ALL, rng=make_rng(4))
    raw = NodeCore("b", shard, ACCEPT_ALL, rng=make_rng(5))
    priv, pub = generate_keypair()
    x = xs_history(1)[0]
    q_noisy = opened(
        noisy.handle(pb.Invitation(spec=spec(UNTRUSTED, x, x, pub, sigma=sigma), user_ids=shard.user_ids)), priv
    )
    q = opened(raw.handle(pb.Invitation(spec=spec(TRUSTED, x, x, pub, sigma=sigma), user_ids=shard.user_ids)), priv)
    Z = (q_noisy - q) / sigma
    assert stats.kstest((Z**2).sum(axis=1), stats.chi2(D).cdf).pvalue > 1e-3
    assert abs(Z[:, 0].mean() * np.sqrt(n)) < 4.0


def test_server_update_stays_in_the_ball_and_x_is_the_anytime_average_of_w():
    """Property 2: x_t in K and x_t = sum_tau tau w_tau / (t(t+1)/2) (alpha_t = t)."""
    rng = make_rng(8)
    opt = mu2(learning_rate=0.7, radius=1.0)
    state = opt.init(rng.normal(size=D) * 5)
    ws = [state.w]
    for _ in range(12):
        params = opt.query(state)
        assert params.shape == (2, D) and np.array_equal(params[0], state.x)
        _, state = opt.step(rng.normal(size=D) * 3, state, params)
        ws.append(state.w)
        assert np.linalg.norm(state.x) <= 1.0 + 1e-12 and np.linalg.norm(state.w) <= 1.0 + 1e-12
        t = state.t - 1  # x_t after t steps... x_{t+1} = weighted mean of w_1..w_{t+1}
        weights = np.arange(1, t + 2, dtype=float)
        np.testing.assert_allclose(state.x, (weights[:, None] * np.array(ws)).sum(0) / weights.sum(), atol=1e-12)


@pytest.mark.parametrize("protocol", [UNTRUSTED, TRUSTED])
def test_plan_spends_the_budget_with_the_papers_noise(protocol):
    """sigma = 2S sqrt(T)/rho (/M trusted) with rho the inverse of (eps, delta) under the figure proven for the noise
    (issue 24 D19: discrete, the default, the RDP conversion; continuous, the exact curve): T rounds spend eps to
    1e-6, never above; a given noise multiplier that does not fit is refused."""
    M, T, S = 10, 50, 0.8
    req = PlanRequest("fully_interactive", 2.0, 1e-5, T, M, M, D, S, "sealed", M, T)
    sigmas = {}
    for noise, method in (("discrete", "rdp"), ("continuous", "exact")):
        plan = protocol.plan(replace(req, settings=Mu2Settings(noise=None if noise == "discrete" else noise)))
        p = plan.params
        assert p["noise"] == noise
        rho = gaussian.rho_for_epsilon(2.0, 1e-5, method)
        assert p["sigma"] == pytest.approx(gaussian.theorem_sigma(S, T, rho, M, protocol.trusted), rel=1e-8)
        assert p["sensitivity"] == pytest.approx(2 * S / (M if protocol.trusted else 1), rel=1e-15)
        eps = mu2_epsilon(p["sigma"], p["sensitivity"], protocol.trust, T, 1e-5, noise)
        assert 2.0 * (1 - 1e-6) <= eps <= 2.0
        assert plan.min_contributors == M and plan.rounds == T
        z = p["sigma"] / p["sensitivity"]
        with pytest.raises(ValueError, match="spends eps"):
            protocol.plan(replace(req, settings=Mu2Settings(noise_multiplier=z * 0.99, noise=noise)))
        sigmas[noise] = p["sigma"]
    # the discrete figure is never below the exact one, so the same budget needs more noise
    assert sigmas["discrete"] > sigmas["continuous"]
    assert mu2_epsilon(sigmas["continuous"], 1.6, protocol.trust, T, 1e-5) > mu2_epsilon(
        sigmas["continuous"], 1.6, protocol.trust, T, 1e-5, "continuous"
    )


def test_config_checks_the_mu2_combinations():
    base = '[data]\nexamples_per_user = 20\n[privacy]\nprotocol = "mu2_untrusted"\n[transport]\nmode = "sealed"\n'
    cfg = parse_config(base + "[schedule]\nrounds = 20\n")
    assert cfg.privacy.protocol == "mu2_untrusted"
    with pytest.raises(ConfigError, match="examples_per_user = 20 must be >= schedule.rounds = 21"):
        parse_config(base + "[schedule]\nrounds = 21\n")
    with pytest.raises(ConfigError, match="needs schedule.rounds"):
        parse_config(base)
    with pytest.raises(
        ConfigError, match='optimizer = "pgd" runs over privacy.protocol = "pvec"; "mu2_untrusted" feeds'
    ):
        parse_config(base + '[schedule]\nrounds = 20\noptimizer = "pgd"\n')
    with pytest.raises(ConfigError, match='"sealed"'):
        parse_config(base.replace('"sealed"', '"counts"') + "[schedule]\nrounds = 20\n")


# ------------------------------------------------------------------------------------ over real services
class ZeroNoise:
    """A dishonest machine's randomness: its noise is switched off (see _noise_off)."""


@pytest.fixture
def _noise_off(monkeypatch):
    """The machine whose rng is a ZeroNoise releases its q_t as is (the others the real discrete Gaussian)."""
    real = mu2_round.discrete_gaussian.release_on_grid

    def release(x, std, sensitivity, rng, granularity=None, noise="discrete"):
        if isinstance(rng, ZeroNoise):
            return np.asarray(x, dtype=np.float64)
        return real(x, std, sensitivity, rng, granularity, noise=noise)

    monkeypatch.setattr(mu2_round.discrete_gaussian, "release_on_grid", release)


@pytest.mark.usefixtures("_noise_off")
def test_untrusted_analyzer_never_gets_a_noiseless_message_unless_the_machine_drops_its_noise():
    """Trust boundary (untrusted server): the test plays the analyzer over a real shuffler with two real nodes. The
    honest machines' opened messages differ from their q_t by noise of the spec's std (||.||^2/sigma^2 within the
    chi2_d 0.999 quantile); the machine whose noise is off is received bit for bit equal to its q_t."""
    shuffler, port = start_shuffler("127.0.0.1:0")
    addr = f"127.0.0.1:{port}"
    shard = stream_shard(3, 2, seed=11)
    honest = UserShard(shard.user_ids[:2], shard.X[:2], shard.y[:2])
    bad = UserShard(["m2"], shard.X[2:], shard.y[2:])
    nodes = [
        start_node_with_shard("honest", honest, addr, policy=ACCEPT_ALL, rng=make_rng(1)),
        start_node_with_shard("bad", bad, addr, policy=ACCEPT_ALL, rng=ZeroNoise()),
    ]
    channel = grpc.insecure_channel(addr)
    try:
        stub = pbg.ShufflerStub(channel)
        end = time.monotonic() + 10
        while stub.GetPopulation(pb.PopulationRequest(run_id="run"), timeout=5).admitted_users < 3:
            assert time.monotonic() < end
            time.sleep(0.02)
        priv, pub = generate_keypair()
        x = xs_history(1)[0]
        sigma = 3.0
        batch = stub.ExecuteRound(spec(UNTRUSTED, x, x, pub, sigma=sigma, M=3), timeout=30)
        assert batch.released and len(batch.ciphertexts) == 3
        got = [np.frombuffer(open_sealed(priv, c, round_info("run", 0)), dtype=WIRE) for c in batch.ciphertexts]
        q = [grad(shard.X[i, 0], x, shard.y[i, 0]) for i in range(3)]
        exact = [g for g in got if any(np.array_equal(g, qi) for qi in q)]
        assert len(exact) == 1 and np.array_equal(exact[0], q[2])  # only the machine without noise
        noisy = [g for g in got if not any(np.array_equal(g, qi) for qi in q)]
        limit = stats.chi2(D).ppf(0.999)
        for g in noisy:
            assert min(np.sum((g - qi) ** 2) / sigma**2 for qi in q[:2]) < limit
            assert np.sum((g - q[2]) ** 2) > 0
    finally:
        for nd in nodes:
            nd.stop()
        channel.close()
        shuffler.stop(0)


_RUN = """
[data]
dataset = "digits"
examples_per_user = {T}
max_users = {M}
[model]
task = "logreg"
[privacy]
eps = 2.0
delta = 1e-5
protocol = "{protocol}"
clip_norm = 1.0
[privacy.{protocol}]
{privacy}
[schedule]
kind = "fully_interactive"
rounds = {T}
learning_rate = 0.002
[transport]
mode = "sealed"
[deployment]
client_nodes = 2
round_deadline_seconds = 20.0
"""


def _account_cli(params: dict, trust: str, rounds: int) -> float:
    argv = ["gaussian", "--sigma", repr(params["sigma"]), "--lipschitz-increment", repr(params["clip"])]
    argv += ["--machines", str(params["machines"]), "--trust", trust, "--rounds", str(rounds), "--delta", "1e-05"]
    proc = subprocess.run(
        [sys.executable, "-m", "shuffledp.cli", "account", *argv, "--json"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["eps"]


@pytest.mark.parametrize("protocol, trust", [("mu2_untrusted", "local"), ("mu2_trusted", "central")])
def test_runs_over_real_processes_charge_what_the_account_cli_says(tmp_path: Path, protocol, trust):
    M, T = 6, 30
    ledger, metrics, out = run_cli(tmp_path, protocol, _RUN.format(T=T, M=M, protocol=protocol, privacy=""))
    run = ledger["run"]
    assert run["state"] == "COMPLETED" and ledger["totals"]["trust_model"] == trust
    assert len(metrics) == T and all(m["contributors"] == M and m["released"] for m in metrics)
    params = run["plan"]["params"]
    assert params["machines"] == M and run["plan"]["optimizer"]["name"] == "mu2"
    assert params["noise"] == "discrete"  # the default, charged the RDP conversion (issue 24 D19), as the CLI's default
    eps = ledger["totals"]["eps_spent"]
    assert eps == pytest.approx(_account_cli(params, trust, T), rel=1e-9, abs=1e-9)
    assert 2.0 * (1 - 1e-6) <= eps <= 2.0
    # x stays in K (radius 10): the released model is a finite point of the ball (learning: benchmarks/mu2_pnsgd.py)
    assert all(np.isfinite(m["loss"]) for m in metrics)


def test_trusted_machines_show_the_shuffler_only_ciphertexts_and_an_unaffordable_run_is_refused_first(tmp_path):
    """Trusted server: every message the shuffler received is one ciphertext of the sealed length of 8 d bytes.
    A run whose noise multiplier would exceed the budget fails at planning: no round is reserved, no node invited."""
    recorder = Recorder()
    shuffler, sport = start_shuffler("127.0.0.1:0", interceptors=[recorder])
    analyzer, aport = start_analyzer("127.0.0.1:0", f"127.0.0.1:{sport}", tmp_path / "state")
    channel = grpc.insecure_channel(f"127.0.0.1:{aport}")
    M, T = 4, 5
    toml = _RUN.format(T=T, M=M, protocol="mu2_trusted", privacy="")
    cfg = parse_config(toml)
    nodes = [start_node(f"n{i}", cfg, i, 2, f"127.0.0.1:{sport}") for i in range(2)]
    try:
        stub = pbg.AnalyzerStub(channel)
        too_weak = _RUN.format(T=T, M=M, protocol="mu2_trusted", privacy="noise_multiplier = 0.01")
        bad = stub.CreateRun(pb.CreateRunRequest(config_toml=too_weak)).run_id
        stub.StartRun(pb.RunRef(run_id=bad))
        st = wait_for_run(stub, bad, timeout=60)
        assert st.state == pb.FAILED and "spends eps" in st.message
        assert Ledger(tmp_path / "state" / LEDGER_FILE).rounds(bad) == []
        assert recorder.contributions == [] and all(n.core.status().rounds_joined == 0 for n in nodes)
        good = stub.CreateRun(pb.CreateRunRequest(config_toml=toml)).run_id
        stub.StartRun(pb.RunRef(run_id=good))
        st = wait_for_run(stub, good, timeout=120)
        assert st.state == pb.COMPLETED, st.message
        msgs = [m for c in recorder.contributions for m in c.messages]
        assert len(msgs) == M * T
        assert all(m.WhichOneof("payload") == "sealed" and len(m.sealed.ciphertexts) == 1 for m in msgs)
        assert all(len(m.sealed.ciphertexts[0]) == sealed_length(8 * 650) for m in msgs)  # digits logreg: d = 650
    finally:
        for n in nodes:
            n.stop()
        channel.close()
        analyzer.stop(0)
        shuffler.stop(0)


def test_a_machine_certifies_a_round_at_no_more_machines_than_the_spec_can_have():
    # a threshold above the spec's own cohort (a lying shuffler or analyzer) had the machine certify the sensitivity
    # 2S/M of the trusted average (Alg 2) for more machines than can contribute; it certifies at
    # M = min(min_contributors, cohort_size)
    _, key = generate_keypair()
    x = np.zeros(D)
    honest = spec(TRUSTED, x, x, key, clip=1.0, sigma=2.0, M=3)
    claimed = spec(TRUSTED, x, x, key, clip=1.0, sigma=2.0, M=8)
    lying = spec(TRUSTED, x, x, key, clip=1.0, sigma=2.0, M=8)
    lying.cohort_size = 3
    assert TRUSTED.verify_epsilon(claimed) < 0.9 * TRUSTED.verify_epsilon(honest)  # the lie would pay less
    assert TRUSTED.verify_epsilon(lying) == TRUSTED.verify_epsilon(honest)
