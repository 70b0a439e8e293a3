"""Principals, ownership checks, identities from certificates and tokens, quotas."""

import contextvars
import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from dpu_agent import auth, identity
from dpu_agent.errors import NotFound, PermissionDenied, ResourceExhausted, Unauthenticated
from dpu_agent.quota import Quotas
from host_client import _certs


def as_principal(principal, fn, *args):
    """Run fn with `principal` as the RPC's caller, in a fresh context."""

    def run():
        auth.principal.set(principal)
        return fn(*args)

    return contextvars.copy_context().run(run)


A = auth.Principal("tenant-a")
ADMIN = auth.Principal("ops", admin=True)


def test_outside_an_rpc_there_is_no_principal():
    with pytest.raises(Unauthenticated):
        contextvars.copy_context().run(auth.current_principal)


def test_owner_sees_admin_sees_all_others_get_not_found():
    assert as_principal(A, auth.can_see, "tenant-a")
    assert not as_principal(A, auth.can_see, "tenant-b")
    assert as_principal(ADMIN, auth.can_see, "tenant-b")
    as_principal(A, auth.check_owner, "tenant-a", "volume 'v'")
    with pytest.raises(NotFound, match=r"^volume 'v' does not exist$"):
        as_principal(A, auth.check_owner, "tenant-b", "volume 'v'")
    as_principal(ADMIN, auth.check_owner, "tenant-b", "volume 'v'")
    assert as_principal(A, auth.tenant) == "tenant-a"


def test_admin_role_required():
    with pytest.raises(PermissionDenied, match="listing the ports needs the admin role"):
        as_principal(A, auth.require_admin, "listing the ports")
    assert as_principal(ADMIN, auth.require_admin, "x") is ADMIN


def certificate(*attributes):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(oid, value) for oid, value in attributes])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
        .not_valid_after(dt.datetime(2099, 1, 1, tzinfo=dt.UTC))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(Encoding.PEM)


def test_the_tenant_is_the_subject_cn_and_o_admin_the_role():
    plain = identity.principal_from_certificate(certificate((NameOID.COMMON_NAME, "tenant-a")))
    assert plain == auth.Principal("tenant-a", admin=False, via=auth.Via.CERTIFICATE)
    admin = identity.principal_from_certificate(
        certificate((NameOID.ORGANIZATION_NAME, "admin"), (NameOID.COMMON_NAME, "ops"))
    )
    assert admin.admin
    assert admin.tenant == "ops"
    other_org = identity.principal_from_certificate(
        certificate((NameOID.ORGANIZATION_NAME, "Admin Inc"), (NameOID.COMMON_NAME, "x"))
    )
    assert not other_org.admin


@pytest.mark.parametrize(
    ("attributes", "message"),
    [
        ([(NameOID.ORGANIZATION_NAME, "admin")], "exactly one subject CN"),
        ([(NameOID.COMMON_NAME, "a"), (NameOID.COMMON_NAME, "b")], "exactly one subject CN"),
        ([(NameOID.COMMON_NAME, "Tenant_A")], "lowercase DNS label"),
    ],
)
def test_certificates_that_name_no_usable_tenant_are_refused(attributes, message):
    with pytest.raises(Unauthenticated, match=message):
        identity.principal_from_certificate(certificate(*attributes))


def test_dpuctl_certs_client_certificates_carry_the_fields(tmp_path):
    _certs.make_ca(tmp_path)
    cert, _ = _certs.make_client(tmp_path, "ops", admin=True)
    principal = identity.principal_from_certificate(cert.read_bytes())
    assert principal == auth.Principal("ops", admin=True)


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((("authorization", "bearer  abc "),), "abc"),
        ((("x-request-id", "1"), ("authorization", "Basic abc")), None),
        ((("authorization", "Bearer"),), None),
        ((), None),
    ],
)
def test_bearer_tokens_from_metadata(metadata, token):
    assert identity.bearer_token(metadata) == token


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.9.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("ipv6:[::ffff:10.0.0.1]:5000", False),
        ("unix:/run/dpu.sock", True),
        ("ipv4:10.0.0.1:5000", False),
        ("ipv6:[fe80::1]:5000", False),
        ("", False),
    ],
)
def test_loopback_peers(peer, local):
    assert identity.peer_is_loopback(peer) is local


def write_tokens(tmp_path, text, mode=0o600):
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_tokens_file_maps_token_digests_to_principals(tmp_path):
    token, entry = _certs.make_token("tenant-a")
    admin_token, admin_entry = _certs.make_token("ops", admin=True)
    tokens = identity.load_tokens(write_tokens(tmp_path, entry + admin_entry))
    assert len(tokens) == 2
    by_digest = tokens._by_digest
    assert by_digest[identity.token_digest(token)] == auth.Principal("tenant-a", via=auth.Via.TOKEN)
    assert by_digest[identity.token_digest(admin_token)].admin


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[token]]\ntenant = 'a'\nsha256 = 'abc'\n", "64 hex digits"),
        ("[[token]]\ntenant = 'A'\nsha256 = '" + "0" * 64 + "'\n", "lowercase DNS label"),
        ("[[token]]\ntenant = 'a'\nsha256 = '" + "0" * 64 + "'\nadmin = 'yes'\n", "true or false"),
        ("[[token]]\ntenant = 'a'\nsha256 = '" + "0" * 64 + "'\nrole = 'x'\n", "unknown key"),
        ("[tokens]\n", "unknown key 'tokens'"),
        ("[[token]]\ntenant = 'a'\nsha256 = '" + "0" * 64 + "'\n", None),
        ("[[token\n", "invalid TOML"),
        ("x = " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    ],
)
def test_bad_tokens_files_are_refused(tmp_path, text, message):
    path = write_tokens(tmp_path, text)
    if message is None:
        assert len(identity.load_tokens(path)) == 1
        return
    with pytest.raises(identity.TokensFileError, match=message):
        identity.load_tokens(path)


def test_the_same_token_twice_and_an_open_file_are_refused(tmp_path):
    _, entry = _certs.make_token("tenant-a")
    with pytest.raises(identity.TokensFileError, match="listed twice"):
        identity.load_tokens(write_tokens(tmp_path, entry + entry))
    with pytest.raises(identity.TokensFileError, match="must be 0600"):
        identity.load_tokens(write_tokens(tmp_path, entry, mode=0o644))
    with pytest.raises(identity.TokensFileError, match="cannot read"):
        identity.load_tokens(tmp_path / "absent.toml")


def test_quotas_name_the_limit_and_the_tenant():
    quotas = Quotas(max_volumes=2, max_volume_bytes=100, max_sessions=1, max_queue_depth=8)
    quotas.check_volumes("a", 2, 100)
    with pytest.raises(ResourceExhausted, match=r"quota\.max_volumes: tenant 'a' would hold 3"):
        quotas.check_volumes("a", 3, 1)
    with pytest.raises(ResourceExhausted, match=r"quota\.max_volume_bytes"):
        quotas.check_volumes("a", 1, 101)
    quotas.check_sessions("a", 1, 8)
    with pytest.raises(ResourceExhausted, match=r"quota\.max_sessions"):
        quotas.check_sessions("a", 2, 2)
    with pytest.raises(ResourceExhausted, match=r"quota\.max_queue_depth"):
        quotas.check_sessions("a", 1, 9)
    Quotas().check_flow_rules("a", 10**9)  # 0: no limit
    with pytest.raises(ResourceExhausted, match=r"quota\.max_flow_rules"):
        Quotas(max_flow_rules=1).check_flow_rules("a", 2)
