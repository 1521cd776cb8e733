"""Pan-private AC-SA rounds (paper 000 App C, Alg 6; shuffledp.protocols.pan_round): the accumulator an intruder
reads mid-round is never the clean partial sum, the release carries two independent zeta-Gaussians, bad messages
are never summed, and the ledger charges one zeta-Gaussian per round composed in parallel.

All randomness is seeded (make_rng(seed), test mode). Statistical checks use d = 2000 coordinates of one draw:
a sample variance of m iid normals has relative standard error sqrt(2/m) = 0.032 at m = 2000, so the stated
15% tolerance is about 4.7 standard errors; a sample mean is checked against 4 standard errors.
"""

from __future__ import annotations

import inspect
import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting import gaussian_mechanism as dpa_gaussian
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp
from shuffledp.services.ledger import BudgetLimit, Ledger, PrivacyEvent

from shuffledp.protocols import pan_round, registry
from shuffledp.protocols.base import MALFORMED_PLAINTEXT, UNDECRYPTABLE, BatchError, PlanRequest
from shuffledp.protocols.central import OVER_CLIP_NORM, WIRE_DTYPE
from shuffledp.protocols.pan_round import PanRound, PanSettings, pan_round_epsilon, paper_zeta
from shuffledp.security import sealing
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb

D, B, L, EPS, DELTA = 2000, 8, 1.0, 1.0, 1e-5
RUN, ROUND = "pan-run", 3
VAR_TOL = 0.15  # relative tolerance on a sample variance over D coordinates (about 4.7 standard errors)


def _request(
    kind="sequential", calibration="calibrated", eps=EPS, transport="sealed", dim=D, options=None
) -> PlanRequest:
    own = PanSettings(calibration=calibration, **(options or {}))
    return PlanRequest(kind, eps, DELTA, 10, B, B, dim, L, transport, admitted=10 * B, settings=own)


def _plan(calibration="calibrated", eps=EPS, dim=D, noise=None) -> dict:
    options = {} if noise is None else {"noise": noise}
    sized = PanRound().plan(_request(calibration=calibration, eps=eps, dim=dim, options=options))
    return {"params": sized.params, "composition": sized.composition, "noise_sq": sized.noise_sq}


def _vectors(seed: int, k: int, d: int = D) -> np.ndarray:
    """k test vectors with norms spread over [0.3 L, L] (valid central messages)."""
    rng = make_rng(seed)
    X = rng.standard_normal((k, d))
    X *= (L * rng.uniform(0.3, 1.0, size=k) / np.linalg.norm(X, axis=1))[:, None]
    return X


def _seal_rows(public: bytes, X: np.ndarray, info: bytes) -> list[bytes]:
    return [sealing.seal(public, row.astype(WIRE_DTYPE).tobytes(), info) for row in X]


class _Recorder:
    def __init__(self) -> None:
        self.views: list[np.ndarray] = []

    def __call__(self, acc: np.ndarray) -> None:
        self.views.append(acc)


def _decode(proto: PanRound, cts: list[bytes], params: dict, private, info: bytes):
    rec = _Recorder()
    proto.probe = rec
    dec = proto.decode(pb.ShuffledBatch(ciphertexts=cts), len(cts), {}, params, private, info)
    return dec, rec.views


def intrusion_flags(views: list[np.ndarray], partials: list[np.ndarray], std: float) -> list[int]:
    """Items j whose accumulator does NOT look like (clean partial sum of items 1..j) + N(0, std^2 I): the sample
    variance of the difference outside (1 +- VAR_TOL) std^2, or its mean beyond 4 standard errors. An implementation
    whose intrusion view is (or is close to) the clean partial sum is flagged at every j."""
    flagged = []
    for j, (v, s) in enumerate(zip(views, partials, strict=True)):
        diff = v - s
        var_ok = abs(float(np.var(diff)) / std**2 - 1.0) <= VAR_TOL
        mean_ok = abs(float(np.mean(diff))) <= 4.0 * std / math.sqrt(diff.size)
        if not (var_ok and mean_ok):
            flagged.append(j)
    return flagged


