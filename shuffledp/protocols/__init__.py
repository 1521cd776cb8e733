"""Round plug-ins: one module per seed protocol (`<name>_round.py`), each a `RoundProtocol` (base.py): its sizing at
planning, the spec's randomizer fields, the node's randomize, the analyzer's decode and the privacy event of a round.
`registry` maps names to plug-ins: adding a protocol is a module and its registry line, never an edit of the round loop.

May import: the foundation, `shuffledp.security` (sealing, the CSPRNG), `shuffledp.mechanisms`,
`shuffledp.accountants`, `shuffledp.models`, `shuffledp.optimizers` and the generated wire code. Never a party: both
kinds of party call into this package.
"""
