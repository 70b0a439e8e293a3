"""How the SDK secures its channel: mTLS to the agent, or plaintext to a loopback agent.

An agent on any address but loopback serves mTLS only: the SDK needs the CA that
signed the agent's certificate and its own client certificate and key (which name
its tenant). A plaintext agent on loopback may ask for a bearer token; the SDK then
sends it over gRPC local credentials, which refuse any target that is not loopback,
so a token never leaves the machine in the clear.

Environment (read when the caller passes nothing):

    DPU_TLS_CA           CA bundle (PEM) that signed the agent's certificate
    DPU_TLS_CERT         this client's certificate (PEM)
    DPU_TLS_KEY          its private key (PEM)
    DPU_TLS_SERVER_NAME  the name to expect in the agent's certificate (default: the
                         target's host)
    DPU_TOKEN            bearer token for a plaintext loopback agent
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

import grpc

from host_client._errors import InvalidArgumentError

if TYPE_CHECKING:
    from collections.abc import Mapping

CA_ENV: Final = "DPU_TLS_CA"
CERT_ENV: Final = "DPU_TLS_CERT"
KEY_ENV: Final = "DPU_TLS_KEY"
SERVER_NAME_ENV: Final = "DPU_TLS_SERVER_NAME"
TOKEN_ENV: Final = "DPU_TOKEN"  # noqa: S105 - the variable name, not a token
MAX_PEM_BYTES: Final = 1 << 20


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """The files of a TLS channel to the agent.

    Attributes:
        ca: CA bundle (PEM file) that signed the agent's certificate.
        cert: this client's certificate (PEM file); its subject CN is the tenant.
        key: the certificate's private key (PEM file).
        server_name: the name the agent's certificate must carry (default: the
            host of the target).
    """

    ca: str | Path
    cert: str | Path | None = None
    key: str | Path | None = None
    server_name: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TlsConfig | None:
        """The TLS settings in $DPU_TLS_CA, $DPU_TLS_CERT, ...; None if $DPU_TLS_CA is unset."""
        env = os.environ if environ is None else environ
        ca = env.get(CA_ENV)
        if not ca:
            if env.get(CERT_ENV) or env.get(KEY_ENV):
                raise InvalidArgumentError(
                    "INVALID_ARGUMENT", f"${CERT_ENV}/${KEY_ENV} are set but ${CA_ENV} is not"
                )
            return None
        return cls(
            ca=ca,
            cert=env.get(CERT_ENV) or None,
            key=env.get(KEY_ENV) or None,
            server_name=env.get(SERVER_NAME_ENV) or None,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials of the files (read now)."""
        if (self.cert is None) != (self.key is None):
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", "a client certificate and its key go together (cert and key)"
            )
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, "CA"),
            private_key=_read(self.key, "key") if self.key is not None else None,
            certificate_chain=_read(self.cert, "certificate") if self.cert is not None else None,
        )

    def tenant(self) -> str | None:
        """The tenant the agent takes this client for: its certificate's subject CN.

        None without a certificate. The agent reads the tenant the same way
        (dpu_agent/identity.py), and refuses a certificate without exactly one CN.
        """
        if self.cert is None:
            return None
        from cryptography import x509  # noqa: PLC0415 - only `flow apply --prune` asks
        from cryptography.x509.oid import NameOID  # noqa: PLC0415

        try:
            cert = x509.load_pem_x509_certificate(_read(self.cert, "certificate"))
        except ValueError:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", f"the TLS certificate {self.cert} is not a PEM certificate"
            ) from None
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if len(names) != 1:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", f"the TLS certificate {self.cert} has no single subject CN"
            )
        value = names[0].value
        return value if isinstance(value, str) else value.decode()

    def options(self) -> list[tuple[str, str]]:
        """Channel options (the expected server name, when given)."""
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def _read(path: str | Path, what: str) -> bytes:
    try:
        with Path(path).expanduser().open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise InvalidArgumentError(
            "INVALID_ARGUMENT", f"cannot read the TLS {what} {path}: {exc.strerror}"
        ) from None
    if len(data) > MAX_PEM_BYTES:
        raise InvalidArgumentError("INVALID_ARGUMENT", f"the TLS {what} {path} is too large")
    return data


def open_channel(
    target: str, tls: TlsConfig | None, token: str | None, options: list[tuple[str, str]]
) -> grpc.aio.Channel:
    """A channel to the agent: TLS (with the token, if any), local + token, or plaintext."""
    call_credentials = grpc.access_token_call_credentials(token) if token else None
    if tls is not None:
        credentials = tls.credentials()
        if call_credentials is not None:
            credentials = grpc.composite_channel_credentials(credentials, call_credentials)
        return grpc.aio.secure_channel(target, credentials, options=options + tls.options())
    if call_credentials is not None:  # only ever sent to a loopback peer
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        credentials = grpc.composite_channel_credentials(local, call_credentials)
        return grpc.aio.secure_channel(target, credentials, options=options)
    return grpc.aio.insecure_channel(target, options=options)
