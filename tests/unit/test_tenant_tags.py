"""VLAN ids and VNIs in flow rules: the operator's grants (`[network] tenant_tags_file`)
and the check of a rule against them (`dpu_agent.network.access`)."""

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpu_agent import config
from dpu_agent.auth import Principal
from dpu_agent.config import ConfigError
from dpu_agent.errors import NotFound, PermissionDenied
from dpu_agent.network import model, tags
from dpu_agent.network.access import check_rule_access, check_rule_tags

GOOD = """
[tenant.tenant-a]
vlans = [100, "200-299", " 300 - 301 "]
vnis = ["5000-5099", 0, 16777215]

[tenant.tenant-b]
vlans = [4094]
"""


def write(tmp_path: Path, text: str, mode: int = 0o644) -> Path:
    path = tmp_path / "tags.toml"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_tags_file_grants_ids_and_ranges(tmp_path):
    granted = tags.load(write(tmp_path, GOOD))
    a = granted.of("tenant-a")
    assert [v for v in (99, 100, 101, 199, 200, 299, 300, 301, 302) if v in a.vlans] == [
        100,
        200,
        299,
        300,
        301,
    ]
    assert str(a.vlans) == "100, 200-299, 300-301"
    vnis = (0, 1, 4999, 5000, 5099, 5100, 16777215)
    assert [v for v in vnis if v in a.vnis] == [0, 5000, 5099, 16777215]
    assert 4094 in granted.of("tenant-b").vlans
    assert str(granted.of("tenant-b").vnis) == "none"
    assert granted.of("tenant-c") == tags.TagGrant()  # not listed: nothing
    assert not a.untagged  # by default a tenant sends to the uplinks only in its VLANs


def test_a_tenant_may_be_granted_untagged_uplink_traffic(tmp_path):
    granted = tags.load(
        write(tmp_path, "[tenant.solo]\nuntagged = true\n[tenant.b]\nuntagged = false\n")
    )
    assert granted.of("solo") == tags.TagGrant(untagged=True)  # no VLAN id or VNI with it
    assert not granted.of("b").untagged
    assert not granted.of("other").untagged


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[tenant.a]\nvlans = ["200-100"]\n', r"tenant\.a\.vlans\[0\]: '200-100' is not an id"),
        ('[tenant.a]\nvlans = ["1-2-3"]\n', r"vlans\[0\]: '1-2-3' is not an id"),
        ('[tenant.a]\nvlans = ["ten"]\n', r"vlans\[0\]: 'ten' is not an id"),
        ('[tenant.a]\nvlans = [""]\n', r"vlans\[0\]: '' is not an id"),
        ('[tenant.a]\nvlans = ["-5"]\n', r"vlans\[0\]: '-5' is not an id"),
        ("[tenant.a]\nvlans = [1.5]\n", r"vlans\[0\]: expected an id or a range"),
        ("[tenant.a]\nvlans = [true]\n", r"vlans\[0\]: expected an id or a range"),
        ("[tenant.a]\nvlans = [0]\n", r"vlans\[0\]: 0 is not an id or a range .* in 1\.\.4094"),
        ("[tenant.a]\nvlans = [10, 4095]\n", r"vlans\[1\]: 4095 is not .* in 1\.\.4094"),
        ('[tenant.a]\nvlans = ["4000-4095"]\n', r"'4000-4095' is not .* in 1\.\.4094"),
        ("[tenant.a]\nvnis = [-1]\n", r"vnis\[0\]: -1 is not .* in 0\.\.16777215"),
        ("[tenant.a]\nvnis = [16777216]\n", r"vnis\[0\]: 16777216 is not .* in 0\.\.16777215"),
        ('[tenant.a]\nvnis = ["99999999999"]\n', r"vnis\[0\]: '99999999999' is not an id"),
        ('[tenant.a]\nvlans = "100"\n', r"tenant\.a\.vlans: expected a list"),
        (
            "[tenant.a]\nvlan = [100]\n",
            r"tenant\.a: unknown key 'vlan' \(expected vlans, vnis, untagged\)",
        ),
        (
            '[tenant.a]\nuntagged = "yes"\n',
            r"tenant\.a\.untagged: expected true or false, got 'yes'",
        ),
        ("[tenant.a]\nuntagged = 1\n", r"tenant\.a\.untagged: expected true or false, got 1"),
        ("[tenants.a]\nvlans = [100]\n", r"unknown key 'tenants' \(expected \[tenant\.<name>\]\)"),
        ("tenant = 5\n", r"tenant must be a table"),
        ("[tenant]\na = 5\n", r"tenant\.a: must be a table"),
        ("[tenant.Tenant_A]\nvlans = [100]\n", r"tenant\.Tenant_A: .*tenant"),
        ("[tenant.a\nvlans = [100]\n", r"invalid TOML"),
        (f"[tenant.a]\nvlans = [{', '.join(['1'] * 1025)}]\n", r"at most 1024"),
    ],
)
def test_a_malformed_tags_file_is_a_config_error_naming_the_entry(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        tags.load(write(tmp_path, text))


def test_a_tags_file_others_may_write_or_that_is_missing_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="may be written by group or others"):
        tags.load(write(tmp_path, GOOD, mode=0o666))
    with pytest.raises(ConfigError, match="cannot read"):
        tags.load(tmp_path / "missing.toml")


