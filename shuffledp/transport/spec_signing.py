"""Round specs signed by the analyzer, verified by every node (issue 43 item 1; design 2, "shuffle" trust model).

Why: the shuffler relays each RoundSpec from the analyzer to the nodes. Unsigned, it could put its own sealing key in
the spec (and read every sealed message with its sender's id) or lower a noise parameter (and make users under-record
their spend). So the analyzer signs the exact bytes it sends with the key of its role certificate, and a node with a
PKI acts only on a spec whose signature verifies under an analyzer-role certificate that its own CA issued.

What the shuffler legitimately supplies is not signed, and selects only within what the signed spec allows:
- ``Invitation.checked_in`` (a check-in's second invitation): the node computes c_min and m from it and the signed
  check-in itself (``second_spec``, mechanisms/check_in.share); any c at or above the signed threshold yields noise of
  at least the signed ``noise_trials``, and the node verifies the round's eps at the floor c_min (release_floor);
- ``Invitation.eligible`` (subsampled rounds): a node refuses a count below the signed ``population``; the cost it
  charges uses the signed rate (k / population or sampling_rate), never the count.

Signature: ECDSA P-256 with SHA-256 (the key type shuffledp.security.pki issues) over a domain tag and the spec's
bytes, so
a signature over a RoundSpec can be taken for nothing else. Insecure mode (no PKI) has no signatures, and nothing
holds against a dishonest shuffler there.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from shuffledp.mechanisms import check_in
from shuffledp.security import pki
from shuffledp.v1 import shuffledp_pb2 as pb

__all__ = ["SIGNATURE_INVALID", "SpecSignatureInvalid", "SpecSigner", "SpecVerifier", "second_spec", "invited_spec"]

SIGNATURE_INVALID = "spec_signature_invalid"  # the Refusal reason every invited user of a node gives
_DOMAIN = b"shuffledp.v1.RoundSpec\x00"
_ALGORITHM = ec.ECDSA(hashes.SHA256())


class SpecSignatureInvalid(ValueError):
    """A spec a node must not act on: unsigned, not signed by an analyzer of its CA, or altered in transit."""


class SpecSigner:
    """The analyzer's signer: its role certificate's key (shuffledp.security.pki issues P-256 keys)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, certificate_der: bytes) -> None:
        self._key = key
        self._certificate = certificate_der

    @classmethod
    def from_pki(cls, pki_dir: str | os.PathLike[str], name: str = "analyzer") -> SpecSigner:
        """The analyzer `name`'s key and certificate, checked by pki.load_party (role, CA, dates, key)."""
        material = pki.load_party(pki_dir, pki.ROLE_ANALYZER, name)
        key = serialization.load_pem_private_key(material.key, password=None)
        cert = x509.load_pem_x509_certificate(material.cert)
        return cls(key, cert.public_bytes(serialization.Encoding.DER))  # type: ignore[arg-type]

    def sign(self, spec: pb.RoundSpec) -> pb.SignedSpec:
        """The spec's bytes, as they will be sent, with their signature and the signer's certificate."""
        if spec.HasField("signed"):
            raise ValueError("a signed spec cannot carry a signature inside")
        data = spec.SerializeToString()
        signature = self._key.sign(_DOMAIN + data, _ALGORITHM)
        return pb.SignedSpec(spec=data, signature=signature, certificate=self._certificate)


