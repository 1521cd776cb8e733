"""Optimizers: SGD, PSGD/PGD, AC-SA (AGD), FTRL, the phased strongly convex reduction, DP-mu2's and PNSGD's updates,
each an `Optimizer` (base.py: init / query / step / release) in a module of its own, with its theory (cohort sizes,
step sizes, excess-risk bounds) as pure functions. `registry` names them and builds the one a plan names; the plan
itself is shuffledp.planning's.

May import: the foundation and `shuffledp.models` (the loss's constants). Never a protocol, the wire or a party.
"""