class _CleanStart(PanRound):
    """What the pan-privacy test must catch: an accumulator that starts clean (all noise added at the end)."""

    def _initial_noise(self, d, std, rng, **grid):
        return np.zeros(d)

    def add_noise(self, total, round_index, plan, params, state, rng, used):
        std = params["B"] * params["zeta"]
        out, div, st = super().add_noise(total, round_index, plan, params, state, rng, used)
        return out + std * rng.standard_normal(out.shape), div, st  # same release law, clean state


class _WeakStart(PanRound):
    """A variant whose initial noise is 10x too small: also an intrusion leak the check must flag."""

    def _initial_noise(self, d, std, rng, **grid):
        return super()._initial_noise(d, std / 10.0, rng, **grid)


# ------------------------------------------------------------------------------------- 1. the intrusion view
def test_probe_never_sees_a_clean_partial_sum_and_the_check_catches_a_clean_accumulator():
    params = _plan()["params"]
    std = B * params["zeta"]
    private, public = sealing.generate_keypair()
    info = sealing.round_info(RUN, ROUND)
    X = _vectors(1, B)
    cts = _seal_rows(public, X, info)
    partials = [np.zeros(D), *np.cumsum(X, axis=0)]  # clean partial sums after items 0..B

    dec, views = _decode(PanRound(rng=make_rng(11)), cts, params, private, info)
    assert len(views) == B + 1  # once after the initial draw, once per item
    assert intrusion_flags(views, partials, std) == []
    for v, s in zip(views, partials, strict=True):
        assert np.linalg.norm(v - s) > 0.5 * std * math.sqrt(D)  # far from clean, at every point of the round
    np.testing.assert_allclose(dec.total, views[-1], rtol=0, atol=0)
    assert (dec.used, dec.charged) == (B, B)

    # the same check fails on an implementation that keeps a clean accumulator (issue 12 item 5) ...
    _, clean_views = _decode(_CleanStart(rng=make_rng(11)), cts, params, private, info)
    # it really is the clean sum, up to the items' rounding to the discrete Gaussian's grid (<= g/2 each)
    grid = PanRound._grid(params)
    np.testing.assert_allclose(clean_views[-1], partials[-1], rtol=0, atol=B * grid / 2)
    assert np.all(clean_views[-1] / grid == np.rint(clean_views[-1] / grid))  # and on the grid
    assert intrusion_flags(clean_views, partials, std) == list(range(B + 1))
    # ... and on one whose starting noise is too small to cover a user
    _, weak_views = _decode(_WeakStart(rng=make_rng(11)), cts, params, private, info)
    assert intrusion_flags(weak_views, partials, std) == list(range(B + 1))


def test_decode_forms_no_clean_sum_and_opens_one_message_at_a_time():
    src = inspect.getsource(PanRound.decode) + inspect.getsource(PanRound._add_one)
    assert ".sum(" not in src and "open_each" not in src and "cumsum" not in src


def test_the_default_instance_draws_fresh_csprng_noise_each_round():
    params = _plan(dim=64)["params"]
    private, public = sealing.generate_keypair()
    info = sealing.round_info(RUN, ROUND)
    cts = _seal_rows(public, _vectors(2, 2, 64), info)
    proto = PanRound()  # production path: rng None -> make_rng() per round
    a, _ = _decode(proto, cts, params, private, info)
    b, _ = _decode(proto, cts, params, private, info)
    assert not np.allclose(a.total, b.total)