def test_the_setting_names_the_file_and_the_agent_reads_it(tmp_path):
    path = write(tmp_path, GOOD)
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text(f'[network]\ntenant_tags_file = "{path}"\n')
    cfg = config.load(cfg_file, environ={})
    assert cfg.network_tenant_tags_file == str(path)
    assert 100 in tags.from_config(cfg).of("tenant-a").vlans
    env = {"DPU_AGENT_NETWORK_TENANT_TAGS_FILE": str(tmp_path / "missing.toml")}
    with pytest.raises(ConfigError, match=r"^network\.tenant_tags_file: .*cannot read"):
        tags.from_config(config.load(None, environ=env))
    assert tags.from_config(config.load(None, environ={})) == tags.TenantTags()


def test_check_config_reads_the_tags_file_as_the_agent_would(tmp_path):
    cfg_file = tmp_path / "agent.toml"
    cfg_file.write_text(
        f'[tls]\nplaintext_loopback = true\n[network]\ntenant_tags_file = "{tmp_path}/tags.toml"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPU_AGENT_")}

    def check_config() -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "dpu_agent", "check-config", "-c", str(cfg_file)]
        return subprocess.run(
            command, capture_output=True, text=True, timeout=60, check=False, env=env
        )

    write(tmp_path, GOOD)
    done = check_config()
    assert done.returncode == 0, done.stderr
    assert "# tenant tags: 2 tenant(s) granted VLAN ids or VNIs; 0 may send untagged" in done.stdout
    write(tmp_path, '[tenant.a]\nvlans = ["5000"]\n')
    done = check_config()
    assert done.returncode == 2
    assert "configuration error: network.tenant_tags_file: " in done.stderr
    assert "tenant.a.vlans[0]: '5000' is not an id" in done.stderr


# ------------------------------------------------------------------ the check of a rule

A = Principal("tenant-a")
ADMIN = Principal("ops", admin=True)
GRANTS = tags.parse(
    {"tenant": {"tenant-a": {"vlans": ["200-299"], "vnis": [7000]}, "tenant-b": {"vlans": [100]}}},
    "test",
)
OWNERS = {"pf0vf0": "tenant-a", "pf0vf1": "tenant-b", "pf0vf2": "tenant-a"}
MANAGED = {"p0", "p1", "pf0vf0", "pf0vf1", "pf0vf2", "eth5", "vxlan0"}
IP = ipaddress.ip_address


def tagged(port="pf0vf0", *actions, vlan=None, vni=None, to="p0"):
    return model.FlowRule(
        "r",
        1000,  # a tenant's rule: in the tenants' band
        port,
        model.FlowMatch(vlan_id=vlan, vxlan_vni=vni),
        (*actions, model.Forward(to)),
        tenant="tenant-a",
    )


def encap(vni):
    return model.VxlanEncap(vni, IP("10.0.0.1"), IP("10.0.0.9"))


