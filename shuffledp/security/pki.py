"""`shuffledp pki init|issue|revoke`: a private CA, one mTLS certificate per party (design section 7), devices
added later, and a certificate revocation list.

Every certificate carries its party's ROLE twice, so that a server can authorize by role (shuffledp.transport.tls):
subject OU=<role> and a SAN URI spiffe://shuffledp/<role>/<name>. Roles: analyzer, shuffler, client-node
(names client-0, client-1, ...), operator (the person or CLI that creates runs and reads results).

Layout written under --out (what docker-compose mounts; the CA key is mounted nowhere):

    ca.crt                      the CA certificate (trust anchor, public)
    ca/ca.key                   the CA private key (0600, directory 0700)
    <name>/cert.pem, key.pem    one directory per party (key 0600, directory 0700); a device enrolled with a CSR
                                (`pki issue --csr`) has only its cert.pem here: it keeps its key
    crl.pem                     the CA-signed list of revoked certificates (`pki revoke`), read by the shuffler
    pki.json                    manifest: names, roles, serials, fingerprints, expiry
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import ipaddress
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLE_ANALYZER = "analyzer"
ROLE_SHUFFLER = "shuffler"
ROLE_CLIENT_NODE = "client-node"
ROLE_OPERATOR = "operator"
ROLES = (ROLE_ANALYZER, ROLE_SHUFFLER, ROLE_CLIENT_NODE, ROLE_OPERATOR)

SPIFFE_TRUST_DOMAIN = "shuffledp"
ORGANIZATION = "shuffledp"
CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca/ca.key"
MANIFEST_FILE = "pki.json"
CRL_FILE = "crl.pem"
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
# SANs every party gets: processes started by `shuffledp run` talk over loopback
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# one certificate per device (issue 44): deployment.client_nodes allows 10^4, and 10^4 are issued in a few seconds;
# 10^5 bounds one command's run (about a minute) and the manifest (~30 MB). More devices: `pki issue` again, or CSRs
MAX_CLIENT_NODES = 100_000
DEFAULT_DAYS = 365
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a DNS label: also a compose service name


@dataclass(frozen=True)
class Identity:
    """Who a certificate says its holder is."""

    role: str
    name: str


@dataclass(frozen=True)
class IssuedCert:
    """Paths of one party's certificate and key inside a PKI directory."""

    role: str
    name: str
    cert_path: Path
    key_path: Path


def spiffe_uri(role: str, name: str) -> str:
    """The SAN URI that names a party: spiffe://shuffledp/<role>/<name>."""
    return f"spiffe://{SPIFFE_TRUST_DOMAIN}/{role}/{name}"


def client_node_name(index: int) -> str:
    """Compose service / certificate name of client node `index` (client-0, client-1, ...)."""
    return f"client-{index}"


def _check_role_name(role: str, name: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not a shuffledp role; allowed: {', '.join(ROLES)}")
    if not _NAME_RE.match(name):
        raise ValueError(f"name={name!r} is not allowed; use a DNS label (lowercase letters, digits, '-', 1-63 chars)")


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host or len(host) > 253 or not all(_NAME_RE.match(p) for p in host.lower().split(".")):
        raise ValueError(f"hosts entry {host!r} is neither an IP address nor a DNS name")
    return x509.DNSName(host.lower())


def generate_key() -> ec.EllipticCurvePrivateKey:
    """A fresh EC P-256 private key (from the OS CSPRNG, via OpenSSL)."""
    return ec.generate_private_key(ec.SECP256R1())


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    if not isinstance(days, int) or not 1 <= days <= 3650:
        raise ValueError(f"days={days!r} out of range; allowed: integer 1..3650")
    now = dt.datetime.now(dt.UTC)
    # backdate a little: containers' clocks drift, and a cert "not yet valid" fails every handshake
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)


