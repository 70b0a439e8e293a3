"""A lab PKI for the agent's mTLS: a CA, the agent's certificate, tenants' certificates.

All in one directory (the CA's key too, so this is for labs and tests; a production
deployment signs with its own CA and only needs the same subject fields):

    ca.pem, ca.key                  the CA (10 years by default)
    agent.pem, agent.key            the agent's server certificate, SANs as given
    client-{tenant}.pem, .key       a tenant's client certificate: subject CN = tenant,
                                    O = admin for the admin role

Keys are ECDSA P-256, written with mode 0600; certificates 0644. Existing files are
not overwritten unless `force`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from typing import TYPE_CHECKING, Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dpu_wire import names

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

ADMIN_ORGANIZATION: Final = "admin"  # the agent's auth.ADMIN_ROLE
CA_DAYS: Final = 3650
LEAF_DAYS: Final = 365
TOKEN_BYTES: Final = 32
_SKEW: Final = dt.timedelta(minutes=5)


class CertError(Exception):
    """A lab PKI operation failed; the message says why."""


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(path: Path, data: bytes, mode: int, *, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        raise CertError(f"{path} exists (use --force to replace it)") from None
    except OSError as exc:
        raise CertError(f"cannot write {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, mode)  # also when an existing file is replaced
        os.write(fd, data)
    finally:
        os.close(fd)


def _save(
    directory: Path,
    stem: str,
    cert: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    *,
    force: bool,
) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    _write(key_path, key_pem, 0o600, force=force)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644, force=force)
    return cert_path, key_path


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    if not 1 <= days <= 36500:
        raise CertError(f"days must be 1..36500, not {days}")
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def make_ca(
    directory: Path, *, name: str = "dpu-offload lab CA", days: int = CA_DAYS, force: bool = False
) -> tuple[Path, Path]:
    """Make a CA in `directory` (ca.pem, ca.key); return their paths."""
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
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
        .sign(key, hashes.SHA256())
    )
    return _save(directory, "ca", cert, key, force=force)


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), None)
    except OSError as exc:
        raise CertError(
            f"no CA in {directory} ({exc.strerror}): run `dpuctl certs ca {directory}` first"
        ) from None
    except ValueError as exc:
        raise CertError(f"the CA in {directory} cannot be read: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{directory / 'ca.key'} is not an EC key made by dpuctl certs")
    return cert, key


def _leaf_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )


def _san(value: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(value))
    except ValueError:
        pass
    label = value.lower()
    if not label or len(label) > 253 or any(not part for part in label.split(".")):
        raise CertError(f"{value!r} is neither an IP address nor a DNS name")
    return x509.DNSName(label)


def make_agent(
    directory: Path, sans: Sequence[str], *, days: int = LEAF_DAYS, force: bool = False
) -> tuple[Path, Path]:
    """The agent's server certificate for the names/addresses in `sans` (agent.pem, .key)."""
    if not sans:
        raise CertError("give the agent's addresses or DNS names (--san), e.g. 127.0.0.1")
    ca_cert, ca_key = _load_ca(directory)
    general = [_san(s) for s in sans]
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sans[0][:64])])
    cert = (
        _builder(subject, ca_cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(general), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _save(directory, "agent", cert, key, force=force)


def make_client(
    directory: Path,
    tenant: str,
    *,
    admin: bool = False,
    days: int = LEAF_DAYS,
    force: bool = False,
) -> tuple[Path, Path]:
    """A tenant's client certificate (client-{tenant}.pem, .key): CN = tenant, O=admin if admin."""
    try:
        names.check_id(tenant, "tenant")
    except names.InvalidNameError as exc:
        raise CertError(str(exc)) from None
    ca_cert, ca_key = _load_ca(directory)
    key = _new_key()
    attributes = (
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ADMIN_ORGANIZATION)] if admin else []
    )
    subject = x509.Name([*attributes, x509.NameAttribute(NameOID.COMMON_NAME, tenant)])
    cert = (
        _builder(subject, ca_cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_leaf_usage(), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _save(directory, f"client-{tenant}", cert, key, force=force)


def make_token(tenant: str, *, admin: bool = False) -> tuple[str, str]:
    """A new bearer token and the tokens-file entry (TOML) that gives it to `tenant`."""
    try:
        names.check_id(tenant, "tenant")
    except names.InvalidNameError as exc:
        raise CertError(str(exc)) from None
    token = secrets.token_urlsafe(TOKEN_BYTES)
    digest = hashes.Hash(hashes.SHA256())
    digest.update(token.encode())
    entry = (
        f'[[token]]\ntenant = "{tenant}"\nsha256 = "{digest.finalize().hex()}"\n'
        f"admin = {'true' if admin else 'false'}\n"
    )
    return token, entry