@pytest.mark.parametrize(
    ("rule", "refused"),
    [
        (tagged("pf0vf0", model.VlanPush(250)), None),  # its own segment
        (
            tagged("pf0vf0", model.VlanPush(100)),
            r"actions\[0\]: vlan_push: VLAN 100 is not granted",
        ),
        (tagged("pf0vf0", model.VlanPush(1)), "VLAN 1 is not granted"),
        (tagged("pf0vf0", encap(7000), to="vxlan0"), None),  # encapsulated by it
        (tagged("pf0vf0", encap(5000)), r"actions\[0\]: vxlan_encap: VNI 5000 is not granted"),
        (
            tagged("pf0vf0", model.VlanPush(250), encap(5000)),
            r"actions\[1\]: vxlan_encap: VNI 5000",
        ),
        # pop and decap name the tag they remove, which must be the tenant's
        (tagged("pf0vf0", model.VlanPop()), r"vlan_pop removes a tag: .*match\.vlan_id"),
        (tagged("pf0vf0", model.VlanPop(), vlan=100), "vlan_pop: VLAN 100 is not granted"),
        (tagged("pf0vf0", model.VlanPop(), vlan=200, to="pf0vf2"), None),
        (tagged("pf0vf0", model.VxlanDecap()), r"vxlan_decap removes a tag: .*match\.vxlan_vni"),
        (tagged("pf0vf0", model.VxlanDecap(), vni=5000), "vxlan_decap: VNI 5000 is not granted"),
        (tagged("pf0vf0", model.VxlanDecap(), vni=7000, to="pf0vf2"), None),
        # matching on its own representor selects its own frames
        (tagged("pf0vf0", vlan=100, vni=5000, to="pf0vf2"), None),
        (tagged("pf0vf0", to="pf0vf2"), None),
        # a host netdev carries everyone's traffic: a rule there keeps to its tags
        (tagged("eth5"), "host port eth5 acts on every tenant's traffic"),
        (tagged("eth5", vlan=100), "match.vlan_id: VLAN 100 is not granted"),
        (tagged("eth5", vni=5000), "match.vxlan_vni: VNI 5000 is not granted"),
        (tagged("eth5", vlan=200, vni=5000), "VNI 5000 is not granted"),
        (tagged("eth5", vlan=200), None),
        (tagged("eth5", model.VlanPop(), vlan=200, to="pf0vf2"), None),
        (tagged("eth5", model.VxlanDecap(), vni=7000, to="pf0vf2"), None),
    ],
)
def test_a_tenant_names_only_its_granted_tags(rule, refused):
    if refused is None:
        check_rule_access(rule, A, MANAGED, OWNERS, GRANTS)
    else:
        with pytest.raises(PermissionDenied, match=refused) as denied:
            check_rule_access(rule, A, MANAGED, OWNERS, GRANTS)
        assert "tenant 'tenant-a'" in str(denied.value)
    check_rule_tags(rule, ADMIN, GRANTS)  # the admin: any tag, anywhere
    check_rule_tags(rule, ADMIN, tags.TenantTags())


def test_without_a_tags_file_a_tenant_uses_no_tag():
    with pytest.raises(PermissionDenied, match="VLAN 250 is not granted"):
        check_rule_tags(tagged("pf0vf0", model.VlanPush(250)), A, tags.TenantTags())
    check_rule_tags(tagged("pf0vf0"), A, tags.TenantTags())  # no tag used
    with pytest.raises(PermissionDenied, match=r"forward to uplink p0: the frame is in no VLAN"):
        check_rule_access(tagged("pf0vf0"), A, MANAGED, OWNERS, tags.TenantTags())


def test_the_ports_are_checked_before_the_tags():
    """B's port answers NOT_FOUND as a missing one, whatever tag the rule names."""
    with pytest.raises(NotFound, match=r"^ports/pf0vf1 does not exist$"):
        check_rule_access(tagged("pf0vf1", model.VlanPush(100)), A, MANAGED, OWNERS, GRANTS)


# ------------------------------------------------------------------ what goes to an uplink

UNTAGGED = tags.parse(
    {"tenant": {"tenant-a": {"vlans": ["200-299"], "vnis": [7000], "untagged": True}}}, "test"
)
NO_VLAN = "the frame is in no VLAN granted to tenant 'tenant-a'"


def sends(*actions, port="pf0vf0", vlan=None, vni=None):
    return model.FlowRule(
        "r", 1000, port, model.FlowMatch(vlan_id=vlan, vxlan_vni=vni), actions, tenant="tenant-a"
    )


FWD, MIRROR = model.Forward("p0"), model.Mirror("p1")


