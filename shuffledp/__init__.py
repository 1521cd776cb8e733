"""shuffledp: differentially private federated training in the shuffle model.

Client nodes (`shuffledp.clients`), the shuffler and the analyzer (`shuffledp.services`) are gRPC services over
one core that both kinds of party import. The core's floors, lowest first; a module imports only from its own floor
or the ones below it (tests/test_layers.py reads every import and fails on one that climbs):

1. foundation: `settings` (typed config tables), `lazy`, `durable` (crash-safe SQLite), `v1` (generated wire code)
2. `security`: the CSPRNG, HPKE sealing, the PKI
3. `mechanisms`: randomizers, their decoders, central noise (no wire, no party, no accountant)
4. `accountants`: privacy events and what they cost
5. `models`: losses and model plug-ins
6. `optimizers`: SGD, AGD (AC-SA), FTRL and their theory, as pure functions
7. `protocols`: a round of each seed protocol on the wire (one module each, registered in `protocols.registry`)
8. `config`, `data`: the experiment's TOML and its data sets
9. `planning`: a run's plan (rounds, cohort, learning rate, radius, protocol parameters), computed once
10. `transport`: gRPC options, mutual TLS, signed round specs, health
11. the parties: `services` (shuffler, analyzer) and `clients` (nodes, devices); neither imports the other
12. `observability`: metrics, TensorBoard tracking, the live view
13. `cli`, `api`: the `shuffledp` command and the Python API

Old import paths of modules that moved (issue 47) still work for one release, with a DeprecationWarning
(`shuffledp._moved`).
"""

from shuffledp import _moved

__version__ = "0.1.0"

_moved.install()
