"""Device behaviour at scale (issue 44 item 4; Bonawitz et al. 2019 sec 2), with single-user device nodes
(clients/device.py: a Fleet, mTLS, a certificate and a SQLite spend store per device) against a real shuffler and
analyzer (test_device_fleet.Services): devices that drop mid-round (before and after their check-in), stragglers
past the deadline, devices that join during a run, and an over-selected cohort (a round that closes at its report
goal, RoundSpec.report_goal, instead of waiting for the slowest invitee until its deadline). In each, the users' own
accounting stays exact: a device charges its user when it sends a report (whatever the shuffler then does with it),
so every report the ledger used is charged once, a report refused as late (after the deadline, or after the round
closed at its goal) is charged and counted by the ledger as not used, and a user who sent nothing is charged
nothing. The check-in's noise sharing runs as with many users per node: the
m each round ran with is check_in.share's for the users who checked in, and each user's record holds that round's
noise at the threshold c_min the user's device certified.

The acceptance test of issue 44 is the first one; DEVICES is its fleet size."""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from pathlib import Path

from shuffledp.clients.device import Fleet, start_fleet
from shuffledp.services.analyzer import LEDGER_FILE
from shuffledp.services.ledger import Ledger
from shuffledp.services.shuffler_state import (
    Ack,
    RoundRequest,
    Schedule,
    ShufflerState,
    Submission,
    Transport,
    UserColumns,
)
from test_device_fleet import Services

from shuffledp.accountants.calibrated_pvec import round_noise_key
from shuffledp.accountants.pvec_pld import epsilon_of_rounds
from shuffledp.config import parse_config
from shuffledp.mechanisms import check_in
from shuffledp.mechanisms.pvec import PvecParams
from shuffledp.security.rng import make_rng
from shuffledp.v1 import shuffledp_pb2 as pb

# The acceptance test's fleet (issue 44): 1000 devices, each its own certificate, channel and store (~65 s on 2 cores
# under load). The timeouts and the round deadline below grow with it.
DEVICES = 1000


def _config(
    users: int,
    rounds: int,
    *,
    deadline: float = 6.0,
    wait: float = 3.0,
    privacy: str = "",
    pvec: str = "",
    schedule: str = "",
    deployment: str = "",
) -> str:
    """The default protocol (calibrated PVEC with check-in; PGD unless `schedule` says otherwise) on digits, one user
    per device node."""
    return f"""
[data]
dataset = "digits"
max_users = {users}
[privacy]
eps = 8.0
{privacy}
[privacy.pvec]
{pvec}
[schedule]
rounds = {rounds}
{schedule}
[deployment]
client_nodes = {users}
users_per_node = 1
population_wait_seconds = {wait}
round_deadline_seconds = {deadline}
{deployment}"""


def _fleet(services: Services, toml: str, first: int, count: int, users: int) -> Fleet:
    """Devices first .. first + count - 1 of `users` (device i hosts user n<i>-u<i>), each with its certificate."""
    return start_fleet(
        parse_config(toml),
        first,
        count,
        users,
        services.address,
        pki_dir=services.pki,
        state_dir=services.tmp / "nodes",
    )


