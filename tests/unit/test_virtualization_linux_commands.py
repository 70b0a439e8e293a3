"""The linux backend's ip/tc steps, against a recording runner (the VM suite runs them for real)."""

import json

import pytest

from dpu_agent.errors import FailedPrecondition
from dpu_agent.virtualization.commands import CommandFailed
from dpu_agent.virtualization.linux_backend import LinuxFunctionBackend, LinuxSettings
from dpu_agent.virtualization.linux_net import derived_mac, police_burst
from dpu_agent.virtualization.model import FunctionSpec, FunctionType, Provisioned


class Recorder:
    """Answers `ip -j` queries from a fake kernel state and records every command."""

    def __init__(self, fail_at=None):
        self.calls = []
        self.links = [{"ifname": "lo"}, {"ifname": "pf0vf0"}]
        self.netns = []
        self.batches = []
        self.fail_at = fail_at

    def __call__(self, argv, *, input_text=None):
        argv = list(argv)
        if "-j" in argv:
            return json.dumps(self.netns if "netns" in argv else self.links)
        if "-batch" in argv:  # one process; record its lines as the commands they are
            prefix = argv[: argv.index("-batch")]
            argv = [*prefix, "-batch", *(input_text or "").split()]
            self.batches.append([" ".join(prefix) + " " + x for x in input_text.splitlines()])
        self.calls.append(argv)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise CommandFailed(argv, 2, "Error: injected")
        return ""


def backend(recorder, **settings):
    return LinuxFunctionBackend(
        LinuxSettings(dpu_netns="dpu", **settings), volumes=None, runner=recorder
    )


def spec(**kw):
    return FunctionSpec(function_id="g1", type=FunctionType.VF, **kw)


def test_a_network_function_is_a_veth_pair_with_tc_controls():
    rec = Recorder()
    made = backend(rec).create(spec(mac="02:00:00:00:00:01", vlan_id=100, rate_limit_bps=10**7))
    assert made.representor_port == "pf0vf1"  # pf0vf0 is taken
    assert made.host_device == "fn-g1/eth0"
    assert made.facts == {"netns": "fn-g1", "mac": "02:00:00:00:00:01"}
    text = [" ".join(c) for c in rec.calls] + [x for b in rec.batches for x in b]
    assert text[:3] == [
        "ip netns add fn-g1",
        "ip -n dpu link add pf0vf1 type veth peer name eth0 netns fn-g1",
        "ip -n dpu link set pf0vf1 alias dpu-function:g1 mtu 1500 up",
    ]
    burst = police_burst(10**7, 1500)
    assert (
        "tc -n fn-g1 filter add dev eth0 egress pref 10 protocol all flower src_mac "
        f"02:00:00:00:00:01 action police rate 10000000bit burst {burst} conform-exceed drop/pipe "
        "action vlan push id 100"
    ) in text
    assert (
        "tc -n fn-g1 filter add dev eth0 egress pref 20 protocol all matchall action drop" in text
    )
    assert (
        "tc -n fn-g1 filter add dev eth0 ingress pref 10 protocol 802.1Q flower vlan_id 100 "
        "action vlan pop"
    ) in text


def test_no_controls_means_no_qdisc_and_a_derived_mac():
    rec = Recorder()
    made = backend(rec).create(spec(spoof_check=False))
    assert made.facts["mac"] == derived_mac("g1")
    assert int(made.facts["mac"][:2], 16) & 0b11 == 0b10  # locally administered, unicast
    assert not any(c[0] == "tc" for c in rec.calls)


def _steps():
    rec = Recorder()
    backend(rec).create(spec(vlan_id=5, rate_limit_bps=10**6))
    return len(rec.calls)


@pytest.mark.parametrize("step", range(1, _steps() + 1))
def test_a_failure_at_any_step_undoes_the_earlier_ones(step):
    rec = Recorder(fail_at=step)
    with pytest.raises(CommandFailed, match="injected"):
        backend(rec).create(spec(vlan_id=5, rate_limit_bps=10**6))
    done = rec.calls[: step - 1]
    undo = rec.calls[step:]
    if any(c[:3] == ["ip", "netns", "add"] for c in done):
        assert undo[-1] == ["ip", "netns", "del", "fn-g1"]
    if any(c[:5] == ["ip", "-n", "dpu", "link", "add"] for c in done):
        assert ["ip", "-n", "dpu", "link", "del", "pf0vf1"] in undo


def test_an_existing_namespace_is_refused_before_anything_is_made():
    rec = Recorder()
    rec.netns = [{"name": "fn-g1"}]
    with pytest.raises(FailedPrecondition, match="already exists"):
        backend(rec).create(spec())
    assert rec.calls == []


def test_delete_from_the_id_alone_finds_the_marked_representor():
    rec = Recorder()
    rec.links.append({"ifname": "pf0vf7", "ifalias": "dpu-function:g1"})
    rec.netns = [{"name": "fn-g1"}]
    backend(rec).delete(spec(), Provisioned("", ""))
    assert ["ip", "-n", "dpu", "link", "del", "pf0vf7"] in rec.calls
    assert rec.calls[-1] == ["ip", "netns", "del", "fn-g1"]