@pytest.mark.parametrize(
    ("rule", "refused", "untagged"),
    [
        # untagged (or as the guest tagged it), straight to the shared uplink
        (sends(FWD), rf"^actions\[0\]: forward to uplink p0: {NO_VLAN} \(it matches no", None),
        (sends(MIRROR), rf"^actions\[0\]: mirror to uplink p1: {NO_VLAN}", None),
        (sends(model.Count(), model.Police(8000, 100), FWD), r"^actions\[2\]: forward", None),
        # a granted push before the forward or mirror puts it in the tenant's segment
        (sends(model.VlanPush(250), FWD), None, None),
        (sends(model.VlanPush(250), MIRROR, model.Drop()), None, None),
        # ... after it does not: the mirror's copy left untagged
        (
            sends(MIRROR, model.VlanPush(250), FWD),
            rf"^actions\[0\]: mirror to uplink p1: {NO_VLAN}",
            None,
        ),
        # a matched VLAN: the tenant's kept is fine, another tenant's is not (untagged or no)
        (sends(FWD, vlan=250), None, None),
        (sends(MIRROR, FWD, vlan=250), None, None),
        (
            sends(FWD, vlan=100),
            r"^actions\[0\]: forward to uplink p0: the frame is in VLAN 100 \(match",
            r"VLAN 100",
        ),
        (sends(model.VlanPush(250), FWD, vlan=100), None, None),  # B's tag under A's
        (sends(FWD, vlan=0), NO_VLAN, None),  # a priority tag: no VLAN
        # popped: what was under it is not known
        (sends(model.VlanPop(), FWD, vlan=250), r"\(actions\[0\] popped VLAN 250\)", None),
        (sends(model.VlanPop(), model.VlanPush(260), FWD, vlan=250), None, None),
        (sends(model.VlanPush(260), model.VlanPop(), FWD, vlan=250), None, None),  # 250 again
        (sends(MIRROR, model.VlanPop(), vlan=250), None, None),  # mirrored before the pop
        # a VNI is no tag on an uplink: encap works only through a VXLAN port
        (sends(encap(7000), FWD), r"a VNI does not tag a frame sent to an uplink", None),
        (sends(encap(7000), model.Forward("vxlan0")), None, None),
        (sends(model.VlanPush(250), encap(7000), FWD), None, None),
        (sends(FWD, port="vxlan0", vni=7000), r"a VNI does not tag", None),
        (sends(model.VxlanDecap(), FWD, port="vxlan0", vni=7000), NO_VLAN, None),
        (sends(model.VxlanDecap(), FWD, port="vxlan0", vni=7000, vlan=250), None, None),
        (sends(model.VxlanDecap(), model.VlanPush(250), FWD, port="vxlan0", vni=7000), None, None),
        # a host netdev's rule already matches a granted tag; popping it is not enough
        (sends(FWD, port="eth5", vlan=250), None, None),
        (sends(model.VlanPop(), FWD, port="eth5", vlan=250), r"popped VLAN 250", None),
        # other targets are not uplinks: the ports and tags decide
        (sends(model.Forward("pf0vf2")), None, None),
        (sends(model.Forward("eth5")), None, None),
    ],
)
def test_a_tenants_frames_reach_an_uplink_only_in_its_segments(rule, refused, untagged):
    """A tenant's rule sent its untagged frames onto the uplink's native segment, or
    frames the guest tagged 100 into VLAN 100 (tenant B's). `untagged` is the refusal
    left with `untagged = true` (None: then accepted)."""
    if refused is None:
        check_rule_access(rule, A, MANAGED, OWNERS, GRANTS)
    else:
        with pytest.raises(PermissionDenied, match=refused):
            check_rule_access(rule, A, MANAGED, OWNERS, GRANTS)
    if untagged is None:
        check_rule_access(rule, A, MANAGED, OWNERS, UNTAGGED)
    else:
        with pytest.raises(PermissionDenied, match=untagged):
            check_rule_access(rule, A, MANAGED, OWNERS, UNTAGGED)
    check_rule_access(rule, ADMIN, MANAGED, OWNERS, tags.TenantTags())  # the admin: anything


def test_the_refusal_says_what_is_missing():
    with pytest.raises(PermissionDenied) as denied:
        check_rule_access(sends(FWD), A, MANAGED, OWNERS, GRANTS)
    assert str(denied.value) == (
        "actions[0]: forward to uplink p0: the frame is in no VLAN granted to tenant"
        " 'tenant-a' (it matches no VLAN id and pushes none before it): push one before it"
        " (vlan_push), or match one (match.vlan_id) and keep it; sending untagged to the"
        " uplinks needs untagged = true for the tenant in [network] tenant_tags_file"
    )


def test_untagged_is_one_tenants_grant():
    """B's grant is its own: A with untagged = true does not lend it to B."""
    b_rule = model.FlowRule("r", 1000, "pf0vf1", model.FlowMatch(), (FWD,), tenant="tenant-b")
    with pytest.raises(PermissionDenied, match="tenant 'tenant-b'"):
        check_rule_access(b_rule, Principal("tenant-b"), MANAGED, OWNERS, UNTAGGED)