def make_ca(
    common_name: str = "shuffledp CA", days: int = DEFAULT_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate that may sign leaf certificates only (pathlen 0)."""
    key = generate_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    not_before, not_after = _validity(days)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf_subject(role: str, name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )


def _leaf_builder(
    role: str,
    name: str,
    public_key: ec.EllipticCurvePublicKey,
    hosts: Sequence[str],
    days: int,
    until: dt.datetime | None = None,
) -> x509.CertificateBuilder:
    """`until`: the latest not-after (the CA's own, for a certificate added to an existing PKI)."""
    _check_role_name(role, name)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(role, name))]
    for host in dict.fromkeys([name, *LOOPBACK_HOSTS, *hosts]):  # dedupe, keep order
        sans.append(_general_name(host))
    # the operator only ever connects; the three services both serve and connect
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role != ROLE_OPERATOR:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    not_before, not_after = _validity(days)
    if until is not None:
        not_after = min(not_after, until)
    return (
        x509.CertificateBuilder()
        .subject_name(_leaf_subject(role, name))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def issue_cert(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    role: str,
    name: str,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate for party `name` with role `role`, signed by the CA."""
    key = generate_key()
    return _sign_leaf(ca_cert, ca_key, role, name, key.public_key(), hosts, days), key


def _sign_leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    role: str,
    name: str,
    public_key: ec.EllipticCurvePublicKey,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
) -> x509.Certificate:
    """The CA's certificate for `public_key` (made here, or the one of a device's CSR); it ends no later than the CA."""
    return (
        _leaf_builder(role, name, public_key, hosts, days, until=ca_cert.not_valid_after_utc)
        .issuer_name(ca_cert.subject)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def self_signed_cert(
    role: str, name: str, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf that claims a role but is signed by nobody: what an impostor presents (used by tests)."""
    key = generate_key()
    builder = _leaf_builder(role, name, key.public_key(), hosts, days)
    cert = builder.issuer_name(_leaf_subject(role, name)).sign(key, hashes.SHA256())
    return cert, key


def identity_of(cert: x509.Certificate) -> Identity | None:
    """Role and name from a shuffledp certificate, or None when it does not name exactly one valid role.

    The SAN URI is authoritative; the subject OU must agree with it (a certificate whose two role fields
    disagree was not made by `pki init` and is not trusted with any role).
    """
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    prefix = f"spiffe://{SPIFFE_TRUST_DOMAIN}/"
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(prefix)]
    if len(uris) != 1:
        return None
    parts = uris[0][len(prefix) :].split("/")
    if len(parts) != 2 or parts[0] not in ROLES or not _NAME_RE.match(parts[1]):
        return None
    ous = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    if ous != [parts[0]]:
        return None
    return Identity(role=parts[0], name=parts[1])


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # PKCS#8 unencrypted: what gRPC/OpenSSL load without a passphrase; protected by file mode 0600
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int, sync: bool = True) -> None:
    """Write `data` to `path` created with `mode` from the start (never briefly world-readable): atomically (a temporary
    file, fsync, rename), or with `sync=False` in place and not synced, for a bulk writer that calls os.sync() once and
    only then lists the files in its manifest (10^4 certificates took 37 s in fsyncs, two per party)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp") if sync else path
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; make it exact
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if sync:
        os.replace(tmp, path)


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def party_paths(pki_dir: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """(cert, key) paths of party `name` inside `pki_dir`."""
    d = Path(pki_dir) / name
    return d / CERT_FILE, d / KEY_FILE


@dataclass(frozen=True)
class PartyMaterial:
    """The PEM bytes a party's TLS credentials are made of, checked by load_party."""

    ca: bytes
    cert: bytes
    key: bytes


def _init_hint(pki_dir: Path, client_nodes: int | None = None) -> str:
    nodes = "N" if client_nodes is None else str(client_nodes)
    return f"create it with `shuffledp pki init --out {pki_dir} --client-nodes {nodes}`"


