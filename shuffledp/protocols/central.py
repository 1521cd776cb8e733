"""The central trust model's transport (design 2 and 5.1): clipped vectors sealed to the analyzer, which adds the noise.

Client: each user clips its gradient to l2 norm C (clip_norm), encodes it as d IEEE-754 float64 big-endian numbers
(8 d bytes: one fixed length per round, so the length says nothing) and seals it to the analyzer's HPKE key with
info = (run, round): one ciphertext per user per round. The shuffler checks the length, permutes the ciphertexts
with the CSPRNG and forwards them without ids (it needs no plug-in: RoundSpec.transport = SEALED).

Analyzer: opens each ciphertext; one that does not open (wrong key, replayed from another round, tampered), has
the wrong length, a non-finite entry or a norm above C is skipped, counted by reason, and never summed (design 5.3).
The sum of the rest is what the protocol's noise is added to (CentralRound subclasses: tree_round, gaussian_round).

The guarantee is against everybody who sees what the analyzer releases (the outside world, the other clients,
the shuffler), NOT against the analyzer: it sees every user's clipped vector. Reports say so (trust "central").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from shuffledp.protocols.base import (
    MALFORMED_PLAINTEXT,
    UNDECRYPTABLE,
    AnalyzerHooks,
    BatchError,
    Decoded,
    open_each,
)
from shuffledp.protocols.ldp_round import clip_rows_in_norm
from shuffledp.security import sealing
from shuffledp.settings import ConfigError, RunConfig, setting
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = [
    "noise_setting",
    "noise_multiplier_setting",
    "check_fixed_cohort",
    "CentralRound",
    "OVER_CLIP_NORM",
    "WIRE_DTYPE",
    "message_bytes",
    "open_vectors",
    "seal_rows",
]

OVER_CLIP_NORM = "over_clip_norm"  # opened and well formed, but longer than the round's clip norm: never summed
WIRE_DTYPE = np.dtype(">f8")
# a vector clipped to C and rounded to float64 has a norm within a few ulps of C; the analyzer accepts that much
_NORM_SLACK = 1e-12


def message_bytes(dim: int) -> int:
    return WIRE_DTYPE.itemsize * int(dim)


def open_vectors(
    batch: pb.ShuffledBatch, n: int, d: int, private_key: Any, info: bytes
) -> tuple[np.ndarray, Counter[str]]:
    """The well-formed vectors of a sealed batch of one message per contributor: (k, d) float64 of those that open
    to d finite float64 values, and the count of the others by reason (design 5.3). BatchError when the batch does
    not hold n ciphertexts (the shuffler broke the protocol)."""
    if len(batch.ciphertexts) != n:
        raise BatchError(n, f"{len(batch.ciphertexts)} ciphertexts do not match {n} contributors (one per user)")
    opened, undecryptable = open_each(private_key, batch.ciphertexts, info)
    good = [p for p in opened if len(p) == message_bytes(d)]
    X = np.frombuffer(b"".join(good), dtype=WIRE_DTYPE).reshape(len(good), d).astype(np.float64)
    finite = np.all(np.isfinite(X), axis=1)
    rejected = Counter({UNDECRYPTABLE: undecryptable, MALFORMED_PLAINTEXT: len(opened) - int(finite.sum())})
    return X[finite], rejected


def seal_rows(
    spec: pb.RoundSpec, X: np.ndarray, user_ids: Sequence[str], nonces: Sequence[bytes], out: pb.Contribution
) -> None:
    """One message per user: its row of X as d big-endian float64, sealed to the analyzer for (run, round)."""
    raw = np.asarray(X, dtype=np.float64).astype(WIRE_DTYPE).tobytes()
    size = message_bytes(X.shape[1])
    info = sealing.round_info(spec.run_id, spec.round)
    cts = sealing.seal_many(spec.analyzer_public_key, [raw[i : i + size] for i in range(0, len(raw), size)], info)
    for u, nonce, ct in zip(user_ids, nonces, cts, strict=True):
        out.messages.add(user_id=u, nonce=nonce, sealed=pb.SealedMessages(ciphertexts=[ct]))


def noise_setting(default_is: str = '"discrete"') -> Any:
    """The `noise` key of a central Gaussian protocol's table (issue 24 D19)."""
    return setting(
        None,
        '"discrete" (exact on a grid, CKS20; charged by its RDP) or "continuous" (charged its exact curve / PLD); '
        f"unset = {default_is}",
        choices=("discrete", "continuous"),  # mechanisms' discrete_gaussian.NOISES
        example="discrete",
    )


