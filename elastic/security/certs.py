"""`elasticd certs`: a small certificate authority for one cluster, built on
the `cryptography` package.

Layout of a certificate directory (what `init` and `issue` write):

    DIR/ca.pem                      the CA certificate (give it to everyone)
    DIR/ca.key                      the CA key (0600; keep it off the hosts)
    DIR/controller/                 a bundle: ca.pem, cert.pem, key.pem
    DIR/hosts/<host-id>/            one bundle per host
    DIR/operators/<name>/           one bundle per operator (elasticd status)

A bundle directory is what `--tls-dir` of `elasticd start`, `elastic-agent`
and `elasticd status` takes (their defaults, and the systemd units':
/etc/elastic/controller, /etc/elastic/host, /etc/elastic/operator). Keys
are ECDSA P-256 (a handshake costs a fraction of an RSA-2048 one), written
0600 in 0700 directories; certificates name their holder in the subject
(CN = name, OU = role, see elastic.security.identity). Controller
certificates carry the DNS name `elastic-controller`, which agents check
instead of the address they dialled, plus any `--san` given.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import pathlib

from elastic.security import files
from elastic.security.files import write_private
from elastic.security.identity import Role, check_id

#: The DNS SAN every controller certificate carries; agents verify the
#: controller against this name (grpc.ssl_target_name_override).
CONTROLLER_SERVER_NAME = "elastic-controller"
#: The name an agent's own port is served under (elastic.agent.service).
HOST_SERVER_NAME = "elastic-host"


def host_server_name(host_id: str) -> str:
    """The DNS name a host certificate also carries for its own host, so a
    peer can check which host it reached (replicas go to one buddy):
    `<host id>.elastic-host`."""
    return f"{host_id}.{HOST_SERVER_NAME}"

CA_CERT, CA_KEY = "ca.pem", "ca.key"
BUNDLE_CA, BUNDLE_CERT, BUNDLE_KEY = "ca.pem", "cert.pem", "key.pem"
_ROLE_DIRS = {Role.CONTROLLER: None, Role.HOST: "hosts", Role.OPERATOR: "operators"}


class CertError(ValueError):
    """A certificate operation that cannot be done; the message says why."""


@dataclasses.dataclass(frozen=True)
class Issued:
    """A bundle written by `issue`: its directory, holder and expiry (UTC)."""

    directory: pathlib.Path
    role: Role
    name: str
    not_after: datetime.datetime


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def private_dir(path: pathlib.Path) -> pathlib.Path:
    """`files.private_dir`, with CertError for a path that is not a directory."""
    try:
        return files.private_dir(path)
    except NotADirectoryError as e:
        raise CertError(str(e)) from None


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def create_ca(directory: str | os.PathLike[str], name: str = "elastic CA", days: int = 3650,
              now: datetime.datetime | None = None) -> pathlib.Path:
    """Create a CA in `directory` (ca.pem, ca.key 0600) valid for `days` days.
    Returns the directory. Raises CertError if a CA key is already there
    (a CA is never overwritten: every certificate it issued would stop
    verifying) or `days` is not positive."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    if days < 1:
        raise CertError(f"--days must be at least 1, got {days}")
    root = private_dir(pathlib.Path(directory))
    if (root / CA_KEY).exists():
        raise CertError(f"{root / CA_KEY} already exists; a CA is never overwritten "
                        f"(use another --dir, or delete it knowingly)")
    now = now or _utcnow()
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    write_private(root / CA_KEY, _pem_key(key))
    (root / CA_CERT).write_bytes(_pem_cert(cert))
    return root


