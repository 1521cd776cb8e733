"""`shuffledp pki init`: a private CA and one mTLS certificate per party (design section 7).

Every certificate carries its party's ROLE twice, so that a server can authorize by role (shuffledp.tls):
subject OU=<role> and a SAN URI spiffe://shuffledp/<role>/<name>. Roles: analyzer, shuffler, client-node
(names client-0, client-1, ...), operator (the person or CLI that creates runs and reads results).

Layout written under --out (what docker-compose mounts; the CA key is mounted nowhere):

    ca.crt                      the CA certificate (trust anchor, public)
    ca/ca.key                   the CA private key (0600, directory 0700)
    <name>/cert.pem, key.pem    one directory per party (key 0600, directory 0700)
    pki.json                    manifest: names, roles, fingerprints, expiry
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import os
import re
import sys
from collections.abc import Sequence
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
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
# SANs every party gets: processes started by `shuffledp run` talk over loopback
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
MAX_CLIENT_NODES = 1000
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
    role: str, name: str, public_key: ec.EllipticCurvePublicKey, hosts: Sequence[str], days: int
) -> x509.CertificateBuilder:
    _check_role_name(role, name)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(role, name))]
    for host in dict.fromkeys([name, *LOOPBACK_HOSTS, *hosts]):  # dedupe, keep order
        sans.append(_general_name(host))
    # the operator only ever connects; the three services both serve and connect
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role != ROLE_OPERATOR:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    not_before, not_after = _validity(days)
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
    cert = (
        _leaf_builder(role, name, key.public_key(), hosts, days)
        .issuer_name(ca_cert.subject)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


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


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to `path` created with `mode` from the start (never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; make it exact
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
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
    old = [p for p in (out / CA_CERT_FILE, out / CA_KEY_FILE, out / MANIFEST_FILE) if p.exists()]
    return old


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
    for p in (out / CA_CERT_FILE, out / CA_KEY_FILE, manifest):
        p.unlink(missing_ok=True)


def _parse_owner(owner: str | None) -> tuple[int, int] | None:
    if owner is None:
        return None
    m = re.fullmatch(r"(\d+)(?::(\d+))?", owner)
    if not m:
        raise ValueError(f"owner={owner!r} is not UID or UID:GID (numbers)")
    uid = int(m.group(1))
    return uid, int(m.group(2)) if m.group(2) else uid


def init_pki(
    out: str | os.PathLike[str],
    client_nodes: int = 1,
    hosts: Sequence[str] = (),
    force: bool = False,
    days: int = DEFAULT_DAYS,
    service_owner: str | None = None,
) -> list[IssuedCert]:
    """Create a CA and the certificates of all parties under `out`.

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

    issued: list[IssuedCert] = []
    manifest = {"ca_sha256": ca_cert.fingerprint(hashes.SHA256()).hex(), "parties": []}
    for party in parties:
        extra = () if party.role == ROLE_OPERATOR else tuple(hosts)
        cert, key = issue_cert(ca_cert, ca_key, party.role, party.name, extra, days)
        cert_path, key_path = party_paths(out, party.name)
        _private_dir(cert_path.parent)
        _write(key_path, key_pem(key), 0o600)
        _write(cert_path, cert_pem(cert), 0o644)
        if owner is not None and party.role != ROLE_OPERATOR:
            for p in (cert_path.parent, cert_path, key_path):
                os.chown(p, *owner)
        issued.append(IssuedCert(party.role, party.name, cert_path, key_path))
        manifest["parties"].append(
            {
                "role": party.role,
                "name": party.name,
                "uri": spiffe_uri(party.role, party.name),
                "sha256": cert.fingerprint(hashes.SHA256()).hex(),
                "not_after": cert.not_valid_after_utc.isoformat(),
            }
        )
    _write(out / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode(), 0o644)
    return issued


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
    for c in issued:
        print(f"{c.role:12s} {c.name:12s} {c.cert_path}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `shuffledp pki init` with the CLI dispatcher (shuffledp.cli)."""
    pki = subparsers.add_parser("pki", help="create the CA and mTLS certificates of all parties")
    pki_sub = pki.add_subparsers(dest="pki_command", metavar="PKI_COMMAND", required=True)
    init = pki_sub.add_parser(
        "init", help="create a CA and certificates for analyzer, shuffler, client nodes, operator"
    )
    init.add_argument("--out", required=True, help="directory to write (refused if it already holds a PKI)")
    init.add_argument("--client-nodes", type=int, default=1, help="number of client-node certificates (client-0..)")
    init.add_argument("--hosts", nargs="*", default=[], help="extra SAN DNS names / IPs for the service certificates")
    init.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity in days (1..3650)")
    init.add_argument(
        "--service-owner",
        metavar="UID[:GID]",
        help="chown the service key directories (for the container user, e.g. 10001); needs root",
    )
    init.add_argument("--force", action="store_true", help="replace an existing PKI")
    init.set_defaults(func=_cmd_init)