def _wait_rounds(services: Services, n: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while services.stub.GetRunStatus(pb.RunRef(run_id=services.run_id)).rounds_done < n:
        assert time.monotonic() < end, f"round {n - 1} not done in {timeout} s"
        time.sleep(0.02)


def _ledger(services: Services) -> tuple[dict, list[dict]]:
    """The run's plan and its rounds, as the analyzer's ledger holds them."""
    ledger = Ledger(services.tmp / "state" / LEDGER_FILE)
    try:
        return ledger.run(services.run_id)["plan"], ledger.rounds(services.run_id)
    finally:
        ledger.close()


def _charged_keys(rows: list[dict]) -> dict[int, tuple]:
    """Each committed round's noise key as the ledger charges it: its event's parameters (the m it ran with) at the
    contributors it used (at most the parameters' n, as pvec_round._accounted_round)."""
    out = {}
    for r in rows:
        if r["state"] == "committed":
            params = PvecParams(**r["event"]["params"])
            out[r["round"]] = round_noise_key(params, min(r["event"]["contributors"], params.n))
    return out


def _certified_key(plan: dict, checked_in: int) -> tuple:
    """The noise key a user's device records for a check-in round in which `checked_in` users checked in: the m of
    its second invitation at the threshold c_min (check_in.share), the fewest contributors the round can release
    with (protocols/base.release_floor)."""
    ci = plan["check_in"]
    c_min, m = check_in.share(ci["noise_trials"], ci["report_fraction"], plan["min_contributors"], checked_in)
    p = plan["params"]
    return (m * c_min, float(p["p"]), int(p["g"]), int(p["d"]))


def _histories(services: Services, devices: range) -> dict[int, Counter]:
    return {i: history for i, (_, history) in services.records(devices).items()}


def test_a_fleet_of_single_user_devices_completes_a_check_in_run_with_a_tenth_dropping_mid_round(
    tmp_path: Path,
) -> None:
    """Issue 44's acceptance test: DEVICES single-user device nodes (one fleet, mTLS, one certificate each) run 3
    rounds of the default protocol (calibrated PVEC, check-in, PGD); in round 1 a tenth of them are switched off once
    the round's invitation reached them (they never answer it). Round 1's check-in closes at half its window with the
    other nine tenths, which share the round's noise among them; every round releases. Every user's record, read
    from its device's own store, is the ledger's guarantee for it: the rounds the ledger charged, at the noise each
    ran with, for the rounds that user's report was used in (all 3; round 0 alone for a dropped user).

    report_fraction = 1: each released round's threshold is the users who checked in, so what a device certifies (the
    round at c_min) is what the ledger charges (the round at its contributors) and the two are equal, not only
    ordered. min_contributors_fraction = 0.8 leaves room below the nine tenths."""
    k, rounds = DEVICES, 3
    gone = list(range(0, k, 10))  # a tenth of the devices
    stay = [i for i in range(k) if i not in gone]
    deadline = max(6.0, k / 30)  # the check-in window is half of it
    toml = _config(k, rounds, deadline=deadline, privacy="min_contributors_fraction = 0.8", pvec="report_fraction = 1")
    services = Services(tmp_path, k, processes=True)  # the shuffler and the analyzer: processes of their own
    fleet = _fleet(services, toml, 0, k, k)
    try:
        services.wait_connected(k, timeout=30 + k / 10)
        for i in gone:
            fleet.drop_before_check_in(i, 1)
        services.start_run(toml)
        st = services.wait(timeout=50 + k / 4)
        assert st.state == pb.COMPLETED, st.message
        assert fleet.connected() == len(stay)
        histories = _histories(services, range(k))
    finally:
        fleet.stop()
        services.close()
    n = len(stay)
    assert [(m.checked_in, m.contributors) for m in st.metrics] == [(k, k), (n, n), (n, n)]
    plan, rows = _ledger(services)
    charged = _charged_keys(rows)
    assert sorted(charged) == [0, 1, 2]
    # the check-in shared each round's noise among those who checked in: the m the ledger charged is share()'s
    assert [charged[r] for r in range(rounds)] == [_certified_key(plan, c) for c in (k, n, n)]
    # each user's trials m: the plan's for its threshold, fewer where more users checked in to share the noise
    ms = [r["event"]["params"]["m"] for r in rows]
    assert ms[0] < ms[1] == ms[2] < plan["params"]["m"]
    delta = st.budget.delta_limit
    assert epsilon_of_rounds(Counter(charged.values()), delta) == st.budget.eps_spent  # the ledger's accountant
    for i in stay:
        assert histories[i] == Counter(charged.values()), i
        assert epsilon_of_rounds(histories[i], delta) == st.budget.eps_spent
    for i in gone:
        assert histories[i] == Counter([charged[0]]), i  # charged for round 0, nothing for the round it left
    # nothing used uncharged, nobody charged twice: the charges are exactly the reports the ledger used
    assert sum(sum(h.values()) for h in histories.values()) == sum(r["contributors"] for r in rows) == k + 2 * n


def test_a_tenth_of_the_devices_dropping_after_their_check_in(tmp_path: Path) -> None:
    """20 devices, 3 rounds; 2 of them vanish in round 1 once their check-in reached the shuffler (after it, before
    the round's second invitation). The 18 others report; nothing of the two is used or charged after round 0.

    report_fraction = 0.9: round 1 releases with its threshold c_min = 18 of the 20 checked in, and round 2 goes on
    without the two (not invited to check in again). Each user's record holds each round at the c_min its device
    certified, which is never below what the ledger charged (the round at its contributors: 20 > 18 in round 0)."""
    k, rounds, gone = 20, 3, [4, 13]
    toml = _config(k, rounds, deadline=4.0, pvec="report_fraction = 0.9")
    services = Services(tmp_path, k)
    fleet = _fleet(services, toml, 0, k, k)
    try:
        services.wait_connected(k)
        for i in gone:
            fleet.drop_after_check_in(i, 1)
        services.start_run(toml)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        histories = _histories(services, range(k))
    finally:
        fleet.stop()
        services.close()
    assert [(m.checked_in, m.contributors) for m in st.metrics] == [(k, k), (k, k - 2), (k - 2, k - 2)]
    plan, rows = _ledger(services)
    charged = _charged_keys(rows)
    certified = [_certified_key(plan, c) for c in (k, k, k - 2)]  # c_min = 18 in each round
    for i in range(k):
        want = certified[:1] if i in gone else certified
        assert histories[i] == Counter(want), i
        used = [charged[0]] if i in gone else list(charged.values())
        assert epsilon_of_rounds(histories[i], 1e-3) >= epsilon_of_rounds(Counter(used), 1e-3)
    assert certified[1:] == [charged[1], charged[2]]  # 18 contributors: what the devices certified
    assert certified[0][0] < charged[0][0]  # 20 contributors where 18 were certified: the ledger's is tighter
    assert sum(sum(h.values()) for h in histories.values()) == sum(r["contributors"] for r in rows) == k + 2 * (k - 2)


def test_a_round_whose_checked_in_devices_drop_below_its_threshold_charges_what_was_sent_and_uses_nothing(
    tmp_path: Path,
) -> None:
    """As above with report_fraction = 0.99: round 1's threshold is c_min = 20 of 20 checked in, so with 2 gone after
    their check-in it releases nothing. The 18 who reported were charged when they sent (a report that may have
    arrived is spent) though the ledger used none of it (round 1 is released in the ledger, not committed); the two
    who vanished sent no report and are not charged for round 1. Round 2 runs with the 18 and releases."""
    k, rounds, gone = 20, 3, [4, 13]
    toml = _config(k, rounds, deadline=4.0)
    services = Services(tmp_path, k)
    fleet = _fleet(services, toml, 0, k, k)
    try:
        services.wait_connected(k)
        for i in gone:
            fleet.drop_after_check_in(i, 1)
        services.start_run(toml)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        histories = _histories(services, range(k))
    finally:
        fleet.stop()
        services.close()
    assert [(m.checked_in, m.contributors, m.released) for m in st.metrics] == [
        (k, k, True),
        (k, k - 2, False),
        (k - 2, k - 2, True),
    ]
    plan, rows = _ledger(services)
    assert [r["state"] for r in rows] == ["committed", "released", "committed"]
    charged = _charged_keys(rows)
    certified = [_certified_key(plan, c) for c in (k, k, k - 2)]
    assert [charged[0], charged[2]] == [certified[0], certified[2]]
    for i in range(k):
        assert histories[i] == Counter(certified[:1] if i in gone else certified), i
    used = sum(r["contributors"] for r in rows if r["state"] == "committed")
    assert used == 2 * k - 2
    # every used report charged once; round 1's 18 reports charged and unused
    assert sum(sum(h.values()) for h in histories.values()) == used + (k - 2)


def test_stragglers_past_the_deadline_are_refused_as_expired_and_charged_for_what_they_sent(tmp_path: Path) -> None:
    """20 devices, 3 rounds of 4 s. In round 1 two devices' reports leave 3 s after the round's second invitation,
    after the round's deadline: the shuffler refuses them as expired_round and the ledger counts 17 contributors;
    each of the two was charged when it computed its report, so its record holds round 1 though the report was not
    used, and not round 2 (it was silent after checking in: not invited to check in again in this run). A third
    device's check-in leaves 3 s late, after the check-in window (half the deadline) but before the deadline: it is
    refused as late (expired_round; the second invitation went to those who had checked in), costs nothing, and that
    device joins round 2 as usual."""
    k, rounds, late, late_check_in = 20, 3, [3, 11], 5
    deadline = 4.0
    toml = _config(
        k, rounds, deadline=deadline, privacy="min_contributors_fraction = 0.8", pvec="report_fraction = 0.8"
    )
    services = Services(tmp_path, k)
    fleet = _fleet(services, toml, 0, k, k)
    try:
        services.wait_connected(k)
        for i in late:
            fleet.straggle(i, 1, 0.75 * deadline)
        fleet.straggle(late_check_in, 1, 0.75 * deadline, check_in=True)
        services.start_run(toml)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        time.sleep(0.75 * deadline)  # the late reports of round 1 arrive (round 2 took less than that)
        counters = services.state.counters()
        histories = _histories(services, range(k))
    finally:
        fleet.stop()
        services.close()
    assert [(m.checked_in, m.contributors) for m in st.metrics] == [(k, k), (k - 1, k - 3), (k - 2, k - 2)]
    # the two reports, the refusal each device sent after its report was refused (both too late), the late check-in
    assert counters["expired_round"] == 2 * len(late) + 1
    assert "not_invited" not in counters  # the late check-in is an invitee's: late, not a stranger's
    plan, rows = _ledger(services)
    charged = _charged_keys(rows)
    assert [r["contributors"] for r in rows] == [k, k - 3, k - 2]
    certified = [_certified_key(plan, c) for c in (k, k - 1, k - 2)]
    for i in range(k):
        rounds_sent = [0, 1] if i in late else [0, 2] if i == late_check_in else [0, 1, 2]
        assert histories[i] == Counter(certified[r] for r in rounds_sent), i
        used = [charged[r] for r in rounds_sent if not (i in late and r == 1)]
        assert epsilon_of_rounds(histories[i], 1e-3) >= epsilon_of_rounds(Counter(used), 1e-3)
    # every charge is a report the ledger used, or one of the two refused as expired
    assert sum(sum(h.values()) for h in histories.values()) == sum(r["contributors"] for r in rows) + len(late)


def test_devices_that_join_a_sequential_run_are_invited_to_its_later_rounds(tmp_path: Path) -> None:
    """A sequential (PSGD) check-in run with cohorts of 8 is planned on the 24 devices connected at its start (3
    rounds); a fleet of 16 more devices starts once round 0 is done (rounds start 3 s apart). Its users are fresh
    users of the run: rounds 1 and 2 draw their cohorts from the 16 unused first devices and the 16 new ones, and
    new ones are drawn. Every user is charged at most once (disjoint cohorts), exactly for the round it reported in,
    at the noise the ledger charged for it."""
    first, joined, cohort = 24, 16, 8
    users = first + joined
    toml = _config(
        users,
        3,
        wait=1.0,
        schedule=f'kind = "sequential"\ncohort_size = {cohort}',
        deployment="min_round_seconds = 3",
    ).replace(f"client_nodes = {users}", f"client_nodes = {first}")
    services = Services(tmp_path, users)
    fleets = [_fleet(services, toml, 0, first, users)]
    try:
        services.wait_connected(first)
        services.start_run(toml)
        _wait_rounds(services, 1)
        fleets.append(_fleet(services, toml, first, joined, users))
        services.wait_connected(users)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        histories = _histories(services, range(users))
    finally:
        for fleet in fleets:
            fleet.stop()
        services.close()
    assert [(m.checked_in, m.contributors) for m in st.metrics] == [(cohort, cohort)] * 3
    plan, rows = _ledger(services)
    assert plan["rounds"] == 3 and plan["admitted"] == first  # planned on the devices connected at the start
    charged = _charged_keys(rows)
    assert len(set(charged.values())) == 1  # the same noise each round, cohort = threshold = contributors
    key = charged[0]
    assert all(h in (Counter(), Counter([key])) for h in histories.values())  # at most once, at the ledger's key
    reported = [i for i, h in histories.items() if h]
    assert len(reported) == 3 * cohort == sum(r["contributors"] for r in rows)
    assert any(i >= first for i in reported)  # the new devices were invited (and reported)


def test_devices_that_join_a_fully_interactive_run_are_not_invited_and_not_charged(tmp_path: Path) -> None:
    """A fully interactive (PGD) check-in run's users are those connected at its first round (its noise and
    contributor bound are sized for them; design and ShufflerState._select). A fleet of 10 more devices that starts
    once round 0 is done is not invited to the run's later rounds: the shuffler counts its users as not_in_run, their
    devices record no charge, and the 20 users of the run record exactly the ledger's guarantee."""
    first, joined, rounds = 20, 10, 3
    users = first + joined
    toml = _config(users, rounds, wait=1.0, deployment="min_round_seconds = 2").replace(
        f"client_nodes = {users}", f"client_nodes = {first}"
    )
    services = Services(tmp_path, users)
    fleets = [_fleet(services, toml, 0, first, users)]
    try:
        services.wait_connected(first)
        services.start_run(toml)
        _wait_rounds(services, 1)
        fleets.append(_fleet(services, toml, first, joined, users))
        services.wait_connected(users)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        assert sum(d.core.refusals.total() for f in fleets for d in f.devices) == 0  # nothing asked of the new ones
        histories = _histories(services, range(users))
    finally:
        for fleet in fleets:
            fleet.stop()
        services.close()
    assert [(m.checked_in, m.contributors) for m in st.metrics] == [(first, first)] * rounds
    assert st.metrics[0].not_in_run == 0 and st.metrics[-1].not_in_run == joined
    _, rows = _ledger(services)
    charged = Counter(_charged_keys(rows).values())
    assert all(histories[i] == charged for i in range(first))
    assert epsilon_of_rounds(charged, st.budget.delta_limit) == st.budget.eps_spent
    assert all(not histories[i] for i in range(first, users))


def _reports_used(state: ShufflerState) -> set[tuple[int, str]]:
    """(round, node id) of every report the shuffler accepted into a round (a check-in carries no payload), as the
    state's submit saw them: a spy on the in-process state the shuffler's servicer calls."""
    used: set[tuple[int, str]] = set()
    submit = state.submit

    def spy(sub: Submission) -> Ack:
        ack = submit(sub)  # raises RoundRejected when the round is closed (expired_round)
        cols = sub.columns
        payload = any(m.counts is not None or m.counts_packed is not None for m in sub.messages) or bool(
            cols is not None and (cols.counts or cols.sums)
        )
        if payload and ack.accepted:
            used.add((int(sub.round), sub.node_id))
        return ack

    state.submit = spy  # type: ignore[method-assign]
    return used


def test_an_over_selected_cohort_closes_at_its_report_goal_and_charges_the_late_reports_to_their_senders(
    tmp_path: Path,
) -> None:
    """Over-selection (Bonawitz et al. 2019 sec 2; RoundSpec.report_goal): a sequential check-in run invites cohorts
    of 20 where a round needs 14 reports (min_contributors_fraction = report_fraction = report_goal_fraction = 0.7:
    threshold, c_min and goal all 14); 40 devices, 2 rounds, a 5 s deadline. Each round closes as soon as its 14th
    report is accepted, not at its deadline. Round 0: all 20 report at once, the first 14 are used and the other 6
    are refused as expired_round. Round 1: 6 devices of its cohort are slow (their reports leave 3.75 s after they
    were computed and charged); the 14 others close the round, and the 6 late reports are refused as expired_round.
    A device charges its user when it sends (whatever the shuffler does with the report), so every user who sent is
    charged once, exactly the round the ledger charged (it released at c_min = 14 contributors, what the devices
    certified); the ledger used the 28 accepted reports and none of the 12 refused ones: every user's record is >=
    the ledger's figure for it, and == for the users whose reports were used."""
    k, cohort, goal, deadline = 40, 20, 14, 5.0
    toml = _config(
        k,
        2,
        deadline=deadline,
        privacy="min_contributors_fraction = 0.7",
        pvec="report_fraction = 0.7",
        schedule=f'kind = "sequential"\ncohort_size = {cohort}\nreport_goal_fraction = 0.7',
        deployment="min_round_seconds = 2",
    )
    services = Services(tmp_path, k)
    used = _reports_used(services.state)
    fleet = _fleet(services, toml, 0, k, k)
    try:
        services.wait_connected(k)
        services.start_run(toml)
        _wait_rounds(services, 1)
        end = time.monotonic() + 5
        # round 0 closed at its 14th report: the other 6 of its cohort may still be computing (and charging) theirs
        while len(second := [i for i, d in enumerate(fleet.devices) if not d.core.rounds_joined]) > k - cohort:
            assert time.monotonic() < end, f"{k - len(second)} of round 0's {cohort} devices sent their reports"
            time.sleep(0.01)
        assert len(second) == cohort  # round 1's cohort: the devices round 0 left unused
        slow = second[: cohort - goal]
        for i in slow:
            fleet.straggle(i, 1, 0.75 * deadline)
        st = services.wait()
        assert st.state == pb.COMPLETED, st.message
        late = 2 * (cohort - goal)  # the 6 refused in each round
        end = time.monotonic() + deadline
        while services.state.counters().get("expired_round", 0) < 2 * late:  # the slow reports arrive, are refused
            assert time.monotonic() < end, services.state.counters()
            time.sleep(0.05)
        counters = services.state.counters()
        histories = _histories(services, range(k))
    finally:
        fleet.stop()
        services.close()
    assert [(m.checked_in, m.contributors) for m in st.metrics] == [(cohort, goal)] * 2
    # closed at the goal: before the slow reports (0.75 x deadline after they were computed), not at the deadline
    assert all(m.seconds < 0.75 * deadline for m in st.metrics), [m.seconds for m in st.metrics]
    # each refused report, and the refusal its device then sent to say why its user is missing
    assert counters["expired_round"] == 2 * late
    plan, rows = _ledger(services)
    assert plan["report_goal"] == plan["min_contributors"] == goal
    assert [(r["state"], r["contributors"]) for r in rows] == [("committed", goal)] * 2
    charged = _charged_keys(rows)
    certified = [_certified_key(plan, cohort)] * 2  # c = 20 checked in each round: c_min = 14
    assert [charged[0], charged[1]] == certified  # released at c_min: the devices certified exactly the ledger's
    used_by_round = [{int(n.rsplit("-", 1)[1]) for r, n in used if r == rnd} for rnd in (0, 1)]
    assert [len(u) for u in used_by_round] == [goal, goal]
    assert used_by_round[1] == set(second) - set(slow)  # the slow ones' reports came after the close
    first = set(range(k)) - set(second)
    for i in range(k):
        rnd = int(i in second)
        assert histories[i] == Counter([certified[rnd]]), i  # every user sent once, charged once
        ledger_figure = Counter([charged[rnd]]) if i in used_by_round[rnd] else Counter()
        assert histories[i] >= ledger_figure, i
        if i in used_by_round[rnd]:
            assert histories[i] == ledger_figure, i
    assert first | set(second) == set(range(k))
    # nothing used uncharged, nobody charged twice: the charges are the reports used plus the refused ones
    assert sum(sum(h.values()) for h in histories.values()) == sum(r["contributors"] for r in rows) + late == k


def test_a_check_in_after_its_window_is_refused_as_late_not_as_from_a_stranger() -> None:
    """Three single-user devices are invited to a check-in round (ShufflerState in this process); two check in, and
    the check-in window (half of the 0.4 s deadline) closes without the third, whose check-in and refusal then
    arrive: each is refused as expired_round, as a late report is. Before, both were counted as not_invited, the
    reason for a stranger's message (a user the round never invited): a straggler looked like a misbehaving node in
    the round's report and the shuffler's counters. A device that registers after the round's selection is still
    not_invited."""
    state = ShufflerState(rng=make_rng(5), poll_seconds=0.005)
    subs = []
    for i in range(3):
        state.register_users(f"client-{i}", [f"n{i}-u{i}"])
        subs.append(state.subscribe(f"client-{i}"))
    req = RoundRequest(
        "run", 0, Schedule.FULLY_INTERACTIVE, Transport.COUNTS, dim=2, g=1, m=2, min_contributors=1,
        deadline_seconds=0.4, check_in_trials=2, check_in_fraction=1.0,
    )  # fmt: skip
    out: list = []
    t = threading.Thread(target=lambda: out.append(state.execute_round(req)))
    t.start()

    def check_in_of(i: int) -> Submission:
        return Submission("run", 0, f"client-{i}", columns=UserColumns([f"n{i}-u{i}"], secrets.token_bytes(16), 16))

    try:
        assert [list(sub.get(5.0).user_ids) for sub in subs] == [[f"n{i}-u{i}"] for i in range(3)]
        assert [state.submit(check_in_of(i)).accepted for i in (0, 1)] == [1, 1]
        assert list(subs[0].get(5.0).user_ids) == ["n0-u0"]  # the second invitation, once the window closed
        assert subs[2].get(0.0) is None  # not invited again
        assert state.submit(check_in_of(2)).rejected == {"expired_round": 1}
        assert state.submit(Submission("run", 0, "client-2", refusals=[("n2-u2", "policy")])).rejected == {
            "expired_round": 1
        }
        state.register_users("client-3", ["n3-u3"])  # joined after the selection: a stranger to this round
        state.subscribe("client-3")
        assert state.submit(check_in_of(3)).rejected == {"not_invited": 1}
        for i in (0, 1):
            state.submit(Submission("run", 0, f"client-{i}", refusals=[(f"n{i}-u{i}", "policy")]))
    finally:
        t.join(10)
    assert out[0].checked_in == 2 and out[0].rejected == {"expired_round": 2, "not_invited": 1}