class SpecVerifier:
    """A node's check of signed specs against its own CA: the certificate must be issued by that CA, valid now and
    name the analyzer role; the signature must verify over the exact bytes received."""

    def __init__(self, ca: x509.Certificate) -> None:
        self._ca = ca
        self._keys: dict[bytes, tuple[ec.EllipticCurvePublicKey, dt.datetime]] = {}  # verified certs (a few)

    @classmethod
    def from_pki(cls, pki_dir: str | os.PathLike[str]) -> SpecVerifier:
        """With the CA certificate of `pki_dir` (what every party holds)."""
        ca = x509.load_pem_x509_certificate((Path(pki_dir) / pki.CA_CERT_FILE).read_bytes())
        return cls(ca)

    def _public_key(self, der: bytes) -> ec.EllipticCurvePublicKey:
        now = dt.datetime.now(dt.UTC)
        known = self._keys.get(der)
        if known is not None and now <= known[1]:
            return known[0]
        try:
            cert = x509.load_der_x509_certificate(der)
            cert.verify_directly_issued_by(self._ca)
        except (ValueError, TypeError, InvalidSignature):
            raise SpecSignatureInvalid("the signer's certificate is not issued by this node's CA") from None
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise SpecSignatureInvalid("the signer's certificate is not valid now")
        ident = pki.identity_of(cert)
        if ident is None or ident.role != pki.ROLE_ANALYZER:
            raise SpecSignatureInvalid(f"the signer's certificate names {ident}, not an analyzer")
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            raise SpecSignatureInvalid("the signer's certificate has no EC key")
        if len(self._keys) >= 8:  # an analyzer or two per CA; no growth with what a shuffler sends
            self._keys.clear()
        self._keys[der] = (key, cert.not_valid_after_utc)
        return key

    def verify(self, signed: pb.SignedSpec) -> pb.RoundSpec:
        """The RoundSpec the analyzer signed; SpecSignatureInvalid if the signature or its certificate fails."""
        key = self._public_key(bytes(signed.certificate))
        try:
            key.verify(bytes(signed.signature), _DOMAIN + bytes(signed.spec), _ALGORITHM)
        except InvalidSignature:
            raise SpecSignatureInvalid("the spec's signature does not verify (altered in transit)") from None
        try:
            spec = pb.RoundSpec.FromString(bytes(signed.spec))
        except Exception as exc:  # DecodeError: signed garbage is still garbage
            raise SpecSignatureInvalid(f"the signed bytes are not a RoundSpec: {exc}") from None
        if spec.HasField("signed"):
            raise SpecSignatureInvalid("the signed spec carries another signed spec")
        return spec


def second_spec(spec: pb.RoundSpec, checked_in: int) -> pb.RoundSpec:
    """A check-in round's second invitation (RoundSpec.check_in): the spec with c users checked in, its threshold
    c_min and trials per user m from check_in.share, which the shuffler, the analyzer and every node compute alike.
    Raises ValueError when c admits no round (below the threshold)."""
    ci = spec.check_in
    c_min, m = check_in.share(int(ci.noise_trials), float(ci.report_fraction), int(spec.min_contributors), checked_in)
    out = pb.RoundSpec()
    out.CopyFrom(spec)
    out.check_in.checked_in = checked_in
    out.min_contributors = c_min
    out.randomizer.m = m
    if spec.transport == pb.BITS:  # d (g + m) labelled bits per user (Alg 2 of paper 000)
        out.randomizer.messages_per_user = spec.randomizer.dim * (spec.randomizer.g + m)
    return out


def invited_spec(inv: pb.Invitation, verifier: SpecVerifier | None) -> pb.RoundSpec:
    """The spec a node acts on for invitation `inv`. Without a verifier (insecure mode): the relayed spec as it
    came. With one: only what the analyzer signed, and the checked-in count the shuffler supplies (second_spec); a
    relayed plain spec, if any, must be exactly that, or the shuffler tried to make the node act on something else.
    Raises SpecSignatureInvalid."""
    if verifier is None:
        return inv.spec
    if not inv.HasField("signed_spec"):
        raise SpecSignatureInvalid("the invitation's spec is not signed")
    spec = verifier.verify(inv.signed_spec)
    if inv.checked_in:
        if not spec.check_in.noise_trials or spec.check_in.checked_in:
            raise SpecSignatureInvalid("a checked-in count for a round without a signed check-in")
        try:
            spec = second_spec(spec, int(inv.checked_in))
        except ValueError as exc:
            raise SpecSignatureInvalid(f"the checked-in count does not fit the signed check-in: {exc}") from None
    if inv.HasField("spec") and inv.spec != spec:
        raise SpecSignatureInvalid("the relayed spec differs from the signed one")
    return spec
