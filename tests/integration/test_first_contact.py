"""First contact gone wrong: one line that says what to change, from the SDK, dpuctl, the agent.

Real agents (one mTLS, one plaintext), real certificates from the lab PKI code, and
the usual mistakes: plaintext to the mTLS agent, TLS to the plaintext one, the wrong
CA, a client certificate from another CA, an expired client certificate, no agent.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

import host_client
from host_client import _certs
from tests.integration.conftest import start_agent
from tests.integration.pki import make_pki

DPUCTL = [sys.executable, "-m", "host_client.cli"]
CORE_LINE = re.compile(r"^[IWEF]\d{4} ", re.MULTILINE)  # gRPC core's own log format


def _expired_client(pki_dir: Path, tenant: str) -> Path:
    """A client certificate from the right CA that expired yesterday."""
    _certs.make_client(pki_dir, tenant)
    good = x509.load_pem_x509_certificate((pki_dir / f"client-{tenant}.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((pki_dir / "ca.key").read_bytes(), None)
    key = serialization.load_pem_private_key((pki_dir / f"client-{tenant}.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(good.subject)
        .issuer_name(good.issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=10))
        .not_valid_after(now - dt.timedelta(days=1))
    )
    for extension in good.extensions:
        builder = builder.add_extension(extension.value, extension.critical)
    path = pki_dir / f"client-{tenant}-expired.pem"
    path.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first-contact")
    pki = make_pki(tmp / "pki")
    other = tmp / "other-pki"
    other.mkdir()
    _certs.make_ca(other, name="some other CA")
    _certs.make_client(other, "demo")
    good = pki.client("demo")
    expired = _expired_client(pki.directory, "late")
    tls_agent = start_agent(tmp, pki=pki)
    plain_agent = start_agent(tmp)
    cases = {
        "plaintext to mTLS": (
            tls_agent.address,
            None,
            "serves mTLS and this client spoke plaintext",
        ),
        "TLS to plaintext": (
            plain_agent.address,
            good,
            "serves plaintext and this client spoke TLS",
        ),
        "wrong CA": (
            tls_agent.address,
            host_client.TlsConfig(ca=other / "ca.pem", cert=good.cert, key=good.key),
            "is not signed by the CA in .*pass the CA that signed it",
        ),
        "client cert from another CA": (
            tls_agent.address,
            host_client.TlsConfig(
                ca=pki.ca, cert=other / "client-demo.pem", key=other / "client-demo.key"
            ),
            "the agent refused this client's certificate .*client_ca",
        ),
        "expired client cert": (
            tls_agent.address,
            host_client.TlsConfig(ca=pki.ca, cert=expired, key=pki.directory / "client-late.key"),
            r"client-late-expired\.pem expired on .*make a new one",
        ),
        "no agent": ("127.0.0.1:1", None, "nothing listens at 127.0.0.1:1: start the agent"),
    }
    yield cases, tls_agent
    assert tls_agent.terminate() == 0
    assert plain_agent.terminate() == 0


CASES = [
    "plaintext to mTLS",
    "TLS to plaintext",
    "wrong CA",
    "client cert from another CA",
    "expired client cert",
    "no agent",
]


@pytest.mark.parametrize("case", CASES)
def test_the_sdk_says_what_to_change(world, case):
    cases, _ = world
    target, tls, expected = cases[case]
    with (
        host_client.SyncClient(target, tls=tls or False, timeout=5) as client,
        pytest.raises(host_client.UnavailableError) as caught,
    ):
        client.agent_info()
    assert re.search(expected, caught.value.message), caught.value.message
    assert "failed to connect to all addresses" not in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("case", ["plaintext to mTLS", "no agent"])
def test_wait_ready_says_it_too(world, case):
    cases, _ = world
    target, _, expected = cases[case]
    with (
        host_client.SyncClient(target, tls=False) as client,
        pytest.raises(host_client.UnavailableError, match=expected),
    ):
        client.wait_ready(1)


@pytest.mark.parametrize("case", CASES)
def test_dpuctl_prints_one_line(world, case, monkeypatch):
    cases, _ = world
    target, tls, expected = cases[case]
    for name in ("DPU_TLS_CA", "DPU_TLS_CERT", "DPU_TLS_KEY", "GRPC_VERBOSITY"):
        monkeypatch.delenv(name, raising=False)
    args = ["--target", target, "--timeout", "5"]
    if tls is None:
        args.append("--plaintext")
    else:
        args += ["--ca", str(tls.ca), "--cert", str(tls.cert), "--key", str(tls.key)]
    run = subprocess.run(
        [*DPUCTL, *args, "info"], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 1
    assert run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr  # no gRPC core line next to ours
    assert lines[0].startswith("dpuctl: UNAVAILABLE: ")
    assert re.search(expected, lines[0]), lines[0]


def test_the_agent_logs_each_cause_once_in_its_own_format(world):
    cases, tls_agent = world
    for case in ("plaintext to mTLS", "client cert from another CA", "expired client cert"):
        target, tls, _ = cases[case]
        with (
            host_client.SyncClient(target, tls=tls or False, timeout=5) as client,
            pytest.raises(host_client.UnavailableError),
        ):
            client.health()
    text = tls_agent.log_path.read_text()
    assert not CORE_LINE.search(text), "a raw gRPC core line in the agent's log"
    records = [json.loads(line) for line in text.splitlines()]
    handshakes = [r["msg"] for r in records if r["msg"].startswith("TLS handshake failed")]
    assert any("connected without TLS" in m for m in handshakes), handshakes
    assert any("expired certificate" in m for m in handshakes), handshakes
    assert any("not signed by this agent's client CA" in m for m in handshakes), handshakes
    assert all(r["level"] == "warning" for r in records if r["logger"] == "grpc.core")