# --------------------------------------------------------------------------------- 2. the released total
def test_release_is_unbiased_with_two_independent_noises():
    plan = _plan()
    params = plan["params"]
    std = B * params["zeta"]
    assert plan["noise_sq"] == pytest.approx(2 * D * std**2, rel=1e-12)
    private, public = sealing.generate_keypair()
    info = sealing.round_info(RUN, ROUND)
    X = _vectors(3, B)
    clean = np.sum(X, axis=0)
    cts = _seal_rows(public, X, info)
    proto = PanRound(rng=make_rng(21))
    rng2 = make_rng(22)

    dec, views = _decode(proto, cts, params, private, info)
    released, divisor, state = proto.add_noise(dec.total, ROUND, {}, params, None, rng2, dec.used)
    assert divisor == B and state is None
    diff = released - clean
    assert abs(float(np.var(diff)) / (2 * std**2) - 1.0) <= VAR_TOL
    assert abs(float(np.mean(diff))) <= 4.0 * math.sqrt(2) * std / math.sqrt(D)
    z1, z2 = views[0], released - views[-1]
    assert abs(float(np.var(z2)) / std**2 - 1.0) <= VAR_TOL
    assert abs(float(np.corrcoef(z1, z2)[0, 1])) <= 4.0 / math.sqrt(D)  # the second noise is a fresh draw

    # unbiased per coordinate: 10 rounds on the same batch, averaged; each coordinate's mean error is
    # N(0, 2 std^2 / 10), so its sample variance over D coordinates and its overall mean are checked
    R = 10
    avg = np.zeros(D)
    for _ in range(R):
        dec, _ = _decode(proto, cts, params, private, info)
        avg += proto.add_noise(dec.total, ROUND, {}, params, None, rng2, dec.used)[0] / R
    err = avg - clean
    assert abs(float(np.var(err)) / (2 * std**2 / R) - 1.0) <= VAR_TOL
    assert abs(float(np.mean(err))) <= 4.0 * math.sqrt(2 * std**2 / R) / math.sqrt(D)


def test_client_randomize_to_release_round_trip_with_real_sealing():
    plan = _plan(dim=256)
    params = plan["params"]
    proto = PanRound(rng=make_rng(31))
    private, public = sealing.generate_keypair()
    event = PrivacyEvent(proto.name, proto.event_params(plan, ROUND), B, "sequential", "central")
    spec = pb.RoundSpec(run_id=RUN, round=ROUND, **proto.spec_fields(plan, params, event, public))
    assert proto.supports(spec) and spec.transport == pb.SEALED and spec.trust_model == pb.CENTRAL
    assert spec.per_user_cost.eps == pytest.approx(proto.verify_epsilon(spec), abs=0.0)
    assert spec.per_user_cost.eps <= EPS and spec.per_user_cost.delta == DELTA

    G = make_rng(32).standard_normal((B, 256))  # norms ~16: the client clips them to L
    out = pb.Contribution()
    proto.randomize(spec, G, [f"u{i}" for i in range(B)], [bytes(16)] * B, make_rng(33), out)
    cts = [m.sealed.ciphertexts[0] for m in out.messages]
    dec, views = _decode(proto, cts, params, private, sealing.round_info(RUN, ROUND))
    assert dec.used == B and sum(dec.rejected.values()) == 0
    clipped = G * (L / np.linalg.norm(G, axis=1))[:, None]
    # the items are rounded to the discrete Gaussian's grid before they are added (<= g/2 each)
    np.testing.assert_allclose(dec.total - views[0], clipped.sum(axis=0), atol=B * PanRound._grid(params) / 2 + 1e-9)


# ------------------------------------------------------------------------------------ 3. bad messages
def test_bad_messages_are_counted_and_never_summed():
    params = _plan()["params"]
    private, public = sealing.generate_keypair()
    _, other_public = sealing.generate_keypair()
    info = sealing.round_info(RUN, ROUND)
    X = _vectors(4, 5)
    good = _seal_rows(public, X, info)

    def raw(v: np.ndarray) -> bytes:
        return np.asarray(v, dtype=WIRE_DTYPE).tobytes()

    big = np.full(D, 1e6)
    nan = X[0].copy()
    nan[7] = np.nan
    inf = X[1].copy()
    inf[0] = np.inf
    tampered = bytearray(good[2])
    tampered[-1] ^= 1
    bad = [
        sealing.seal(other_public, raw(big), info),  # wrong key
        sealing.seal(public, raw(big), sealing.round_info(RUN, ROUND - 1)),  # replay from another round
        bytes(tampered),  # tampered
        sealing.seal(public, raw(big) + raw(big[:1]), info),  # oversized plaintext
        sealing.seal(public, raw(big)[:-8], info),  # short plaintext
        sealing.seal(public, raw(nan), info),
        sealing.seal(public, raw(inf), info),
        sealing.seal(public, raw(X[3] * 1.5 / np.linalg.norm(X[3])), info),  # 1.5 L: over the clip norm
        sealing.seal(public, raw(big), info),  # huge: over the clip norm
    ]
    order = [good[0], bad[0], bad[1], good[1], bad[2], bad[3], bad[4], good[2], bad[5], bad[6], good[3], bad[7]]
    order += [bad[8], good[4]]
    is_good = [any(c is g for g in good) for c in order]
    batch = pb.ShuffledBatch(ciphertexts=order)
    batch.report.rejected["shuffler_reason"] = 2  # the shuffler's own rejections are carried over
    rec = _Recorder()
    proto = PanRound(rng=make_rng(41), probe=rec)
    dec = proto.decode(batch, len(order), {}, params, private, info)
    assert (dec.used, dec.charged) == (5, len(order))
    assert dec.rejected == {UNDECRYPTABLE: 3, MALFORMED_PLAINTEXT: 4, OVER_CLIP_NORM: 2, "shuffler_reason": 2}
    views = rec.views
    for j, ok in enumerate(is_good, start=1):
        if not ok:
            assert np.array_equal(views[j], views[j - 1]), f"item {j} (a bad message) changed the accumulator"
    np.testing.assert_allclose(dec.total - views[0], X.sum(axis=0), atol=len(X) * PanRound._grid(params) / 2 + 1e-9)
    with pytest.raises(BatchError):
        proto.decode(batch, len(order) + 1, {}, params, private, info)