def _san(text: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        return x509.DNSName(text)


def bundle_dir(directory: str | os.PathLike[str], role: Role, name: str) -> pathlib.Path:
    """Where `issue` puts the bundle of `name` in `role` under `directory`."""
    sub = _ROLE_DIRS[role]
    root = pathlib.Path(directory)
    return root / "controller" if sub is None else root / sub / name


class Authority:
    """The CA in `directory` (ca.pem, ca.key), loaded once to issue many
    certificates (`issue_pem`). Raises CertError when there is no CA or it
    cannot be read."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        root = pathlib.Path(directory)
        try:
            self.key = serialization.load_pem_private_key((root / CA_KEY).read_bytes(), None)
            self.ca_pem = (root / CA_CERT).read_bytes()
            self.cert = x509.load_pem_x509_certificate(self.ca_pem)
        except FileNotFoundError as e:
            raise CertError(f"no CA in {root} ({e.filename} missing): run `elasticd certs init "
                            f"--dir {root}` first") from None
        except ValueError as e:
            raise CertError(f"the CA in {root} cannot be read: {e}") from None

    def issue_pem(self, role: Role, name: str, sans: tuple[str, ...] = (), days: int = 365,
                  now: datetime.datetime | None = None
                  ) -> tuple[bytes, bytes, datetime.datetime]:
        """A certificate for `name` in `role`: (certificate PEM, key PEM,
        expiry in UTC). `sans`: extra DNS names or IP addresses (controller
        only; it always gets CONTROLLER_SERVER_NAME). A host certificate may
        serve the agent's own port (health, reflection: elastic.agent.service)
        under HOST_SERVER_NAME and `host_server_name(name)`, never the
        controller's name, so it cannot stand in for a controller. Raises
        CertError when `name` is not a valid id, `days` is not positive or
        outlives the CA, or `sans` are given for another role."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        try:
            check_id(name, f"{role.short} name")
        except ValueError as e:
            raise CertError(str(e)) from None
        if days < 1:
            raise CertError(f"--days must be at least 1, got {days}")
        if sans and role is not Role.CONTROLLER:
            raise CertError("--san applies to controller certificates only")
        now = now or _utcnow()
        not_after = now + datetime.timedelta(days=days)
        if not_after > self.cert.not_valid_after_utc:
            raise CertError(f"a certificate valid for {days} days would outlive the CA "
                            f"(valid until {self.cert.not_valid_after_utc:%Y-%m-%d}); use fewer "
                            f"--days or a new CA")
        key = _key()
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([
                       x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
                       x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(not_after)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False,
                                                crl_sign=False, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False,
                                                key_agreement=False, encipher_only=False,
                                                decipher_only=False), critical=True)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                       self.key.public_key()), critical=False))
        if role is Role.CONTROLLER:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
            names = list(dict.fromkeys([CONTROLLER_SERVER_NAME, *sans]))
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        elif role is Role.HOST:
            # the agent's own port, under a name no agent dials a controller by
            # (an operator certificate cannot serve at all)
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
            builder = builder.add_extension(
                x509.SubjectAlternativeName([_san(HOST_SERVER_NAME),
                                             _san(host_server_name(name))]), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return _pem_cert(cert), _pem_key(key), not_after


def issue(directory: str | os.PathLike[str], role: Role, name: str,
          sans: tuple[str, ...] = (), days: int = 365,
          now: datetime.datetime | None = None) -> Issued:
    """Issue a certificate for `name` in `role` from the CA in `directory`
    (`Authority.issue_pem`) and write its bundle (ca.pem, cert.pem, key.pem)
    to `bundle_dir`, replacing an older one (that is how a certificate is
    renewed). Raises CertError as `Authority` and `issue_pem` do."""
    authority = Authority(directory)
    cert_pem, key_pem, not_after = authority.issue_pem(role, name, sans, days, now)
    out = private_dir(bundle_dir(directory, role, name))
    write_private(out / BUNDLE_KEY, key_pem)
    (out / BUNDLE_CERT).write_bytes(cert_pem)
    (out / BUNDLE_CA).write_bytes(authority.ca_pem)
    return Issued(out, role, name, not_after)


def local_pki(directory: str | os.PathLike[str], hosts: list[str]) -> pathlib.Path:
    """A throwaway CA for `elasticd local` in `directory` (replacing any
    earlier one): a controller bundle (also valid for 127.0.0.1, ::1 and
    localhost), one host bundle per id in `hosts`, and the operator bundle
    `operators/local`. Returns the directory."""
    import shutil

    root = pathlib.Path(directory)
    shutil.rmtree(root, ignore_errors=True)
    create_ca(root, name="elastic local CA (throwaway)", days=30)
    issue(root, Role.CONTROLLER, "localhost", sans=("localhost", "127.0.0.1", "::1"), days=29)
    for host in hosts:
        issue(root, Role.HOST, host, days=29)
    issue(root, Role.OPERATOR, "local", days=29)
    return root
