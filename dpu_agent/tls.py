"""Transport security of the gRPC listener: mTLS, or plaintext on loopback when asked.

The rules, checked before the agent binds (`dpu-agent check-config` runs them too):

- `[tls] cert`, `key` and `client_ca` all set: the agent serves TLS and requires a
  client certificate that chains to `client_ca` (mTLS), on any address. Callers are
  identified by their certificate (`dpu_agent.identity`).
- none of them set: allowed only with `[tls] plaintext_loopback = true` and a loopback
  listen address (127.0.0.0/8, ::1, localhost). Callers are then the local admin, or,
  with `[auth] tokens_file`, whoever their bearer token names.
- anything else (a non-loopback address without TLS, part of the TLS files, TLS and
  plaintext both asked for, tokens with TLS) refuses to start with a message that
  says what to set.

The key file must not be readable by group or others. Files are read once, at start.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Final

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from dpu_agent.config import ConfigError
from dpu_agent.identity import (
    Authenticator,
    CertificateAuthenticator,
    LoopbackAuthenticator,
    TokensFileError,
    load_tokens,
)
from dpu_agent.private_files import read_with_mode

if TYPE_CHECKING:
    from dpu_agent.config import AgentConfig

log = logging.getLogger(__name__)

MAX_PEM_BYTES: Final = 1 << 20
EXPIRY_WARNING: Final = dt.timedelta(days=30)
_HOW: Final = (
    "set [tls] cert, key and client_ca (DPU_AGENT_TLS_CERT, _KEY, _CLIENT_CA; "
    "`dpuctl certs` makes a lab set)"
)


@dataclasses.dataclass(frozen=True)
class Security:
    """How the listener is secured and how callers are identified."""

    mode: str  # "mtls" or "plaintext-loopback"
    credentials: grpc.ServerCredentials | None  # None: plaintext
    authenticator: Authenticator
    description: str


def is_loopback(listen: str) -> bool:
    """Whether a host:port listen address is on loopback only."""
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def security(config: AgentConfig) -> Security:
    """Check the [tls]/[auth] settings against the listen address; ConfigError if wrong."""
    files = {
        "cert": config.tls_cert,
        "key": config.tls_key,
        "client_ca": config.tls_client_ca,
    }
    given = [k for k, v in files.items() if v]
    if given and len(given) < len(files):
        missing = ", ".join(f"tls.{k}" for k in files if not files[k])
        raise ConfigError(f"TLS needs cert, key and client_ca together; {missing} not set")
    if given:
        if config.tls_plaintext_loopback:
            raise ConfigError(
                "tls.plaintext_loopback = true and TLS files are both set: choose one"
            )
        if config.auth_tokens_file:
            raise ConfigError(
                "auth.tokens_file is for plaintext loopback only; with TLS the tenant "
                "comes from the client certificate"
            )
        return _mtls(config)
    if not is_loopback(config.listen):
        raise ConfigError(
            f"the agent listens on {config.listen}, not loopback, and no TLS is configured: "
            f"{_HOW}. Plaintext is only served on loopback."
        )
    if not config.tls_plaintext_loopback:
        raise ConfigError(
            f"no TLS is configured: {_HOW}, or set [tls] plaintext_loopback = true "
            "(DPU_AGENT_TLS_PLAINTEXT_LOOPBACK=1, --plaintext-loopback) to serve loopback "
            "in plaintext"
        )
    if config.auth_tokens_file:
        try:
            tokens = load_tokens(Path(config.auth_tokens_file).expanduser())
        except TokensFileError as exc:
            raise ConfigError(f"auth.tokens_file: {exc}") from None
        return Security(
            "plaintext-loopback",
            None,
            tokens,
            f"plaintext on loopback; bearer tokens of {len(tokens)} entries",
        )
    return Security(
        "plaintext-loopback",
        None,
        LoopbackAuthenticator(),
        "plaintext on loopback; every caller is the local admin (no tokens file)",
    )


def _read(path_text: str, what: str, *, private: bool = False) -> bytes:
    path = Path(path_text).expanduser()
    try:
        data, mode = read_with_mode(path, MAX_PEM_BYTES)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if private and mode & 0o077:
        raise ConfigError(
            f"{what}: {path} may be read by group or others (mode {mode:04o}); it must be 0600"
        )
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(f"{what}: {path} is larger than {MAX_PEM_BYTES} bytes")
    return data


def _certificates(data: bytes, what: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(f"{what}: not PEM certificates: {exc}") from None
    return certs


def _mtls(config: AgentConfig) -> Security:
    chain_pem = _read(config.tls_cert, "tls.cert")
    key_pem = _read(config.tls_key, "tls.key", private=True)
    ca_pem = _read(config.tls_client_ca, "tls.client_ca")
    chain = _certificates(chain_pem, "tls.cert")
    _certificates(ca_pem, "tls.client_ca")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"tls.key: not an unencrypted PEM private key: {exc}") from None
    leaf = chain[0]
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(
        serialization.Encoding.DER, spki
    ) != leaf.public_key().public_bytes(serialization.Encoding.DER, spki):
        raise ConfigError("tls.key does not belong to the certificate in tls.cert")
    now = dt.datetime.now(dt.UTC)
    if leaf.not_valid_after_utc <= now:
        raise ConfigError(f"tls.cert expired on {leaf.not_valid_after_utc:%Y-%m-%d}")
    if leaf.not_valid_after_utc - now < EXPIRY_WARNING:
        log.warning(
            "the agent's certificate expires soon",
            extra={"not_after": leaf.not_valid_after_utc.isoformat()},
        )
    credentials = grpc.ssl_server_credentials(
        [(key_pem, chain_pem)], root_certificates=ca_pem, require_client_auth=True
    )
    return Security(
        "mtls",
        credentials,
        CertificateAuthenticator(),
        "mTLS: client certificates required (tenant = subject CN, O=admin for the admin role)",
    )
