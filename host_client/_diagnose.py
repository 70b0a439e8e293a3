"""Why the first call to an agent failed, in one line that says what to change.

gRPC reports a failed connection as "failed to connect to all addresses; ... Socket
closed" whatever the cause. When that happens the SDK probes the target itself (a TCP
connect, then TLS handshakes with Python's ssl module) and names the cause:

    nothing listens there       -> start the agent or fix the target
    plaintext against mTLS      -> give the CA and a client certificate
    TLS against plaintext       -> drop the TLS files (or give the agent its own)
    the agent's certificate is not from our CA, expired, or for another name
    our client certificate is expired, or not from the agent's client CA
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Final

from cryptography import x509

if TYPE_CHECKING:
    from host_client._tls import TlsConfig

PROBE_TIMEOUT: Final = 3.0
TLS_FLAGS: Final = "--ca, --cert and --key (or $DPU_TLS_CA, $DPU_TLS_CERT, $DPU_TLS_KEY)"
# X509_V_ERR_* codes in SSLCertVerificationError.verify_code
_EXPIRED: Final = 10
_NOT_YET_VALID: Final = 9
_HOSTNAME_MISMATCH: Final = 62
_IP_MISMATCH: Final = 64
_TLS_HANDSHAKE_RECORD: Final = b"\x16"


def is_connect_failure(details: str) -> bool:
    """Whether a gRPC UNAVAILABLE message is the channel failing to connect."""
    return "failed to connect to all addresses" in details


async def explain(target: str, tls: TlsConfig | None, timeout: float = PROBE_TIMEOUT) -> str | None:  # noqa: ASYNC109
    """One line on why a channel to `target` cannot connect, or None if the probe cannot tell."""
    try:
        return await asyncio.to_thread(explain_blocking, target, tls, timeout)
    except Exception:  # noqa: BLE001 - a diagnosis must never hide the real error
        return None


def _split(target: str) -> tuple[str, int] | None:
    target = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or "/" in target:
        return None
    return host.strip("[]"), int(port)


def explain_blocking(target: str, tls: TlsConfig | None, timeout: float) -> str | None:  # noqa: PLR0911 - one answer per cause
    """`explain`, blocking."""
    where = _split(target)
    if where is None:
        return None
    host, port = where
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        return (
            f"nothing listens at {target}: start the agent (dpu-agent serve) or point "
            "--target / $DPU_TARGET at the address it logs as 'serving'"
        )
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return f"cannot reach {target} ({reason}): check the address and that the agent runs"
    agent_tls = _speaks_tls(host, port, timeout)
    if tls is None:
        if agent_tls:
            return (
                f"the agent at {target} serves mTLS and this client spoke plaintext: pass "
                f"{TLS_FLAGS}; `dpuctl certs client DIR TENANT` makes a client certificate"
            )
        return None
    if not agent_tls:
        return (
            f"the agent at {target} serves plaintext and this client spoke TLS: drop "
            f"{TLS_FLAGS}, or give the agent [tls] cert, key and client_ca"
        )
    if tls.cert is not None:
        local = _client_validity(Path(tls.cert).expanduser())
        if local is not None:
            return f"this client's certificate {tls.cert} {local}"
    return _check_agent_certificate(target, host, port, tls, timeout) or _check_client(
        host, port, tls, timeout
    )


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the server answers a TLS ClientHello with a TLS handshake record.

    Only the hello is exchanged (the connection is closed before the handshake ends), so
    the agent logs no failed client authentication for this probe.
    """
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    hello = context.wrap_bio(incoming, outgoing, server_hostname=host)
    with contextlib.suppress(ssl.SSLWantReadError):
        hello.do_handshake()
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            raw.sendall(outgoing.read())
            answer = raw.recv(1)
    except OSError:
        return False
    return answer == _TLS_HANDSHAKE_RECORD


def _check_agent_certificate(
    target: str, host: str, port: int, tls: TlsConfig, timeout: float
) -> str | None:
    context = ssl.create_default_context(cafile=str(Path(tls.ca).expanduser()))
    if tls.cert is not None and tls.key is not None:  # so the agent logs no missing one
        context.load_cert_chain(str(Path(tls.cert).expanduser()), str(Path(tls.key).expanduser()))
    name = tls.server_name or host
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=name),
        ):
            return None
    except ssl.SSLCertVerificationError as exc:
        code = exc.verify_code
        if code == _EXPIRED:
            return (
                f"the agent's certificate at {target} has expired: renew it "
                "(dpuctl certs agent DIR --san ADDRESS) and restart the agent"
            )
        if code == _NOT_YET_VALID:
            return f"the agent's certificate at {target} is not valid yet: check both clocks"
        if code in (_HOSTNAME_MISMATCH, _IP_MISMATCH):
            return (
                f"the agent's certificate does not name {name}: connect by a name it carries, "
                "or set $DPU_TLS_SERVER_NAME to one"
            )
        return (
            f"the agent's certificate at {target} is not signed by the CA in {tls.ca} "
            f"({exc.verify_message}): pass the CA that signed it (--ca / $DPU_TLS_CA)"
        )
    except (ssl.SSLError, OSError):
        return None


def _check_client(host: str, port: int, tls: TlsConfig, timeout: float) -> str | None:
    if tls.cert is None or tls.key is None:
        return (
            "the agent requires a client certificate: pass --cert and --key "
            "(or $DPU_TLS_CERT, $DPU_TLS_KEY); `dpuctl certs client DIR TENANT` makes one"
        )
    context = ssl.create_default_context(cafile=str(Path(tls.ca).expanduser()))
    context.check_hostname = False
    context.set_alpn_protocols(["h2"])  # as gRPC offers it
    context.load_cert_chain(str(Path(tls.cert).expanduser()), str(Path(tls.key).expanduser()))
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=tls.server_name or host) as conn,
        ):
            # an accepted client gets the agent's HTTP/2 settings; a refused one an
            # alert or (TLS 1.3, after the handshake) a closed connection
            refused = conn.recv(1) == b""
    except ssl.SSLError:
        refused = True
    except OSError:
        return None
    if not refused:
        return None
    return (
        f"the agent refused this client's certificate {tls.cert}: it is not signed by the "
        "agent's client CA ([tls] client_ca); use a certificate from that CA"
    )


def _client_validity(path: Path) -> str | None:
    """What is wrong with the dates of the certificate in `path`, if anything."""
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError):
        return None
    now = dt.datetime.now(dt.UTC)
    if cert.not_valid_after_utc < now:
        return (
            f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: make a new one "
            "(dpuctl certs client DIR TENANT)"
        )
    if cert.not_valid_before_utc > now:
        return "is not valid yet: check this machine's clock"
    return None
