"""A lab PKI for tests of the agent's mTLS, made with `dpuctl certs`' own code."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import host_client
from host_client import _certs

if TYPE_CHECKING:
    from pathlib import Path


@dataclasses.dataclass(frozen=True)
class LabPki:
    """A CA, an agent certificate for 127.0.0.1/localhost, and client certificates."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def agent_env(self) -> dict[str, str]:
        """The agent's [tls] settings as environment variables."""
        return {
            "DPU_AGENT_TLS_CERT": str(self.directory / "agent.pem"),
            "DPU_AGENT_TLS_KEY": str(self.directory / "agent.key"),
            "DPU_AGENT_TLS_CLIENT_CA": str(self.ca),
        }

    def client(self, tenant: str, *, admin: bool = False) -> host_client.TlsConfig:
        """TLS settings of a client of `tenant` (its certificate is made on first use)."""
        cert = self.directory / f"client-{tenant}.pem"
        if not cert.exists():
            _certs.make_client(self.directory, tenant, admin=admin)
        return host_client.TlsConfig(
            ca=self.ca, cert=cert, key=self.directory / f"client-{tenant}.key"
        )

    def cli_args(self, tenant: str, *, admin: bool = False) -> list[str]:
        """`dpuctl` options of a client of `tenant`."""
        tls = self.client(tenant, admin=admin)
        return ["--ca", str(tls.ca), "--cert", str(tls.cert), "--key", str(tls.key)]


def make_pki(directory: Path) -> LabPki:
    """A new lab PKI in `directory`."""
    _certs.make_ca(directory)
    _certs.make_agent(directory, ["127.0.0.1", "localhost"])
    return LabPki(directory)
