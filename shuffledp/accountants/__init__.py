"""Accountants: what a privacy event costs, (eps, delta) from its parameters, and a run's composition.

`events` describes what a round did as data (modelled on dp_accounting's DpEvent); the other modules interpret events
(`ledger_accounting` for the analyzer's ledger, one module per protocol's arithmetic) with dp_accounting's RDP and PLD
where they apply. Every figure is rounded up, never down (`rdp.round_up`).

May import: the foundation (`shuffledp.lazy`, `shuffledp.settings`) and `shuffledp.mechanisms` (a mechanism's
parameter types). Never a round plug-in, the wire, a party or a model: the plug-ins, the ledger and the nodes' policies
import this package, never the other way round.
"""
