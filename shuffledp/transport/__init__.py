"""How the parties talk: gRPC limits and options (`grpc_options`), mutual TLS and the role checks on each call
(`tls`), the analyzer's signed round specs (`spec_signing`) and the standard health service (`health`, also the
`shuffledp health` probe).

May import: the foundation, `shuffledp.security`, `shuffledp.mechanisms` (the check-in bounds a signed spec
carries) and the generated wire code. Never a party (`services`, `clients`): both of them build on this.
"""
