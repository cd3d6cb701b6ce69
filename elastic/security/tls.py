"""TLS material for gRPC: finding, checking and loading the PEM files of a
bundle, and turning them into grpc's own SSL credentials.

Every channel is mutual TLS: the controller requires a client certificate
issued by its CA (and then checks the holder's role and name per call,
`peer_identity`); agents and tools check the controller's certificate
against their CA and against the name `elastic-controller`, which only
controller certificates carry. The controller's server credentials re-read
the files when they change (grpc calls the fetcher on each new handshake),
so a renewed certificate is served without a restart; clients read theirs
at every (re)connect.

A bundle directory holds `ca.pem`, `cert.pem` and `key.pem` (what
`elasticd certs issue` writes), or cert-manager's `ca.crt`, `tls.crt` and
`tls.key`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pathlib
import stat

import grpc

from elastic.security.certs import CONTROLLER_SERVER_NAME
from elastic.security.identity import Identity, IdentityError, Role, identity_of, \
    identity_of_pem

log = logging.getLogger("elastic.security")

_NAMES = {"ca": ("ca.pem", "ca.crt"), "cert": ("cert.pem", "tls.crt"),
          "key": ("key.pem", "tls.key")}


class TLSError(ValueError):
    """TLS files that cannot be used; the message names the file and why."""


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """The three PEM files of one holder: CA bundle (one or more CA
    certificates), certificate (leaf first, then any intermediates) and
    private key."""

    ca: pathlib.Path
    cert: pathlib.Path
    key: pathlib.Path

    @classmethod
    def in_dir(cls, directory: str | os.PathLike[str]) -> "TLSFiles":
        """The bundle in `directory` (ca.pem|ca.crt, cert.pem|tls.crt,
        key.pem|tls.key). Raises TLSError naming what is missing."""
        root = pathlib.Path(directory)
        if not root.is_dir():
            raise TLSError(f"no TLS directory {root} (issue certificates with `elasticd certs`, "
                           f"or pass --insecure to run without TLS)")
        found = {}
        for part, names in _NAMES.items():
            path = next((root / n for n in names if (root / n).exists()), None)
            if path is None:
                raise TLSError(f"{root} has no {' or '.join(names)}")
            found[part] = path
        return cls(**found)


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Checked TLS material: the PEM bytes, the holder's identity and when
    its certificate expires (UTC)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    identity: Identity
    not_after: datetime.datetime


def _read(path: pathlib.Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TLSError(f"cannot read the TLS {what} {path}: {e.strerror or e}") from None


def _issued_by(cert, issuers) -> bool:
    for issuer in issuers:
        try:
            cert.verify_directly_issued_by(issuer)
            return True
        except Exception:  # noqa: BLE001 - InvalidSignature, or a key type that cannot sign
            continue
    return False


def load(files: TLSFiles, roles: tuple[Role, ...],
         now: datetime.datetime | None = None) -> Credentials:
    """Read and check `files` for a holder in one of `roles`.

    Raises TLSError naming the file and the problem: unreadable, not PEM,
    a key readable by other users, a key that does not match the
    certificate, a certificate not issued by the CA bundle (directly or
    through the intermediates that follow it in its file), not yet valid or
    expired, or naming another role."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_pem, cert_pem = _read(files.ca, "CA bundle"), _read(files.cert, "certificate")
    try:
        mode = files.key.stat().st_mode
    except OSError as e:
        raise TLSError(f"cannot read the TLS key {files.key}: {e.strerror or e}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise TLSError(f"the TLS key {files.key} is accessible to other users (mode "
                       f"{stat.S_IMODE(mode):04o}); chmod 600 it")
    key_pem = _read(files.key, "key")
    try:
        cas = x509.load_pem_x509_certificates(ca_pem)
    except ValueError:
        raise TLSError(f"{files.ca} holds no PEM certificate") from None
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise TLSError(f"{files.cert} holds no PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, None)
    except (ValueError, TypeError) as e:
        raise TLSError(f"{files.key} is not an unencrypted PEM private key ({e})") from None
    leaf = chain[0]
    raw = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*raw) != leaf.public_key().public_bytes(*raw):
        raise TLSError(f"{files.key} is not the key of the certificate {files.cert}")
    cert, hops = leaf, chain[1:]
    while not _issued_by(cert, cas):
        parent = next((c for c in hops if _issued_by(cert, [c])), None)
        if parent is None:
            raise TLSError(f"{files.cert} ({leaf.subject.rfc4514_string()}) was not issued by "
                           f"the CA in {files.ca}")
        cert, hops = parent, [c for c in hops if c is not parent]
    if now < leaf.not_valid_before_utc:
        raise TLSError(f"{files.cert} is not valid before "
                       f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (check this host's clock)")
    if now > leaf.not_valid_after_utc:
        raise TLSError(f"{files.cert} expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
                       f"issue a new one (`elasticd certs issue`)")
    try:
        identity = identity_of(leaf)
    except IdentityError as e:
        raise TLSError(f"{files.cert}: {e}") from None
    if identity.role not in roles:
        raise TLSError(f"{files.cert} is a {identity.role.short} certificate "
                       f"({identity.name}); this needs a "
                       f"{' or '.join(r.short for r in roles)} certificate")
    return Credentials(ca_pem, cert_pem, key_pem, identity, leaf.not_valid_after_utc)


def _stamp(files: TLSFiles) -> tuple:
    stamps = []
    for path in (files.ca, files.cert, files.key):
        try:
            st = path.stat()
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


class _Reloader:
    """grpc's certificate-configuration fetcher: the controller's files,
    re-read and re-checked when they change. A bad new file is logged and
    the last good configuration stays in use."""

    def __init__(self, files: TLSFiles, roles: tuple[Role, ...]) -> None:
        self.files, self.roles = files, roles
        self.credentials = load(files, roles)
        self._stamp = _stamp(files)

    def configuration(self):
        c = self.credentials
        return grpc.ssl_server_certificate_configuration([(c.key_pem, c.cert_pem)], c.ca_pem)

    def __call__(self):
        stamp = _stamp(self.files)
        if stamp == self._stamp:
            return None  # unchanged
        self._stamp = stamp
        try:
            self.credentials = load(self.files, self.roles)
        except TLSError as e:
            log.error("new TLS files not used, keeping the previous ones: %s", e)
            return None
        log.info("TLS files changed: now serving %s, valid until %s",
                 self.credentials.identity, self.credentials.not_after)
        return self.configuration()


def server_credentials(files: TLSFiles, roles: tuple[Role, ...] = (Role.CONTROLLER,)
                       ) -> grpc.ServerCredentials:
    """Mutual-TLS server credentials from `files` (client certificates
    required, checked against the CA bundle), reloaded when the files
    change. Raises TLSError."""
    reloader = _Reloader(files, roles)
    return grpc.dynamic_ssl_server_credentials(reloader.configuration(), reloader,
                                               require_client_authentication=True)


def channel_credentials(files: TLSFiles, roles: tuple[Role, ...]) -> grpc.ChannelCredentials:
    """Client credentials from `files` for a holder in one of `roles`
    (checked now: a renewed file is picked up at the next connect).
    Raises TLSError."""
    c = load(files, roles)
    return grpc.ssl_channel_credentials(c.ca_pem, c.key_pem, c.cert_pem)


#: Channel option making the client check the server's certificate against
#: the controller's role name rather than the address dialled.
SERVER_NAME_OPTIONS = (("grpc.ssl_target_name_override", CONTROLLER_SERVER_NAME),)


def peer_identity(context) -> Identity | None:
    """The identity of the peer of a server call (`grpc.aio` or sync
    context), None on a plaintext channel. Raises IdentityError when the
    peer's certificate names no usable identity."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    pems = auth.get("x509_pem_cert")
    if not pems:
        raise IdentityError("the peer presented no certificate")
    return identity_of_pem(pems[0])
