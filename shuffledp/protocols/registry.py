"""Round protocols by name (design 3.1): every party finds a protocol's plug-in here, never by a branch of its own.

Adding a protocol = one module with a class like shuffledp.protocols.pvec_round.PvecRound, plus one line below.
A plug-in's module is imported when the protocol is first asked for: a party pays only for the protocols (and their
accountants' scipy / dp_accounting imports) its runs use, which is most of a service's start-up time.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from shuffledp.protocols.base import RoundProtocol

__all__ = ["round_protocol", "known_protocol", "PROTOCOL_NAMES"]

# name -> (module in shuffledp.protocols, class, constructor arguments)
_PLUGINS: dict[str, tuple[str, str, tuple[Any, ...]]] = {
    "pvec": ("pvec_round", "PvecRound", ()),
    **{name: ("ldp_round", "LdpRound", (name,)) for name in ("r_inf", "r_one", "privunit", "rr")},
    "tree": ("tree_round", "TreeRound", ()),
    "gaussian": ("gaussian_round", "GaussianRound", ()),
    "pan_gaussian": ("pan_round", "PanRound", ()),
    "mu2_untrusted": ("mu2_round", "Mu2Round", (False,)),
    "mu2_trusted": ("mu2_round", "Mu2Round", (True,)),
    "pnsgd": ("pnsgd_round", "PnsgdRound", (False,)),
    "pnsgd_online": ("pnsgd_round", "PnsgdRound", (True,)),
}
PROTOCOL_NAMES: tuple[str, ...] = tuple(_PLUGINS)

_loaded: dict[str, RoundProtocol] = {}
_lock = threading.Lock()  # gRPC handler threads ask concurrently: one instance per name


def round_protocol(name: str) -> RoundProtocol:
    """The plug-in of protocol `name`; LookupError names the known ones."""
    if name not in _PLUGINS:
        raise LookupError(f"unknown round protocol {name!r}; known: {', '.join(sorted(_PLUGINS))}")
    with _lock:
        if name not in _loaded:
            module, cls, args = _PLUGINS[name]
            plugin = getattr(importlib.import_module(f"shuffledp.protocols.{module}"), cls)(*args)
            if plugin.name != name:  # the table and the plug-in must agree (tests check every entry)
                raise RuntimeError(f"registry entry {name!r} built a plug-in named {plugin.name!r}")
            _loaded[name] = plugin
        return _loaded[name]


def known_protocol(name: str) -> RoundProtocol | None:
    """The plug-in of protocol `name`, None when there is no such protocol (a node refuses such a round)."""
    return round_protocol(name) if name in _PLUGINS else None