def _load_ca(pki_dir: Path, nodes: int | None = None) -> tuple[bytes, x509.Certificate]:
    """The CA certificate of `pki_dir`, after checking the folder itself (the first mistakes users make); `nodes`:
    the client nodes the caller needs, for the advice (None: not known)."""
    if not pki_dir.exists():
        raise FileNotFoundError(f"PKI folder {pki_dir} does not exist: {_init_hint(pki_dir, nodes)}")
    if not pki_dir.is_dir():
        raise NotADirectoryError(f"PKI folder {pki_dir} is a file, not the folder `shuffledp pki init --out` writes")
    ca_path = pki_dir / CA_CERT_FILE
    if not ca_path.is_file():
        what = "is empty" if not any(pki_dir.iterdir()) else f"has no {CA_CERT_FILE}"
        raise FileNotFoundError(f"PKI folder {pki_dir} {what}: {_init_hint(pki_dir, nodes)}")
    pem, ca = _load_cert(ca_path)
    _check_dates(ca_path, ca)
    return pem, ca


def _load_cert(path: Path) -> tuple[bytes, x509.Certificate]:
    pem = path.read_bytes()
    try:
        return pem, x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise ValueError(f"{path} is not a PEM certificate (corrupt or empty)") from None


def _check_dates(path: Path, cert: x509.Certificate) -> None:
    now = dt.datetime.now(dt.UTC)
    if now > cert.not_valid_after_utc:
        raise ValueError(f"{path} expired on {cert.not_valid_after_utc:%Y-%m-%d}: re-create the PKI")
    if now < cert.not_valid_before_utc:
        raise ValueError(f"{path} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (clock?)")


def _client_nodes_in(pki_dir: Path) -> int:
    """How many client-node certificates client-0, client-1, ... exist in a row."""
    n = 0
    while party_paths(pki_dir, client_node_name(n))[0].is_file():
        n += 1
    return n