# ----------------------------------------------------------------------------------------- 4. accounting
def _rdp_epsilon(noise_multiplier: float) -> float:
    """An independent RDP conversion of one Gaussian (dp_accounting's RdpAccountant, its own default orders)."""
    acc = dpa_rdp.RdpAccountant()
    acc.compose(dp_event.GaussianDpEvent(noise_multiplier))
    return acc.get_epsilon(DELTA)


def test_round_cost_is_the_gaussian_calibration_inverse():
    """Continuous noise: the exact curve (Balle-Wang), zeta its least; discrete (the default, issue 24 D19): the RDP
    conversion (CKS20 Thm 14 + Prop 12), never below the exact figure at the same zeta, zeta the least under it."""
    proto = PanRound()
    plan = _plan(noise="continuous")
    p = plan["params"]
    assert plan["composition"] == "parallel" and p["noise"] == "continuous"
    event = PrivacyEvent(proto.name, p, B, "sequential", "central")
    eps_r, delta_r = proto.round_cost(event)
    assert EPS - 1e-9 <= eps_r <= EPS and delta_r == DELTA
    # independent implementation of the same curve (dp_accounting, Balle-Wang): std / sensitivity = B zeta / 2L
    assert eps_r == pytest.approx(dpa_gaussian.get_epsilon_gaussian(B * p["zeta"] / (2 * L), DELTA), abs=1e-8)
    assert pan_round_epsilon(L, B, p["zeta"] * 0.999, DELTA, "continuous") > EPS  # the least that fits

    dplan = _plan()
    dp = dplan["params"]
    assert dp["noise"] == "discrete" and dp["zeta"] > p["zeta"]  # more noise for the same eps: the proven figure
    eps_d = proto.round_cost(PrivacyEvent(proto.name, dp, B, "sequential", "central"))[0]
    assert EPS - 1e-9 <= eps_d <= EPS
    assert pan_round_epsilon(L, B, dp["zeta"] * 0.999, DELTA) > EPS  # the least that fits under the RDP figure
    # at one zeta: exact (continuous) < RDP conversion <= dp_accounting's RDP conversion on its coarser order grid
    z = B * dp["zeta"] / (2 * L)
    exact = dpa_gaussian.get_epsilon_gaussian(z, DELTA)
    assert exact < eps_d <= _rdp_epsilon(z) <= eps_d * (1 + 1e-3)
    assert pan_round_epsilon(L, B, dp["zeta"], DELTA, "continuous") == pytest.approx(exact, abs=1e-8)

    # the paper's zeta (Alg 6 line 1), charged what it really costs: below eps, above the calibrated zeta
    for noise in ("continuous", "discrete"):
        paper = _plan("paper", eps=0.5, noise=noise)["params"]
        assert paper["zeta"] == pytest.approx(math.sqrt(8 * L**2 * math.log(2 / DELTA) / (B**2 * 0.5**2)), rel=1e-12)
        assert paper["zeta"] == paper_zeta(L, B, 0.5, DELTA)
        eps_paper = proto.round_cost(PrivacyEvent(proto.name, paper, B, "sequential", "central"))[0]
        assert eps_paper < 0.5
        z = B * paper["zeta"] / (2 * L)
        expected = dpa_gaussian.get_epsilon_gaussian(z, DELTA) if noise == "continuous" else _rdp_epsilon(z)
        assert eps_paper == pytest.approx(expected, rel=1e-3 if noise == "discrete" else 1e-8)
        assert paper["zeta"] > _plan(eps=0.5, noise=noise)["params"]["zeta"]
    with pytest.raises(ValueError, match="0 < eps < 1"):
        PanRound().plan(_request(calibration="paper", eps=2.0))


