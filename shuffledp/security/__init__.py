"""Security primitives every party uses: the CSPRNG (`rng`), HPKE sealing to the analyzer (`sealing`) and the PKI
that names each party (`pki`: a CA, certificates by role, revocation, and the `shuffledp pki` command).

May import: the foundation (`shuffledp.settings`, `shuffledp.durable`, `shuffledp.lazy`, `shuffledp.v1`) and
`cryptography` / randomgen. Nothing here knows a protocol, a mechanism or a party: design section 5.
"""