def _load_party(
    pki_dir: Path, ca_pem: bytes, ca: x509.Certificate, role: str, name: str, nodes: int = 0
) -> PartyMaterial:
    """`nodes`: how many client nodes the caller needs in all (0: this one's index + 1), for the advice."""
    cert_path, key_path = party_paths(pki_dir, name)
    if not cert_path.is_file():
        if role == ROLE_CLIENT_NODE and name.startswith("client-") and name[len("client-") :].isdigit():
            have, need = _client_nodes_in(pki_dir), max(nodes, int(name[len("client-") :]) + 1)
            raise FileNotFoundError(
                f"{cert_path} not found: {pki_dir} has certificates for {have} client node(s), {need} or more are "
                f"needed; re-create it with `shuffledp pki init --out {pki_dir} --client-nodes {need} --force`"
            )
        raise FileNotFoundError(f"{cert_path} not found: {_init_hint(pki_dir)}")
    cert_pem_bytes, cert = _load_cert(cert_path)
    ident = identity_of(cert)
    if ident != Identity(role, name):
        raise ValueError(f"{cert_path} names {ident}, not role={role!r} name={name!r}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ValueError(f"{cert_path} is not signed by {pki_dir / CA_CERT_FILE} (from another PKI?)") from None
    _check_dates(cert_path, cert)
    if not key_path.is_file():
        raise FileNotFoundError(f"{key_path} not found: {_init_hint(pki_dir)}")
    mode = key_path.stat().st_mode & 0o777
    if mode & 0o077:
        # a readable private key is a leaked identity; refuse instead of serving with it
        raise PermissionError(f"{key_path} is readable by group/others (mode {mode:o}); chmod 600")
    key_pem_bytes = key_path.read_bytes()
    try:
        key = serialization.load_pem_private_key(key_pem_bytes, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        # TypeError: encrypted; gRPC would only say "Failed to bind to address" (issue 24 item 11)
        raise ValueError(f"{key_path} is not an unencrypted PEM private key (corrupt or empty)") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise ValueError(f"{key_path} is not the key of {cert_path}")
    return PartyMaterial(ca=ca_pem, cert=cert_pem_bytes, key=key_pem_bytes)


def load_party(pki_dir: str | os.PathLike[str], role: str, name: str) -> PartyMaterial:
    """CA, certificate and key of party `name`, each checked: the folder exists, the CA certificate, the party's
    certificate names that role and name and is signed by the CA and valid today, its key is private (0600), parses
    and belongs to the certificate. Raises OSError (FileNotFoundError, NotADirectoryError, PermissionError) or
    ValueError with one line naming the file and the problem."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not a shuffledp role; allowed: {', '.join(ROLES)}")
    pki_dir = Path(pki_dir)
    ca_pem, ca = _load_ca(pki_dir)
    return _load_party(pki_dir, ca_pem, ca, role, name)


def check_pki(pki_dir: str | os.PathLike[str], parties: Sequence[Identity]) -> None:
    """load_party for every party, the CA read once: what `shuffledp run` calls before starting anything, so that a
    PKI mistake is one line in a second instead of a service failing at start-up (issue 24 item 11)."""
    pki_dir = Path(pki_dir)
    # the advice names every client node the caller needs, not only the first one missing (issue 43 item 15)
    nodes = sum(1 for party in parties if party.role == ROLE_CLIENT_NODE)
    ca_pem, ca = _load_ca(pki_dir, nodes or None)
    for party in parties:
        _load_party(pki_dir, ca_pem, ca, party.role, party.name, nodes)


def default_parties(client_nodes: int) -> list[Identity]:
    """analyzer, shuffler, client-0..client-(N-1), operator."""
    if not isinstance(client_nodes, int) or not 1 <= client_nodes <= MAX_CLIENT_NODES:
        raise ValueError(f"client_nodes={client_nodes!r} out of range; allowed: integer 1..{MAX_CLIENT_NODES}")
    return [
        Identity(ROLE_ANALYZER, "analyzer"),
        Identity(ROLE_SHUFFLER, "shuffler"),
        *(Identity(ROLE_CLIENT_NODE, client_node_name(i)) for i in range(client_nodes)),
        Identity(ROLE_OPERATOR, "operator"),
    ]


def check_local_run(pki_dir: str | os.PathLike[str], client_nodes: int) -> None:
    """check_pki for a local `shuffledp run` with `client_nodes` nodes: every party it starts, and its operator."""
    check_pki(pki_dir, default_parties(client_nodes))


def _existing(out: Path) -> list[Path]:
    files = (CA_CERT_FILE, CA_KEY_FILE, MANIFEST_FILE, CRL_FILE)
    return [out / f for f in files if (out / f).exists()]


def _remove_previous(out: Path) -> None:
    """With --force: remove what a previous `pki init` wrote (and nothing else in the directory)."""
    manifest = out / MANIFEST_FILE
    if manifest.exists():
        for party in json.loads(manifest.read_text()).get("parties", []):
            d = out / party["name"]
            if _NAME_RE.match(party["name"]) and d.is_dir():
                for f in (CERT_FILE, KEY_FILE):
                    (d / f).unlink(missing_ok=True)
                if not any(d.iterdir()):
                    d.rmdir()
    for p in (out / CA_CERT_FILE, out / CA_KEY_FILE, out / CRL_FILE, manifest):
        p.unlink(missing_ok=True)


def _parse_owner(owner: str | None) -> tuple[int, int] | None:
    if owner is None:
        return None
    m = re.fullmatch(r"(\d+)(?::(\d+))?", owner)
    if not m:
        raise ValueError(f"owner={owner!r} is not UID or UID:GID (numbers)")
    uid = int(m.group(1))
    return uid, int(m.group(2)) if m.group(2) else uid


def _manifest_entry(cert: x509.Certificate, ident: Identity) -> dict[str, str]:
    return {
        "role": ident.role,
        "name": ident.name,
        "uri": spiffe_uri(ident.role, ident.name),
        "serial": format(cert.serial_number, "x"),  # what crl.pem lists once it is revoked
        "sha256": cert.fingerprint(hashes.SHA256()).hex(),
        "not_after": cert.not_valid_after_utc.isoformat(),
    }


def _write_manifest(out: Path, manifest: dict) -> None:
    _write(out / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode(), 0o644)


def _issue_parties(
    out: Path,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    parties: Sequence[Identity],
    hosts: Sequence[str],
    days: int,
    owner: tuple[int, int] | None,
) -> tuple[list[IssuedCert], list[dict[str, str]]]:
    """Key and certificate of each party written under `out`, all on disk when this returns; (issued, manifest
    entries). One os.sync() for all of them instead of an fsync per file (MAX_CLIENT_NODES)."""
    issued: list[IssuedCert] = []
    entries: list[dict[str, str]] = []
    for party in parties:
        extra = () if party.role == ROLE_OPERATOR else tuple(hosts)
        cert, key = issue_cert(ca_cert, ca_key, party.role, party.name, extra, days)
        cert_path, key_path = party_paths(out, party.name)
        _private_dir(cert_path.parent)
        _write(key_path, key_pem(key), 0o600, sync=False)
        _write(cert_path, cert_pem(cert), 0o644, sync=False)
        if owner is not None and party.role != ROLE_OPERATOR:
            for p in (cert_path.parent, cert_path, key_path):
                os.chown(p, *owner)
        issued.append(IssuedCert(party.role, party.name, cert_path, key_path))
        entries.append(_manifest_entry(cert, party))
    os.sync()  # before the manifest that lists them is written: a listed party's files are on disk
    return issued, entries


def init_pki(
    out: str | os.PathLike[str],
    client_nodes: int = 1,
    hosts: Sequence[str] = (),
    force: bool = False,
    days: int = DEFAULT_DAYS,
    service_owner: str | None = None,
) -> list[IssuedCert]:
    """Create a CA, an empty revocation list and the certificates of all parties under `out`.

    `hosts` are extra SAN entries (DNS names or IPs) for the three services, e.g. the hosts they run on.
    `service_owner` ("UID" or "UID:GID") chowns the service directories so that a non-root container
    user can read its own key with mode 0600 (needs root). Refuses to overwrite without `force`.
    """
    out = Path(out)
    parties = default_parties(client_nodes)
    for h in hosts:
        _general_name(h)  # validate before writing anything
    owner = _parse_owner(service_owner)
    existing = _existing(out) + [p for i in parties for p in party_paths(out, i.name) if p.exists()]
    if existing and not force:
        raise FileExistsError(
            f"a PKI already exists in {out} ({', '.join(str(p) for p in existing[:3])}); "
            "use --force to replace it (every party then needs its new certificate)"
        )
    if force:
        _remove_previous(out)
    out.mkdir(parents=True, exist_ok=True)

    ca_cert, ca_key = make_ca(days=days)
    _private_dir(out / Path(CA_KEY_FILE).parent)
    _write(out / CA_KEY_FILE, key_pem(ca_key), 0o600)
    _write(out / CA_CERT_FILE, cert_pem(ca_cert), 0o644)
    _write(out / CRL_FILE, _crl_pem(ca_cert, ca_key, [], 1), 0o644)
    issued, entries = _issue_parties(out, ca_cert, ca_key, parties, hosts, days, owner)
    _write_manifest(out, {"ca_sha256": ca_cert.fingerprint(hashes.SHA256()).hex(), "parties": entries})
    return issued


def _open_ca(pki_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, dict]:
    """(CA certificate, CA key, manifest) of an existing PKI, to issue or revoke with; one line naming what is
    missing or wrong."""
    _, ca_cert = _load_ca(pki_dir)
    key_path = pki_dir / CA_KEY_FILE
    if not key_path.is_file():
        raise FileNotFoundError(f"{key_path} not found: issue and revoke on the host that holds the CA key")
    try:
        ca_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError(f"{key_path} is not an unencrypted PEM private key (corrupt or empty)") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if ca_key.public_key().public_bytes(*spki) != ca_cert.public_key().public_bytes(*spki):
        raise ValueError(f"{key_path} is not the key of {pki_dir / CA_CERT_FILE}")
    manifest_path = pki_dir / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
        _issued_names(manifest)
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{manifest_path} is missing or not the manifest `shuffledp pki init` writes") from None
    return ca_cert, ca_key, manifest


@contextlib.contextmanager
def _ca_lock(pki_dir: Path) -> Iterator[None]:
    """Hold the CA's lock (flock on its key file) while the block reads and rewrites the manifest or the revocation
    list: two `pki issue` or `pki revoke` at once would otherwise number the same certificates, or each drop the
    other's entries. A missing key is _open_ca's error, raised inside the block."""
    try:
        fd = os.open(pki_dir / CA_KEY_FILE, os.O_RDONLY)
    except FileNotFoundError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _issued_names(manifest: dict) -> set[str]:
    return {party["name"] for party in manifest["parties"]}


def _save_manifest(pki_dir: Path, manifest: dict, entries: Sequence[dict[str, str]]) -> None:
    _write_manifest(pki_dir, {**manifest, "parties": [*manifest["parties"], *entries]})


def issue_client_nodes(
    pki_dir: str | os.PathLike[str],
    count: int,
    hosts: Sequence[str] = (),
    days: int = DEFAULT_DAYS,
    service_owner: str | None = None,
) -> list[IssuedCert]:
    """`count` more client-node certificates (keys made here) in an existing PKI, numbered after the highest
    client-<i> it has issued; the CA and every certificate issued before stay as they are."""
    pki_dir = Path(pki_dir)
    if not isinstance(count, int) or not 1 <= count <= MAX_CLIENT_NODES:
        raise ValueError(f"count={count!r} out of range; allowed: integer 1..{MAX_CLIENT_NODES}")
    for h in hosts:
        _general_name(h)
    _validity(days)
    owner = _parse_owner(service_owner)
    with _ca_lock(pki_dir):
        ca_cert, ca_key, manifest = _open_ca(pki_dir)
        numbered = [int(n[len("client-") :]) for n in _issued_names(manifest) if re.fullmatch(r"client-\d+", n)]
        first = max(numbered, default=-1) + 1
        parties = [Identity(ROLE_CLIENT_NODE, client_node_name(i)) for i in range(first, first + count)]
        taken = [p for party in parties for p in party_paths(pki_dir, party.name) if p.exists()]
        if taken:
            raise FileExistsError(f"{taken[0]} exists but {pki_dir / MANIFEST_FILE} does not list it: remove it first")
        issued, entries = _issue_parties(pki_dir, ca_cert, ca_key, parties, hosts, days, owner)
        _save_manifest(pki_dir, manifest, entries)
    return issued


def sign_csr(
    pki_dir: str | os.PathLike[str], csr_pem: bytes, name: str, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS
) -> Path:
    """A client-node certificate named `name` for the key of a device's certificate signing request (the device keeps
    its key); returns the path of the certificate written, <pki_dir>/<name>/cert.pem. The CA writes role and name
    itself: nothing but the CSR's public key is used, once its signature shows the device holds the key."""
    pki_dir = Path(pki_dir)
    _check_role_name(ROLE_CLIENT_NODE, name)
    for h in hosts:
        _general_name(h)
    _validity(days)
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise ValueError("the CSR is not a PEM certificate signing request (corrupt or empty)") from None
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or public_key.curve.name != ec.SECP256R1.name:
        raise ValueError("the CSR's key is not EC P-256 (openssl: -newkey ec -pkeyopt ec_paramgen_curve:P-256)")
    if not csr.is_signature_valid:
        raise ValueError("the CSR's signature does not verify: it was not signed by the key it carries")
    with _ca_lock(pki_dir):
        ca_cert, ca_key, manifest = _open_ca(pki_dir)
        cert_path = party_paths(pki_dir, name)[0]
        if name in _issued_names(manifest) or cert_path.exists():
            raise FileExistsError(
                f"{name} has a certificate already ({cert_path}); a replaced device gets a new name (`pki revoke "
                f"{name}` revokes the old one)"
            )
        cert = _sign_leaf(ca_cert, ca_key, ROLE_CLIENT_NODE, name, public_key, hosts, days)
        _private_dir(cert_path.parent)
        _write(cert_path, cert_pem(cert), 0o644)
        _save_manifest(pki_dir, manifest, [_manifest_entry(cert, Identity(ROLE_CLIENT_NODE, name))])
    return cert_path


def _crl_pem(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    revoked: Sequence[x509.RevokedCertificate],
    number: int,
) -> bytes:
    """The CA-signed list of `revoked`, valid as long as the CA (a stale list would have to be refused by servers)."""
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(_validity(1)[0])  # backdated as certificates are
        .next_update(ca_cert.not_valid_after_utc)
        .add_extension(x509.CRLNumber(number), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
    )
    for entry in revoked:
        builder = builder.add_revoked_certificate(entry)
    return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def verified_crl(path: Path, ca_cert: x509.Certificate) -> x509.CertificateRevocationList:
    """The revocation list at `path` once its signature verifies against the CA; ValueError naming the file if it
    does not parse or another key signed it (such a list must not be used: it could revoke, or omit, anyone)."""
    try:
        crl = x509.load_pem_x509_crl(path.read_bytes())
    except ValueError:
        raise ValueError(f"{path} is not a PEM certificate revocation list (corrupt or empty)") from None
    try:
        signed = crl.issuer == ca_cert.subject and crl.is_signature_valid(ca_cert.public_key())
    except (TypeError, ValueError):  # a key of another type
        signed = False
    if not signed:
        raise ValueError(f"{path} is not signed by the CA {path.parent / CA_CERT_FILE}")
    return crl


def revoke(pki_dir: str | os.PathLike[str], names: Sequence[str]) -> list[tuple[str, int, bool]]:
    """Add the certificates of client nodes `names` to the PKI's revocation list (crl.pem), signed by the CA; the
    shuffler then refuses them. Returns (name, serial, newly revoked) for each; nothing is written if one name is
    wrong or all were revoked already."""
    pki_dir = Path(pki_dir)
    if not names:
        raise ValueError("name the client nodes to revoke")
    with _ca_lock(pki_dir):
        return _revoke(pki_dir, names)


def _revoke(pki_dir: Path, names: Sequence[str]) -> list[tuple[str, int, bool]]:
    ca_cert, ca_key, _ = _open_ca(pki_dir)
    crl_path = pki_dir / CRL_FILE
    crl = verified_crl(crl_path, ca_cert) if crl_path.exists() else None
    listed = {entry.serial_number for entry in crl or ()}
    found: list[tuple[str, int, bool]] = []
    for name in dict.fromkeys(names):
        cert_path = party_paths(pki_dir, name)[0]
        if not _NAME_RE.match(name) or not cert_path.is_file():
            raise FileNotFoundError(f"no certificate {cert_path} (the names issued are in {pki_dir / MANIFEST_FILE})")
        _, cert = _load_cert(cert_path)
        try:
            cert.verify_directly_issued_by(ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            raise ValueError(f"{cert_path} is not signed by {pki_dir / CA_CERT_FILE}") from None
        if identity_of(cert) != Identity(ROLE_CLIENT_NODE, name):
            raise ValueError(
                f"{cert_path} is not a client node's certificate: only those are revoked (the shuffler checks "
                "crl.pem); replace a service's certificate with `pki init --force`"
            )
        found.append((name, cert.serial_number, cert.serial_number not in listed))
    now = dt.datetime.now(dt.UTC)
    added = [
        x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        for _, serial, new in found
        if new
    ]
    if added:
        number = 1
        if crl is not None:
            try:
                number = crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number + 1
            except x509.ExtensionNotFound:
                pass
        _write(crl_path, _crl_pem(ca_cert, ca_key, [*(crl or ()), *added], number), 0o644)
    return found


def _print_issued(issued: Sequence[IssuedCert]) -> None:
    """One line per party; client nodes past the first few as one line (10^4 lines would bury the rest)."""
    nodes = [c for c in issued if c.role == ROLE_CLIENT_NODE]
    for c in issued:
        if c.role != ROLE_CLIENT_NODE or len(nodes) <= 10:
            print(f"{c.role:12s} {c.name:12s} {c.cert_path}")
    if len(nodes) > 10:
        where = nodes[0].cert_path.parent.parent
        print(f"{ROLE_CLIENT_NODE:12s} {nodes[0].name} .. {nodes[-1].name} ({len(nodes)}): {where}/<name>/{CERT_FILE}")


def _cmd_init(args: argparse.Namespace) -> int:
    try:
        issued = init_pki(
            args.out,
            client_nodes=args.client_nodes,
            hosts=args.hosts,
            force=args.force,
            days=args.days,
            service_owner=args.service_owner,
        )
    except (FileExistsError, ValueError, PermissionError) as exc:
        print(f"shuffledp pki init: {exc}", file=sys.stderr)
        return 1
    print(f"CA: {Path(args.out) / CA_CERT_FILE} (key {Path(args.out) / CA_KEY_FILE}: keep it off every host)")
    _print_issued(issued)
    return 0


def _cmd_issue(args: argparse.Namespace) -> int:
    try:
        if args.csr is not None:
            if args.name is None or args.count is not None or args.service_owner is not None:
                raise ValueError("--csr FILE goes with --name NAME (and neither --count nor --service-owner)")
            path = sign_csr(args.pki, args.csr.read_bytes(), args.name, args.hosts, args.days)
            print(f"{ROLE_CLIENT_NODE:12s} {args.name:12s} {path} (give the device this file and {CA_CERT_FILE})")
            return 0
        if args.count is None or args.name is not None:
            raise ValueError("give --count N (keys made here) or --csr FILE --name NAME (the device keeps its key)")
        _print_issued(issue_client_nodes(args.pki, args.count, args.hosts, args.days, args.service_owner))
    except (OSError, ValueError) as exc:
        print(f"shuffledp pki issue: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    try:
        found = revoke(args.pki, args.names)
    except (OSError, ValueError) as exc:
        print(f"shuffledp pki revoke: {exc}", file=sys.stderr)
        return 1
    for name, serial, new in found:
        print(f"{name:12s} serial {serial:x} {'revoked' if new else 'was revoked already'}")
    print(f"{Path(args.pki) / CRL_FILE}: a shuffler with --pki {args.pki} refuses these certificates from now on")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `shuffledp pki init|issue|revoke` with the CLI dispatcher (shuffledp.cli)."""
    pki = subparsers.add_parser("pki", help="create the CA and mTLS certificates of all parties; add or revoke devices")
    pki_sub = pki.add_subparsers(dest="pki_command", metavar="PKI_COMMAND", required=True)
    init = pki_sub.add_parser(
        "init", help="create a CA and certificates for analyzer, shuffler, client nodes, operator"
    )
    init.add_argument("--out", required=True, help="directory to write (refused if it already holds a PKI)")
    init.add_argument(
        "--client-nodes",
        type=int,
        default=1,
        help=f"number of client-node certificates (client-0..; <= {MAX_CLIENT_NODES})",
    )
    init.add_argument("--hosts", nargs="*", default=[], help="extra SAN DNS names / IPs for the service certificates")
    init.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days (1..3650)")
    init.add_argument(
        "--service-owner",
        metavar="UID[:GID]",
        help="chown the service key directories (for the container user, e.g. 10001); needs root",
    )
    init.add_argument("--force", action="store_true", help="replace an existing PKI")
    init.set_defaults(func=_cmd_init)

    issue = pki_sub.add_parser(
        "issue",
        help="add client nodes to an existing PKI: --count N (keys made here) or --csr FILE --name NAME (a device's "
        "own key)",
    )
    issue.add_argument("--pki", type=Path, required=True, help="the PKI directory (with the CA key, ca/ca.key)")
    issue.add_argument("--count", type=int, help="this many client nodes, numbered after the highest client-<i>")
    issue.add_argument("--csr", type=Path, help="a device's certificate signing request (PEM, EC P-256 key)")
    issue.add_argument("--name", help="with --csr: the device's client-node name (a DNS label, e.g. client-123)")
    issue.add_argument("--hosts", nargs="*", default=[], help="extra SAN DNS names / IPs")
    issue.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days (1..3650; at most the CA's)")
    issue.add_argument("--service-owner", metavar="UID[:GID]", help="with --count: chown the key directories")
    issue.set_defaults(func=_cmd_issue)

    rev = pki_sub.add_parser(
        "revoke", help="revoke client-node certificates: the CA signs crl.pem, which the shuffler checks at each call"
    )
    rev.add_argument("--pki", type=Path, required=True, help="the PKI directory (with the CA key, ca/ca.key)")
    rev.add_argument("names", nargs="+", metavar="NAME", help="client-node names, e.g. client-7")
    rev.set_defaults(func=_cmd_revoke)
