"""shuffledp: differentially private federated training in the shuffle model.

The core package is imported by both the client nodes and the analyzer: randomizers, their decoders and the
central noise (`shuffledp.mechanisms`), the round plug-ins that put them on the wire (`shuffledp.protocols`),
accountants (`shuffledp.accountants`), optimizers (`shuffledp.optimizers`), the CSPRNG (`shuffledp.rng`) and the
generated wire contract (`shuffledp.v1`).
"""

__version__ = "0.1.0"