def noise_multiplier_setting(what: str = "noise std / clip_norm") -> Any:
    """The `noise_multiplier` key: None = the least that fits (eps, delta), planned by the protocol."""
    return setting(None, f"{what}; unset = the least that fits (eps, delta)", lo=0.0, hi=1e6, lo_open=True, example=4.0)


def check_fixed_cohort(cfg: RunConfig, name: str) -> None:
    """A protocol whose noise is planned for T rounds of k users needs both given."""
    if cfg.schedule.cohort_size < 1 or cfg.schedule.rounds is None:
        raise ConfigError(f'privacy.protocol = "{name}" needs schedule.cohort_size and schedule.rounds')


class CentralRound(AnalyzerHooks):
    """What every central-trust protocol shares: the sealed-vector transport, the client side and the decoder.
    Subclasses size the noise (plan), add it (add_noise) and account it (compose)."""

    trust_model = pb.CENTRAL
    trust = "central"
    transports = ("sealed",)

    def params(self, plan: dict[str, Any]) -> dict[str, Any]:
        return dict(plan["params"])

    def needs_keypair(self, plan: dict[str, Any]) -> bool:
        return True

    def _sealed_fields(self, params: dict[str, Any], key: bytes, extra: dict[str, float]) -> dict[str, Any]:
        return {
            "trust_model": self.trust_model,
            "transport": pb.SEALED,
            "randomizer": pb.RandomizerSpec(
                protocol=self.name,
                clip_norm=params["clip"],
                dim=params["d"],
                messages_per_user=1,
                message_bytes=message_bytes(params["d"]),
                extra=extra,
            ),
            "analyzer_public_key": key,
        }

    def decode(
        self,
        batch: pb.ShuffledBatch,
        n: int,
        plan: dict[str, Any],
        params: dict[str, Any],
        private_key: Any,
        info: bytes,
    ) -> Decoded:
        """Sum of the valid clipped vectors (module docstring); every delivered contributor is charged (a skipped
        message is a zero contribution, which the clip bound covers)."""
        clip = float(params["clip"])
        X, rejected = open_vectors(batch, n, int(params["d"]), private_key, info)
        within = np.linalg.norm(X, axis=1) <= clip * (1.0 + _NORM_SLACK)
        rejected[OVER_CLIP_NORM] += int((~within).sum())
        X = X[within]
        rejected_all = dict(Counter(dict(batch.report.rejected)) + rejected)
        return Decoded(X.sum(axis=0), int(X.shape[0]), n, rejected_all)

    # -------------------------------------------------------------------------------------------- client
    def supports(self, spec: pb.RoundSpec) -> bool:
        r = spec.randomizer
        return spec.transport == pb.SEALED and r.messages_per_user == 1 and r.message_bytes == message_bytes(r.dim)

    def randomize(
        self,
        spec: pb.RoundSpec,
        G: np.ndarray,
        user_ids: Sequence[str],
        nonces: Sequence[bytes],
        rng: np.random.Generator,
        out: pb.Contribution,
    ) -> None:
        """Clip (central trust: no local noise) and seal each user's vector."""
        seal_rows(spec, clip_rows_in_norm(G, float(spec.randomizer.clip_norm), 2), user_ids, nonces, out)

    def noise_key(self, spec: pb.RoundSpec) -> None:
        return None  # users compose central rounds by basic composition of the claims
