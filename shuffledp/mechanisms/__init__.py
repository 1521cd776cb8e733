"""Pure mechanisms: randomizers, their decoders, the central noise, and their parameter types.

A module here imports no wire (shuffledp.v1), no sealing, no party (services/, clients/) and no round plug-in
(shuffledp.protocols): the plug-ins and the accountants import it, never the other way round.
"""
