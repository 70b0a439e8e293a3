"""Working out the principal of a call: client certificate, bearer token, or loopback.

Client certificate (mTLS, the agent's mode on any address). The TLS handshake has
already checked the chain against `[tls] client_ca`. The **tenant is the subject
common name (CN)** of the client certificate, which must be a resource id (lowercase
letters, digits and '-', at most 63 characters); the certificate holds the **admin
role when its subject has an organization (O) `admin`** (as Kubernetes reads CN as
the user and O as groups). `dpuctl certs client TENANT [--admin]` makes such
certificates.

Bearer token (plaintext loopback with `[auth] tokens_file`). The call carries
`authorization: Bearer <token>` metadata; the file, TOML that only its owner may
read, maps the tokens' SHA-256 to tenants (`dpuctl certs token` prints an entry):

    [[token]]
    tenant = "tenant-a"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    admin = false

Plaintext loopback without a tokens file: every caller is `auth.LOCAL_ADMIN` (tenant
"default", admin role): a single-user lab, as before tenants existed.

Health checks and server reflection (outside the dpu.v1 API) are answered without
credentials on a plaintext loopback agent; on a TLS agent nothing is answered
without a client certificate, because the handshake needs one.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import ipaddress
from typing import TYPE_CHECKING, Any, Final

from cryptography import x509
from cryptography.x509.oid import NameOID

from dpu_agent.auth import ADMIN_ROLE, LOCAL_ADMIN, Principal, Via
from dpu_agent.errors import Unauthenticated
from dpu_agent.private_files import read_toml
from dpu_wire import names

if TYPE_CHECKING:
    from pathlib import Path

    import grpc

AUTHORIZATION_METADATA_KEY: Final = "authorization"
MAX_TOKENS: Final = 10_000
MAX_TOKENS_FILE_BYTES: Final = 4 << 20
_SHA256_HEX: Final = 64


class TokensFileError(ValueError):
    """The tokens file is unreadable, too open or malformed; the message says why."""


class Authenticator(abc.ABC):
    """Works out who makes a call, or raises Unauthenticated."""

    @abc.abstractmethod
    def authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        """The principal of the call `context` belongs to."""


class CertificateAuthenticator(Authenticator):
    """mTLS: the tenant is the client certificate's subject CN, O=admin the admin role."""

    def authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        """See `Authenticator.authenticate`."""
        pems = list(context.auth_context().get("x509_pem_cert", []))
        if not pems:
            raise Unauthenticated("the call carries no client certificate")
        return principal_from_certificate(bytes(pems[0]))


@functools.lru_cache(maxsize=1024)
def principal_from_certificate(pem: bytes) -> Principal:
    """The principal a (verified) client certificate names; Unauthenticated if none."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise Unauthenticated("the client certificate cannot be parsed") from None
    common_names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(common_names) != 1:
        raise Unauthenticated(
            "the client certificate must have exactly one subject CN (the tenant)"
        )
    value = common_names[0].value
    tenant = value if isinstance(value, str) else value.decode("utf-8", "replace")
    try:
        names.check_id(tenant, "the client certificate's CN (tenant)")
    except names.InvalidNameError as exc:
        raise Unauthenticated(str(exc)) from None
    organizations = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    admin = any(attr.value == ADMIN_ROLE for attr in organizations)
    return Principal(tenant, admin=admin, via=Via.CERTIFICATE)


class LoopbackAuthenticator(Authenticator):
    """Plaintext loopback without tokens: every local caller is the local admin."""

    def authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        """See `Authenticator.authenticate`."""
        _require_loopback_peer(context)
        return LOCAL_ADMIN


class TokenAuthenticator(Authenticator):
    """Plaintext loopback with a tokens file: `authorization: Bearer <token>`."""

    def __init__(self, tokens: dict[str, Principal]) -> None:
        self._by_digest = dict(tokens)  # hex SHA-256 of a token -> its principal

    def __len__(self) -> int:
        return len(self._by_digest)

    def authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        """See `Authenticator.authenticate`."""
        _require_loopback_peer(context)
        token = bearer_token(context.invocation_metadata() or ())
        if token is None:
            raise Unauthenticated(
                "this agent needs 'authorization: Bearer <token>' metadata (dpuctl --token)"
            )
        principal = self._by_digest.get(token_digest(token))
        if principal is None:
            raise Unauthenticated("the bearer token is not known to this agent")
        return principal


def bearer_token(metadata: Any) -> str | None:  # noqa: ANN401 - grpc's metadata sequence
    """The token of the first `authorization: Bearer ...` entry, or None."""
    for key, value in metadata:
        if key != AUTHORIZATION_METADATA_KEY or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def _require_loopback_peer(context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if not peer_is_loopback(context.peer() or ""):
        raise Unauthenticated("plaintext calls are only taken from loopback")


def peer_is_loopback(peer: str) -> bool:
    """Whether a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000") is loopback."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in {"ipv4", "ipv6"}:
        return False
    host = rest.rpartition(":")[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def load_tokens(path: Path) -> TokenAuthenticator:
    """Read a tokens file (see the module docstring); TokensFileError says what is wrong."""
    doc = read_toml(path, MAX_TOKENS_FILE_BYTES, TokensFileError, secret=True)
    unknown = set(doc) - {"token"}
    if unknown:
        raise TokensFileError(f"{path}: unknown key {min(unknown)!r} (expected [[token]])")
    entries = doc.get("token", [])
    if not isinstance(entries, list) or len(entries) > MAX_TOKENS:
        raise TokensFileError(f"{path}: [[token]] must be a list of at most {MAX_TOKENS} tables")
    tokens: dict[str, Principal] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: token[{index}]"
        digest, principal = _token_entry(entry, where)
        if digest in tokens:
            raise TokensFileError(f"{where}: the same token is listed twice")
        tokens[digest] = principal
    return TokenAuthenticator(tokens)


def _token_entry(entry: object, where: str) -> tuple[str, Principal]:
    if not isinstance(entry, dict):
        raise TokensFileError(f"{where}: must be a table")
    unknown = set(entry) - {"tenant", "sha256", "admin"}
    if unknown:
        raise TokensFileError(f"{where}: unknown key {min(unknown)!r}")
    tenant, digest, admin = entry.get("tenant"), entry.get("sha256"), entry.get("admin", False)
    if not isinstance(tenant, str):
        raise TokensFileError(f"{where}: tenant must be a string")
    try:
        names.check_id(tenant, "tenant")
    except names.InvalidNameError as exc:
        raise TokensFileError(f"{where}: {exc}") from None
    if (
        not isinstance(digest, str)
        or len(digest) != _SHA256_HEX
        or any(c not in "0123456789abcdef" for c in digest.lower())
    ):
        raise TokensFileError(f"{where}: sha256 must be 64 hex digits (the token's SHA-256)")
    if not isinstance(admin, bool):
        raise TokensFileError(f"{where}: admin must be true or false")
    return digest.lower(), Principal(tenant, admin=admin, via=Via.TOKEN)


def token_digest(token: str) -> str:
    """The hex SHA-256 a tokens file lists for `token`."""
    return hashlib.sha256(token.encode()).hexdigest()
