"""Cohort selection at the shuffler: who is invited to a round, from the eligible users (shuffler_admission), the
participation record and the round's schedule: disjoint fresh cohorts (SEQUENTIAL), the run's fixed population
(FULLY_INTERACTIVE), a uniform k of n or a Poisson draw from the CSPRNG (SUBSAMPLED), DP-FTRL's per-tree limits
(spec 003 sec 3-4), and the check-in's silent users left out (issue 24 item 4). Issue 47 split it out of the
shuffler's state; the state's lock guards it (every method: caller holds it)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

import numpy as np
from shuffledp.services.participation import ParticipationStore, limits_text
from shuffledp.services.shuffler_admission import Admission, by_node
from shuffledp.services.shuffler_types import CohortUnavailable, Population, RoundRequest, Schedule

__all__ = ["Selection", "Selected", "COHORT_RUNS", "FRESH_MASK_RUNS"]


class Selected(NamedTuple):
    invited: list[str]
    consumed: list[str]  # SEQUENTIAL: the users this round uses up
    population: list[str]  # FULLY_INTERACTIVE, first round: the run's users from now on
    not_in_run: int  # FULLY_INTERACTIVE: connected users outside the run's population, not invited
    drawn_from: int = 0  # SUBSAMPLED: the users the cohort was drawn from
    excluded_silent: int = 0  # check-in rounds: users left out for their silence in an earlier round
    cohort: Cohort | None = None  # FULLY_INTERACTIVE: the run's cohort as kept between rounds (invited is its list)


class Cohort(NamedTuple):
    """A fully interactive run's invitees, kept between its rounds while the eligible users, the run's population
    and its silent users stay the same (the same users every round): built once, not per round (a Python step per
    user each: the population filter, the set, the grouping by node; ~10 % of the shuffler's CPU at 2 x 10^6 users).
    The price: its set stays in memory between rounds (~50 B per invitee), for the last COHORT_RUNS runs."""

    key: Any
    invited: list[str]
    invited_set: frozenset[str]
    by_node: dict[str, list[str]]  # node -> its invited users' keys, in the order of `invited`
    excluded: int  # check-in rounds: users of the run left out for their silence in an earlier round


COHORT_RUNS = 2  # fully interactive runs whose cohort ShufflerState keeps between rounds


FRESH_MASK_RUNS = 8  # runs whose mask of fresh users ShufflerState keeps (one byte per eligible user each)


class _FreshUsers:
    """A run's eligible users not used yet: fresh[i] for eligible[i], for the eligible list of `key` and a used set
    of `used` users; `pending`: the positions of the last cohort drawn and the used count once it is recorded."""

    def __init__(self, key: Any, eligible: list[str], used: AbstractSet[str]) -> None:
        self.key = key
        self.fresh = np.fromiter((u not in used for u in eligible), dtype=bool, count=len(eligible))
        self.used = len(used)
        self.pending: tuple[np.ndarray, int] | None = None


class Selection:
    """Draws each round's cohort; keeps, per run, what makes the next draw cheap (the fresh users' mask, a fully
    interactive run's cohort) and the users a check-in found silent."""

    def __init__(self, admission: Admission, store: ParticipationStore, rng: np.random.Generator) -> None:
        self._admission = admission
        self._store = store
        self._rng = rng
        # check-in rounds (issue 24 item 4): per run, users who checked in and then sent nothing; they are not
        # invited to check in again in that run, so that one silent node cannot hold back every release. Only
        # liveness rests on it (a lost set lets them in again); the noise guarantee rests on c_min and m alone
        self._silent: dict[str, set[str]] = {}
        # per run with used users (sequential), which eligible users are still fresh: _FreshUsers, a few runs only
        self.fresh: OrderedDict[str, _FreshUsers] = OrderedDict()
        self._cohorts: OrderedDict[str, Cohort] = OrderedDict()  # per fully interactive run (Cohort)

    def mark_silent(self, run_id: str, users: list[str]) -> None:
        """Users who checked in and then sent nothing for a whole window: not asked to check in again in the run."""
        self._silent.setdefault(run_id, set()).update(users)

    def population(self, run_id: str) -> Population:
        """Counts for the analyzer (GetPopulation): admitted users on connected nodes, the run's unused ones, the
        connected nodes. Caller holds the lock."""
        eligible = self._admission.eligible_users()
        used = self._store.used_users(run_id) if run_id else set()
        # counted on the run's mask of fresh users (the analyzer asks before every round)
        unused = int(np.count_nonzero(self.fresh_users(run_id, eligible).fresh)) if used else len(eligible)
        return Population(len(eligible), unused, len(self._admission.subs))

    def fresh_users(self, run_id: str, eligible: list[str]) -> _FreshUsers:
        """The run's eligible users not used yet, as a mask over `eligible` (the current _eligible_users list). Kept
        between rounds: a round's cohort is taken off it when its record landed (the used count grew by exactly the
        cohort), and it is built again (a Python step per eligible user) only when the eligible users or the used
        ones changed otherwise. Caller holds the lock."""
        used = self._store.used_users(run_id)
        key = self._admission.eligible_key
        f = self.fresh.get(run_id)
        if f is not None and f.key == key and f.pending is not None and len(used) == f.pending[1]:
            f.fresh[f.pending[0]] = False  # the last cohort drawn from it was recorded as used
            f.used = len(used)
        if f is None or f.key != key or f.used != len(used):
            f = self.fresh[run_id] = _FreshUsers(key, eligible, used)
            while len(self.fresh) > FRESH_MASK_RUNS:
                self.fresh.popitem(last=False)
        self.fresh.move_to_end(run_id)
        f.pending = None
        return f

    def select(self, req: RoundRequest) -> Selected:
        """Who is invited, which sequential users it consumes, the population it fixes. Caller holds the lock."""
        limits_of_run = self._store.run_limits(req.run_id)
        if limits_of_run is not None and limits_of_run != req.limits:  # a spec without them would escape them too
            asks = "none" if req.limits is None else limits_text(req.limits)
            raise ValueError(
                f"run {req.run_id!r} has participation limits {limits_text(limits_of_run)}; this round asks {asks}"
            )
        eligible = self._admission.eligible_users()
        k = req.cohort_size
        if req.schedule == Schedule.FULLY_INTERACTIVE:
            # every user of the run in every round (PGD, Alg 5). The run's users are those connected at its first
            # round: PGD optimises over one fixed data set, and the analyzer sized every round's noise and its
            # contributor bound for that population. A node that joins later is not invited to this run (its
            # users are counted in the report, under NOT_IN_RUN); one that left and came back is.
            fixed = self._store.run_population(req.run_id)
            silent = self._silent.get(req.run_id, set()) if req.check_in_trials else set()
            # the population is fixed once set and the silent set only grows: their sizes name their versions
            version = (self._admission.eligible_key, None if fixed is None else len(fixed), len(silent))
            cohort = self._cohorts.get(req.run_id)
            if cohort is None or cohort.key != version:
                invited = eligible if fixed is None else [u for u in eligible if u in fixed]
                if len(invited) == len(eligible):
                    invited = eligible  # the same users (the usual case): no second list of them
                excluded = 0
                if silent:
                    kept = [u for u in invited if u not in silent]
                    invited, excluded = kept, len(invited) - len(kept)
                # all of the run's population: the set the store keeps of it is this set (invited is a part of it)
                whole = isinstance(fixed, frozenset) and len(invited) == len(fixed)
                invited_set = fixed if whole else frozenset(invited)
                cohort = Cohort(version, invited, invited_set, by_node(invited), excluded)
                self._cohorts[req.run_id] = cohort
                while len(self._cohorts) > COHORT_RUNS:
                    self._cohorts.popitem(last=False)
            self._cohorts.move_to_end(req.run_id)
            invited, excluded = cohort.invited, cohort.excluded
            if not invited:
                raise CohortUnavailable(
                    f"all {excluded} connected users of the run checked in and then sent nothing in an earlier round"
                    if excluded
                    else "no admitted users on connected nodes"
                    if fixed is None
                    else f"none of the run's {len(fixed)} users is connected"
                )
            if k not in (0, len(invited) + excluded):
                raise CohortUnavailable(
                    f"FULLY_INTERACTIVE cohort_size={k} but {len(invited)} admitted users are connected"
                    + ("" if fixed is None else " of the run's population")
                )
            not_in_run = len(eligible) - len(invited) - excluded
            # the first round fixes the population: as the cohort's set, which the store then keeps (frozenset of a
            # frozenset is the same object), so the shuffler holds one set of the run's users, not two
            population = [] if fixed is not None else cohort.invited_set if invited is eligible else eligible
            return Selected(invited, [], population, not_in_run, excluded_silent=excluded, cohort=cohort)
        if req.schedule == Schedule.SUBSAMPLED and len(eligible) < req.population:
            # the accountant's rate k/n (issue 24 item 3): drawing from fewer users would sample each at a higher
            # rate than the round is charged at; refused before anyone is invited
            raise CohortUnavailable(
                f"SUBSAMPLED round is accounted for a population of {req.population} users but only "
                f"{len(eligible)} are eligible"
            )
        if req.sampling_rate > 0.0:
            # each eligible user independently with probability q (CSPRNG): the cohort may be empty
            take = self._rng.random(len(eligible)) < req.sampling_rate
            chosen = [eligible[i] for i in np.flatnonzero(take)]
            return Selected(chosen, [], [], 0, len(eligible))
        if k < 1:
            raise ValueError(f"cohort_size must be >= 1 for {req.schedule.name}, got {k}")
        limited = ""
        fresh = None
        if req.schedule == Schedule.SEQUENTIAL:
            # fresh users only (disjoint cohorts), in eligible order: positions into eligible, no Python step per
            # user (a list of them cost O(n) lookups per round, slower as the used set grew: issue 30 item 4)
            fresh = self.fresh_users(req.run_id, eligible)
            pool = np.flatnonzero(fresh.fresh)
        elif req.limits is not None:
            # DP-FTRL (spec 003 sec 3-4): only users whose leaves in this tree leave room for this one. The limits
            # are the run's from its first round on: the tree accountant's (E, xi) describe every tree
            tree, leaf = req.limits.position(int(req.round))
            leaves = self._store.tree_leaves(req.run_id, tree)
            pool = [u for u in eligible if req.limits.allows(leaves.get(u, ()), leaf)]
            limited = f" under the limits {limits_text(req.limits)} (tree {tree}, round {leaf} in it)"
        else:
            pool = eligible  # SUBSAMPLED: uniform k of n, secret (seed 001)
        if len(pool) < k:
            raise CohortUnavailable(
                f"{req.schedule.name} round needs cohort_size={k} users but only {len(pool)} are eligible{limited}"
            )
        idx = self._rng.choice(len(pool), size=k, replace=False)  # uniform k-subset from the CSPRNG
        if fresh is not None:
            at = pool[np.sort(idx)]
            chosen = [eligible[i] for i in at.tolist()]
            fresh.pending = (at, fresh.used + k)  # taken off the mask once recorded (_fresh_users)
            return Selected(chosen, chosen, [], 0)
        chosen = [pool[i] for i in np.sort(idx)]
        return Selected(chosen, [], [], 0, len(pool))
