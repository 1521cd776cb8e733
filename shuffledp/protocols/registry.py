"""Round protocols by name (design 3.1): every party finds a protocol's plug-in here, never by a branch of its own.

Adding a protocol = one module with a class like shuffledp.protocols.pvec_round.PvecRound, plus one line below.
"""

from __future__ import annotations

from shuffledp.protocols.base import RoundProtocol
from shuffledp.protocols.gaussian_round import GaussianRound
from shuffledp.protocols.ldp_round import LDP_PROTOCOLS, LdpRound
from shuffledp.protocols.mu2_round import Mu2Round
from shuffledp.protocols.pan_round import PanRound
from shuffledp.protocols.pnsgd_round import PnsgdRound
from shuffledp.protocols.pvec_round import PvecRound
from shuffledp.protocols.tree_round import TreeRound

__all__ = ["round_protocol", "ROUND_PROTOCOLS"]

ROUND_PROTOCOLS: dict[str, RoundProtocol] = {
    p.name: p
    for p in (
        PvecRound(),
        *map(LdpRound, LDP_PROTOCOLS),
        TreeRound(),
        GaussianRound(),
        PanRound(),
        Mu2Round(trusted=False),
        Mu2Round(trusted=True),
        PnsgdRound(),
        PnsgdRound(online=True),
    )
}


def round_protocol(name: str) -> RoundProtocol:
    """The plug-in of protocol `name`; LookupError names the known ones."""
    try:
        return ROUND_PROTOCOLS[name]
    except KeyError:
        raise LookupError(f"unknown round protocol {name!r}; known: {', '.join(sorted(ROUND_PROTOCOLS))}") from None
