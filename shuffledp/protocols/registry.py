"""Round protocols by name (design 3.1): every party finds a protocol's plug-in here, never by a branch of its own.

Adding a protocol = one module with a class like shuffledp.protocols.pvec_round.PvecRound, plus its line in _PLUGINS
and in _DECLARED below. A plug-in's module is imported when the protocol is first asked for: a party pays only for
the protocols (and their accountants' scipy / dp_accounting imports, ~70 MB and ~1 s) its runs use, which is most of
a service's start-up time. What a configuration's error messages say of the other protocols (which table declares a
key, which protocols feed an optimizer or take Poisson sampling) is read from _DECLARED, so that a refused
configuration imports no protocol it does not name; a plug-in that disagrees with its line fails to load.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, NamedTuple

from shuffledp.protocols.base import RoundProtocol
from shuffledp.settings import table_keys

__all__ = [
    "round_protocol",
    "known_protocol",
    "planned_protocol",
    "declared",
    "Declared",
    "PROTOCOL_NAMES",
    "PROTOCOL_SUMMARIES",
]

# name -> (module in shuffledp.protocols, class, constructor arguments, what a user reads in --print-default)
_PLUGINS: dict[str, tuple[str, str, tuple[Any, ...], str]] = {
    "pvec": (
        "pvec_round",
        "PvecRound",
        (),
        "multi-message vector sum over the shuffler (seed 000), counts, prio3 or bits",
    ),
    "r_inf": ("ldp_round", "LdpRound", ("r_inf",), "eps0-LDP report, l_inf clip, subsampled shuffle (CLDP-SGD, 001)"),
    "r_one": ("ldp_round", "LdpRound", ("r_one",), "eps0-LDP report, l_1 clip, subsampled shuffle (CLDP-SGD, 001)"),
    "privunit": ("ldp_round", "LdpRound", ("privunit",), "eps0-LDP report, l_2 (PrivUnit), subsampled shuffle (001)"),
    "rr": ("ldp_round", "LdpRound", ("rr",), "eps0-LDP randomized response, one-number tasks (001)"),
    "tree": ("tree_round", "TreeRound", (), "DP-FTRL, central noise by tree aggregation (seed 003)"),
    "mf": ("mf_round", "MfRound", (), "DP-FTRL, central noise by matrix factorization, BLT or banded (issue 27)"),
    "gaussian": ("gaussian_round", "GaussianRound", (), "central DP-SGD, DP-FTRL's baseline (003)"),
    "pan_gaussian": ("pan_round", "PanRound", (), "pan-private AC-SA, sequential (seed 000 App C)"),
    "mu2_untrusted": ("mu2_round", "Mu2Round", (False,), "DP-mu2-FL, noise added by each machine (seed 002)"),
    "mu2_trusted": ("mu2_round", "Mu2Round", (True,), "DP-mu2-FL, noise added by the analyzer (002)"),
    "pnsgd": ("pnsgd_round", "PnsgdRound", (False,), "shuffled projected noisy SGD, one pass (seed 004)"),
    "pnsgd_online": ("pnsgd_round", "PnsgdRound", (True,), "the same pass in arrival order, Thm 7's noise (004)"),
}


class Declared(NamedTuple):
    """What a plug-in declares that configuration messages name, known without importing its module."""

    keys: frozenset[str]  # its table [privacy.<name>] (table_keys of its settings)
    optimizers: tuple[str, ...]  # the schedule.optimizer values it feeds (its optimizers)
    poisson_sampling: bool  # its poisson_sampling


_LDP = Declared(frozenset({"eps0"}), ("sgd",), False)
_NOISE = frozenset({"noise", "noise_multiplier"})
_FTRL = frozenset({"max_participations", "min_separation"}) | _NOISE
_DECLARED: dict[str, Declared] = {
    "pvec": Declared(
        frozenset({"aggregation", "prio3_vdaf", "calibration", "check_in", "report_fraction", "round_eps"}),
        ("psgd", "acsa", "pgd"),
        False,
    ),
    "r_inf": _LDP,
    "r_one": _LDP,
    "privunit": _LDP,
    "rr": _LDP,
    "tree": Declared(_FTRL | {"completion", "rounds_per_tree", "tree_estimator"}, ("ftrl", "sgd"), False),
    "mf": Declared(_FTRL | {"bands", "strategy"}, ("ftrl", "sgd"), False),
    "gaussian": Declared(_NOISE, ("sgd",), True),
    "pan_gaussian": Declared(frozenset({"calibration", "noise", "round_eps"}), ("acsa", "psgd"), False),
    "mu2_untrusted": Declared(_NOISE, ("mu2",), False),
    "mu2_trusted": Declared(_NOISE, ("mu2",), False),
    "pnsgd": Declared(frozenset({"noise_multiplier", "randomly_stopped"}), ("pnsgd",), False),
    "pnsgd_online": Declared(frozenset(), ("pnsgd",), False),
}
if set(_DECLARED) != set(_PLUGINS):
    raise RuntimeError(f"protocols without a _DECLARED line: {sorted(set(_PLUGINS) ^ set(_DECLARED))}")
PROTOCOL_NAMES: tuple[str, ...] = tuple(_PLUGINS)
PROTOCOL_SUMMARIES: dict[str, str] = {name: entry[3] for name, entry in _PLUGINS.items()}

_loaded: dict[str, RoundProtocol] = {}
_lock = threading.Lock()  # gRPC handler threads ask concurrently: one instance per name


def round_protocol(name: str) -> RoundProtocol:
    """The plug-in of protocol `name`; LookupError names the known ones."""
    if name not in _PLUGINS:
        raise LookupError(f"unknown round protocol {name!r}; known: {', '.join(sorted(_PLUGINS))}")
    with _lock:
        if name not in _loaded:
            module, cls, args, _ = _PLUGINS[name]
            plugin = getattr(importlib.import_module(f"shuffledp.protocols.{module}"), cls)(*args)
            if plugin.name != name:  # the table and the plug-in must agree (tests check every entry)
                raise RuntimeError(f"registry entry {name!r} built a plug-in named {plugin.name!r}")
            own = Declared(frozenset(table_keys(plugin.settings)), tuple(plugin.optimizers), plugin.poisson_sampling)
            if own != _DECLARED[name]:
                raise RuntimeError(f"registry entry {name!r}: _DECLARED says {_DECLARED[name]}, the plug-in {own}")
            _loaded[name] = plugin
        return _loaded[name]


def declared(name: str) -> Declared:
    """Protocol `name`'s table keys, optimizers and Poisson sampling, without importing its module (LookupError
    names the known protocols)."""
    if name not in _DECLARED:
        raise LookupError(f"unknown round protocol {name!r}; known: {', '.join(sorted(_PLUGINS))}")
    return _DECLARED[name]


def known_protocol(name: str) -> RoundProtocol | None:
    """The plug-in of protocol `name`, None when there is no such protocol (a node refuses such a round)."""
    return round_protocol(name) if name in _PLUGINS else None


def planned_protocol(plan: dict[str, Any]) -> RoundProtocol:
    """The plug-in of a planned run (its plan's "protocol"; plans written before protocols were plug-ins are PVEC's,
    the one protocol there was)."""
    return round_protocol(plan.get("protocol", "pvec"))
