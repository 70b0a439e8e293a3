"""The listener's security rules (dpu_agent.tls) and the lab PKI of `dpuctl certs`."""

import dataclasses
import datetime as dt
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dpu_agent import config, identity, tls
from host_client import _certs

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lab")
    _certs.make_ca(directory)
    _certs.make_agent(directory, ["127.0.0.1", "dpu0.lab"])
    return directory


def cfg(**values):
    return dataclasses.replace(config.AgentConfig(agent_id="t"), **values)


def with_tls(lab, **values):
    files = {
        "tls_cert": str(lab / "agent.pem"),
        "tls_key": str(lab / "agent.key"),
        "tls_client_ca": str(lab / "ca.pem"),
    }
    return cfg(**{**files, **values})


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:1", True),
        ("127.1.2.3:1", True),
        ("[::1]:1", True),
        ("localhost:1", True),
        ("0.0.0.0:1", False),
        ("[::]:1", False),
        ("10.0.0.1:1", False),
        ("dpu0.lab:1", False),
    ],
)
def test_loopback_addresses(listen, loopback):
    assert tls.is_loopback(listen) is loopback


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "no TLS is configured"),
        ({"listen": "0.0.0.0:1"}, "not loopback, and no TLS is configured"),
        ({"listen": "0.0.0.0:1", "tls_plaintext_loopback": True}, "not loopback"),
        ({"tls_cert": "/x.pem"}, r"tls\.key, tls\.client_ca not set"),
        ({"tls_plaintext_loopback": True, "auth_tokens_file": "/nonexistent"}, "cannot read"),
    ],
)
def test_what_the_agent_refuses(values, message):
    with pytest.raises(config.ConfigError, match=message):
        tls.security(cfg(**values))


def test_plaintext_loopback_when_asked():
    security = tls.security(cfg(tls_plaintext_loopback=True))
    assert security.mode == "plaintext-loopback"
    assert security.credentials is None
    assert isinstance(security.authenticator, identity.LoopbackAuthenticator)


def test_mtls_on_any_address(lab):
    security = tls.security(with_tls(lab, listen="0.0.0.0:50051"))
    assert security.mode == "mtls"
    assert security.credentials is not None
    assert isinstance(security.authenticator, identity.CertificateAuthenticator)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls_plaintext_loopback": True}, "choose one"),
        ({"auth_tokens_file": "/t.toml"}, "plaintext loopback only"),
    ],
)
def test_tls_does_not_mix_with_plaintext_or_tokens(lab, values, message):
    with pytest.raises(config.ConfigError, match=message):
        tls.security(with_tls(lab, **values))


def test_bad_tls_files(lab, tmp_path):
    open_key = tmp_path / "open.key"
    open_key.write_bytes((lab / "agent.key").read_bytes())
    open_key.chmod(0o640)
    with pytest.raises(config.ConfigError, match="must be 0600"):
        tls.security(with_tls(lab, tls_key=str(open_key)))
    other = tmp_path / "other"
    _certs.make_ca(other)
    _certs.make_agent(other, ["127.0.0.1"])
    with pytest.raises(config.ConfigError, match="does not belong to the certificate"):
        tls.security(with_tls(lab, tls_key=str(other / "agent.key")))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(config.ConfigError, match=r"tls\.client_ca: not PEM certificates"):
        tls.security(with_tls(lab, tls_client_ca=str(garbage)))
    with pytest.raises(config.ConfigError, match="cannot read"):
        tls.security(with_tls(lab, tls_cert=str(tmp_path / "absent.pem")))


def test_an_expired_agent_certificate_is_refused(tmp_path):
    _certs.make_ca(tmp_path)
    _certs.make_agent(tmp_path, ["127.0.0.1"])
    cert = x509.load_pem_x509_certificate((tmp_path / "agent.pem").read_bytes())
    # the same certificate, but valid until yesterday
    key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    now = dt.datetime.now(dt.UTC)
    agent_key = serialization.load_pem_private_key((tmp_path / "agent.key").read_bytes(), None)
    assert isinstance(agent_key, ec.EllipticCurvePrivateKey)
    expired = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(cert.issuer)
        .public_key(agent_key.public_key())
        .serial_number(2)
        .not_valid_before(now - dt.timedelta(days=10))
        .not_valid_after(now - dt.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "agent.pem").write_bytes(expired.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(config.ConfigError, match=r"tls\.cert expired on"):
        tls.security(with_tls(tmp_path))


def test_lab_pki_files_modes_and_fields(lab):
    for name in ("ca.key", "agent.key"):
        assert stat.S_IMODE((lab / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((lab / "agent.pem").stat().st_mode) == 0o644
    ca = x509.load_pem_x509_certificate((lab / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    agent = x509.load_pem_x509_certificate((lab / "agent.pem").read_bytes())
    sans = agent.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert sans.get_values_for_type(x509.DNSName) == ["dpu0.lab"]
    usage = agent.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert agent.issuer == ca.subject
    agent.verify_directly_issued_by(ca)
    cert, key = _certs.make_client(lab, "tenant-a")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    client = x509.load_pem_x509_certificate(cert.read_bytes())
    assert client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "tenant-a"
    assert not client.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    client.verify_directly_issued_by(ca)


def test_lab_pki_keeps_existing_files_unless_forced(lab):
    with pytest.raises(_certs.CertError, match="exists"):
        _certs.make_ca(lab)
    before = (lab / "agent.pem").read_bytes()
    _certs.make_agent(lab, ["127.0.0.1"], force=True)
    assert (lab / "agent.pem").read_bytes() != before
    assert stat.S_IMODE((lab / "agent.key").stat().st_mode) == 0o600
    with pytest.raises(_certs.CertError, match="neither an IP address nor a DNS name"):
        _certs.make_agent(lab, ["bad..name"], force=True)
    with pytest.raises(_certs.CertError, match="lowercase DNS label"):
        _certs.make_client(lab, "Tenant A")


def test_dpuctl_certs_commands(tmp_path):
    def dpuctl(*args):
        return subprocess.run(
            [str(BIN / "dpuctl"), "certs", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    assert dpuctl("agent", str(tmp_path), "--san", "127.0.0.1").returncode == 1  # no CA yet
    made = dpuctl("ca", str(tmp_path))
    assert made.returncode == 0, made.stderr
    assert f"wrote {tmp_path / 'ca.key'}" in made.stdout
    assert dpuctl("agent", str(tmp_path), "--san", "127.0.0.1").returncode == 0
    assert dpuctl("client", str(tmp_path), "ops", "--admin").returncode == 0
    assert stat.S_IMODE((tmp_path / "client-ops.key").stat().st_mode) == 0o600
    again = dpuctl("ca", str(tmp_path))
    assert again.returncode == 1
    assert "exists (use --force" in again.stderr
    token = dpuctl("token", "tenant-a")
    assert token.returncode == 0
    assert len(token.stdout.strip()) >= 40
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(token.stderr)
    tokens.chmod(0o600)
    loaded = identity.load_tokens(tokens)
    assert identity.token_digest(token.stdout.strip()) in loaded._by_digest
