"""Who is on the other end of a channel: roles, names, and the ids we accept.

A certificate names its holder in its subject: the common name (CN) is the
holder's name (a host id for a host) and the organizational unit (OU) its
role. Three roles exist:

- `controller` (OU `elastic-controller`): serves the Controller service;
  its certificate also carries the names agents dial (the DNS name
  `elastic-controller`, and DNS/IP SANs) and the serverAuth key usage.
- `host` (OU `elastic-host`): one agent; may register, stream and report
  only as the host id in its CN. Its certificate has serverAuth too, for
  the agent's own port (health, reflection), but only under the name
  `elastic-host`: agents dial controllers by `elastic-controller`, so a
  host certificate cannot stand in for a controller (certificates issued
  before this had no serverAuth at all; the agent's port needs a new one).
- `operator` (OU `elastic-operator`): people and tools (`elasticd status`,
  `elasticd local`'s progress line): may read status, nothing else.

Ids (job, host, failure domain, incarnation) are limited to a safe charset
and length, so that they can go into paths, log lines and certificate names
without escaping: `ID_RULE`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re

#: What an id may look like (host ids, job ids, failure domains, incarnations).
ID_RULE = "1 to 128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def id_problem(value: str, what: str = "id") -> str | None:
    """Why `value` is not an acceptable id (a sentence naming `what`), or None."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        shown = repr(value[:40] + ("..." if len(value) > 40 else "")) \
            if isinstance(value, str) else type(value).__name__
        return f"{what} {shown} is not valid: use {ID_RULE}"
    return None


def check_id(value: str, what: str = "id") -> str:
    """`value` if it is an acceptable id; raises ValueError naming `what` otherwise."""
    problem = id_problem(value, what)
    if problem:
        raise ValueError(problem)
    return value


class Role(enum.Enum):
    """What a certificate's holder may do (its subject's OU)."""

    CONTROLLER = "elastic-controller"
    HOST = "elastic-host"
    OPERATOR = "elastic-operator"

    @property
    def short(self) -> str:
        """"controller" / "host" / "operator": the name used on command lines."""
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Role":
        """A role from its short name or OU. Raises ValueError."""
        for role in cls:
            if text in (role.short, role.value):
                return role
        raise ValueError(f"unknown role {text!r}; expected one of "
                         f"{', '.join(r.short for r in cls)}")


@dataclasses.dataclass(frozen=True)
class Identity:
    """An authenticated peer: its role, its name (the CN) and the SHA-256
    fingerprint of its certificate (hex), which tells two certificates of
    the same name apart."""

    role: Role
    name: str
    fingerprint: str

    def __str__(self) -> str:
        return f"{self.role.short} {self.name}"


class IdentityError(ValueError):
    """A certificate that names no usable identity (no or several roles,
    a CN that is not a valid id)."""


def identity_of(cert) -> Identity:
    """The identity a `cryptography.x509.Certificate` names. Raises
    IdentityError when its subject has no CN, no known OU, several known
    OUs, or a CN that is not a valid id."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)]
    roles = [r for r in Role if r.value in ous]
    if len(cns) != 1:
        raise IdentityError(f"certificate subject {cert.subject.rfc4514_string()!r} needs "
                            f"exactly one CN (the holder's name)")
    if len(roles) != 1:
        raise IdentityError(f"certificate subject {cert.subject.rfc4514_string()!r} needs "
                            f"exactly one OU of {', '.join(r.value for r in Role)}")
    name = str(cns[0].value)
    problem = id_problem(name, "certificate CN")
    if problem:
        raise IdentityError(problem)
    return Identity(roles[0], name, cert.fingerprint(hashes.SHA256()).hex())


@functools.lru_cache(maxsize=4096)
def identity_of_pem(pem: bytes) -> Identity:
    """`identity_of` a PEM certificate (cached: a peer's certificate is
    parsed once, however many calls it makes). Raises IdentityError,
    also for bytes that are not a PEM certificate."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise IdentityError(f"peer certificate cannot be parsed: {e}") from None
    return identity_of(cert)