def test_rounds_compose_in_parallel_and_the_ledger_charges_one_round(tmp_path, monkeypatch):
    proto = PanRound()
    p = _plan()["params"]
    events = [PrivacyEvent(proto.name, p, B - (i % 2), "sequential", "central") for i in range(6)]
    one = proto.round_cost(events[0])
    limit = BudgetLimit(EPS, DELTA, "parallel")
    assert proto.compose(events, limit) == one
    assert proto.compose(events[:1], limit) == one
    louder = {**p, "zeta": 2 * p["zeta"]}  # a cheaper round does not add to the worst one
    assert proto.compose([*events, PrivacyEvent(proto.name, louder, B, "sequential", "central")], limit) == one

    monkeypatch.setitem(registry._loaded, proto.name, proto)  # this instance is the one the ledger asks
    led = Ledger(tmp_path / "ledger.sqlite")
    led.create_run("r", "# toml")
    led.set_budget("r", limit, {"rounds": 6})
    for r, e in enumerate(events):
        led.reserve("r", r, e)  # BudgetExceeded would mean the rounds were composed sequentially
        led.commit("r", r, e.contributors)
    totals = led.totals("r")
    assert (totals.eps_spent, totals.delta_spent) == one and totals.trust_model == "central"
    assert "pan-private" in totals.accountant and "parallel" in totals.accountant


# --------------------------------------------------------------------------------------- 5. plan refusals
@pytest.mark.parametrize("kind", ["fully_interactive", "subsampled"])
def test_plan_refuses_non_sequential_kinds(kind):
    with pytest.raises(ValueError, match='needs schedule.kind = "sequential"'):
        PanRound().plan(_request(kind=kind))


def test_plan_refuses_other_transports_and_calibrations():
    with pytest.raises(ValueError, match="sealed"):
        PanRound().plan(_request(transport="counts"))
    with pytest.raises(ValueError, match="calibration"):
        PanRound().plan(_request(calibration="exact"))
    sized = PanRound().plan(_request())
    assert sized.min_contributors == B and sized.rounds is None and sized.advanced_slack == 0.0
    json.dumps(sized.params)  # the ledger stores the params as JSON
    assert pan_round.PanRound.name == "pan_gaussian"


def test_pan_private_acsa_over_the_services_stores_only_noised_state(tmp_path):
    """`shuffledp run` of pan-private AC-SA (sequential, sealed vectors, central trust): it completes within its
    budget, and the analyzer's state files hold the ledger and the optimizer's checkpoints only (theta, theta_ag
    and the step: post-processings of the noised releases), no per-round sum or noise state anywhere."""
    import io
    import sqlite3

    from _runs import run_cli

    toml = """
[data]
dataset = "digits"
[privacy]
eps = 4.0
delta = 1e-5
protocol = "pan_gaussian"
[schedule]
kind = "sequential"
optimizer = "acsa"
cohort_size = 100
rounds = 6
[transport]
mode = "sealed"
"""
    ledger, metrics, out = run_cli(tmp_path, "pan", toml)
    assert ledger["run"]["state"] == "COMPLETED" and ledger["totals"]["trust_model"] == "central"
    assert 3.99 < ledger["totals"]["eps_spent"] <= 4.0 and len(metrics) == 6
    assert "pan-private" in ledger["totals"]["accountant"] and "not against the analyzer" in out
    with sqlite3.connect(tmp_path / "pan" / "state" / "ledger.sqlite") as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        blobs = [r[0] for r in db.execute("SELECT blob FROM checkpoints")]
    assert tables == {"runs", "rounds", "checkpoints"}
    assert len(blobs) == 7  # theta_0 and one per round
    for blob in blobs:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            assert set(z.files) == {"steps", "theta", "theta_ag"}, z.files
