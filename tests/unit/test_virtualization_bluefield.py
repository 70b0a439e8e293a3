"""The bluefield function backend against recorded and documented command output.

Every test scripts the exact commands the backend must run, in order, with the output
each one gives (files under data/bluefield/, see its README for where each comes from).
No BlueField hardware is involved: this checks the command sequences, the parsing and
the rollback, not that the commands work on a DPU.
"""

import json
from pathlib import Path

import pytest

from dpu_agent.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from dpu_agent.virtualization.bluefield import (
    BlueFieldFunctionBackend,
    BlueFieldSettings,
    derived_mac,
    parse_json,
    parse_ports,
    tx_max,
)
from dpu_agent.virtualization.commands import CommandFailed
from dpu_agent.virtualization.model import FunctionSpec, FunctionType, Provisioned, normalize_mac

DATA = Path(__file__).parent / "data" / "bluefield"
PORT_SHOW = "devlink -j port show"
VF1 = "pci/0000:03:00.0/2"  # pf0vf1, the first VF without a MAC in the recording
SF = "pci/0000:03:00.0/229410"  # the port `devlink port add` made in the recording
MAC = "02:00:00:00:0a:01"
VIRTIO_MAC = "0c:c4:7a:ff:22:93"  # the MAC of the documented hotplug example
SNAP_FUNCTIONS = "snap_rpc.py emulation_function_list"
SNAP_SUBSYSTEMS = "snap_rpc.py nvme_subsystem_list"
NQN = "nqn.2024-01.io.dpu-offload:disk-1"


def data(name: str) -> str:
    return (DATA / name).read_text()


def ports_with(**hw_addrs: str) -> str:
    """The recorded port listing with some functions' MACs changed (by port index)."""
    table = json.loads(data("devlink-port-show.json"))
    for index, mac in hw_addrs.items():
        table["port"][f"pci/0000:03:00.0/{index.lstrip('_')}"]["function"]["hw_addr"] = mac
    return json.dumps(table)


def ports_plus(extra: str) -> str:
    """The recorded listing with the ports of another listing added."""
    table = json.loads(data("devlink-port-show.json"))
    table["port"].update(json.loads(extra)["port"])
    return json.dumps(table)


def virtnet_list(*pf_ids: int) -> str:
    """The recorded `virtnet list` keeping only the devices with these ids."""
    listing = json.loads(data("virtnet-list.json"))
    listing["devices"] = [d for d in listing["devices"] if d["pf_id"] in pf_ids]
    return json.dumps(listing)


def snap_functions(**ctrl_ids: str) -> str:
    """The recorded emulation_function_list with controllers set (key: TYPE_pfindex)."""
    functions = json.loads(data("snap-emulation-function-list.json"))
    for f in functions:
        f["ctrl_id"] = ctrl_ids.get(f"{f['emulation_type']}_{f['pf_index']}", f["ctrl_id"])
    return json.dumps(functions)


def failed(argv: str, stderr: str = "Operation not supported") -> CommandFailed:
    return CommandFailed(argv.split(), 1, stderr)


class Script:
    """A Runner that expects exactly these commands and answers with recorded output."""

    def __init__(self, *steps: tuple[str, str | Exception]) -> None:
        self.steps = list(steps)
        self.ran: list[str] = []

    def __call__(self, argv, *, input_text=None) -> str:
        assert input_text is None  # the backend feeds no tool on stdin
        command = " ".join(argv)
        self.ran.append(command)
        assert self.steps, f"unexpected command: {command}"
        expected, answer = self.steps.pop(0)
        assert command == expected
        if isinstance(answer, Exception):
            raise answer
        return answer

    def done(self) -> None:
        assert self.steps == [], f"commands not run: {[s[0] for s in self.steps]}"


def backend(script: Script, **settings) -> BlueFieldFunctionBackend:
    return BlueFieldFunctionBackend(script, BlueFieldSettings(**settings))


def vf_spec(**kw) -> FunctionSpec:
    return FunctionSpec("web-1", FunctionType.VF, **{"mac": MAC, **kw})


def sf_spec(**kw) -> FunctionSpec:
    return FunctionSpec("sf-1", FunctionType.SF, **{"mac": MAC, **kw})


def virtio_spec(**kw) -> FunctionSpec:
    return FunctionSpec("vnet-1", FunctionType.VIRTIO_NET, **{"mac": VIRTIO_MAC, **kw})


def nvme_spec() -> FunctionSpec:
    return FunctionSpec("disk-1", FunctionType.NVME, volume_id="vol-a")


def vblk_spec() -> FunctionSpec:
    return FunctionSpec("disk-2", FunctionType.VIRTIO_BLK, volume_id="vol-b")


# ---------------------------------------------------------------- parsing


def test_port_listing_parses_every_flavour():
    ports = parse_ports(data("devlink-port-show.json"))
    assert len(ports) == 8
    vf = ports[VF1]
    assert (vf.flavour, vf.netdev, vf.controller, vf.pfnum, vf.vfnum) == (
        "pcivf",
        "pf0vf1",
        1,
        0,
        1,
    )
    assert vf.hw_addr == "00:00:00:00:00:00"
    assert vf.device == "pci/0000:03:00.0"
    uplink = ports["pci/0000:03:00.0/65535"]
    assert (uplink.flavour, uplink.netdev, uplink.hw_addr, uplink.controller) == (
        "physical",
        "p0",
        "",
        0,
    )
    sf = ports["pci/0000:03:00.0/229409"]
    assert (sf.sfnum, sf.state) == (1001, "active")


def test_port_add_output_is_a_bare_member_and_still_parses():
    text = data("devlink-port-add-sf.txt")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    (port,) = parse_ports(text).values()
    assert (port.handle, port.sfnum, port.netdev, port.state) == (SF, 100, "eth6", "inactive")


@pytest.mark.parametrize(
    ("text", "count", "fields"),
    [
        ('{"port":{}}', 0, {}),
        ("{}", 0, {}),
        ('{"port":{"pci/0000:03:00.0/7":{"vfnum":"7","controller":true}}}', 1, {"vfnum": 7}),
        ('{"port":{"pci/0000:03:00.0/7":{"function":"odd","pfnum":-1}}}', 1, {"pfnum": -1}),
        ('{"port":{"pci/0000:03:00.0/7":"odd","pci/0000:03:00.0/8":{}}}', 1, {"hw_addr": ""}),
    ],
)
def test_port_listing_edge_cases(text, count, fields):
    ports = parse_ports(text)
    assert len(ports) == count
    for handle, port in ports.items():
        assert handle == port.handle
        assert port.controller == 0  # a boolean is not a controller number
        for key, value in fields.items():
            assert getattr(port, key) == value


@pytest.mark.parametrize("text", ["", "devlink answers: Operation not supported", "[1, 2]", '"x"'])
def test_unreadable_port_listing_is_failed_precondition(text):
    with pytest.raises(FailedPrecondition, match="devlink"):
        parse_ports(text)


def test_parse_json_names_the_tool():
    with pytest.raises(FailedPrecondition, match=r"^virtnet: cannot read"):
        parse_json("Traceback (most recent call last):", "virtnet")


@pytest.mark.parametrize(
    ("bps", "value"), [(0, "0mbit"), (1_000_000, "1mbit"), (400_000_000_000, "400000mbit")]
)
def test_rate_goes_to_devlink_in_mbit(bps, value):
    assert tx_max(bps) == value


def test_derived_mac_is_a_stable_local_unicast_address():
    mac = derived_mac("web-1")
    assert mac == derived_mac("web-1") != derived_mac("web-2")
    assert normalize_mac(mac) == mac
    assert int(mac[:2], 16) & 0b11 == 0b10  # locally administered, unicast


# ---------------------------------------------------------------- VF


def test_vf_create_takes_the_first_vf_without_a_mac():
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (f"devlink port function set {VF1} hw_addr {MAC}", ""),
        ("ip link set dev pf0vf1 mtu 9000", ""),
        (f"devlink port function rate set {VF1} tx_max 100mbit", ""),
    )
    made = backend(script).create(vf_spec(mtu=9000, rate_limit_bps=100_000_000, vlan_id=42))
    script.done()
    assert made.representor_port == "pf0vf1"
    assert made.host_device == "vf:0/1"
    assert made.facts["port"] == VF1
    assert made.facts["vfnum"] == "1"
    assert made.facts["mac"] == MAC
    assert made.facts["vlan_id"] == "42"
    assert made.facts["rate_bps"] == "100000000"
    assert made.facts["not_enforced"] == "vlan_id,trust,spoof_check"
    assert (made.facts["trust"], made.facts["spoof_check"]) == ("off", "on")


def test_vf_create_without_mac_or_rate_uses_the_derived_mac_and_no_rate():
    mac = derived_mac("web-1")
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (f"devlink port function set {VF1} hw_addr {mac}", ""),
        ("ip link set dev pf0vf1 mtu 1500", ""),
    )
    made = backend(script).create(vf_spec(mac=""))
    script.done()
    assert made.facts["mac"] == mac


def test_vf_create_on_a_pf_given_by_pci_address_skips_other_devices():
    listing = ports_with(_2=MAC)  # pf0vf1 taken: the next free VF is pf0vf2
    script = Script(
        (PORT_SHOW, listing),
        ("devlink port function set pci/0000:03:00.0/3 hw_addr 02:00:00:00:0a:02", ""),
        ("ip link set dev pf0vf2 mtu 1500", ""),
    )
    made = backend(script, pf="0000:03:00.0").create(vf_spec(mac="02:00:00:00:0a:02"))
    script.done()
    assert made.representor_port == "pf0vf2"


def test_vf_create_rolls_back_in_reverse_and_raises_the_first_error():
    error = failed(f"devlink port function rate set {VF1} tx_max 100mbit")
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (f"devlink port function set {VF1} hw_addr {MAC}", ""),
        ("ip link set dev pf0vf1 mtu 9000", ""),
        (f"devlink port function rate set {VF1} tx_max 100mbit", error),
        ("ip link set dev pf0vf1 mtu 1500", ""),
        (f"devlink port function set {VF1} hw_addr 00:00:00:00:00:00", ""),
    )
    with pytest.raises(CommandFailed) as caught:
        backend(script).create(vf_spec(mtu=9000, rate_limit_bps=100_000_000))
    script.done()
    assert caught.value is error


def test_a_failing_undo_does_not_hide_the_error_nor_stop_the_other_undos():
    error = failed("ip link set dev pf0vf1 mtu 9000", "RTNETLINK answers: Invalid argument")
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (f"devlink port function set {VF1} hw_addr {MAC}", ""),
        ("ip link set dev pf0vf1 mtu 9000", error),
        (f"devlink port function set {VF1} hw_addr 00:00:00:00:00:00", Unavailable("gone")),
    )
    with pytest.raises(CommandFailed, match="Invalid argument"):
        backend(script).create(vf_spec(mtu=9000))
    script.done()


def test_vf_create_with_no_free_vf_is_resource_exhausted():
    taken = ports_with(_2="02:00:00:00:00:02", _3="02:00:00:00:00:03")
    script = Script((PORT_SHOW, taken))
    with pytest.raises(ResourceExhausted, match="sriov_numvfs"):
        backend(script).create(vf_spec())
    script.done()


def test_vf_create_refuses_a_mac_another_port_has():
    script = Script((PORT_SHOW, data("devlink-port-show.json")))
    with pytest.raises(FailedPrecondition, match=r"pci/0000:03:00.0/1"):
        backend(script).create(vf_spec(mac="0c:42:a1:00:00:01"))
    script.done()


def test_vf_create_when_the_pf_netdev_is_unknown():
    script = Script((PORT_SHOW, data("devlink-port-show.json")))
    with pytest.raises(FailedPrecondition, match="no physical port has the netdev p7"):
        backend(script, pf="p7").create(vf_spec())
    script.done()


def test_a_rate_that_is_not_whole_mbit_is_refused_before_any_command():
    script = Script()
    with pytest.raises(InvalidArgument, match="whole number of Mbit/s"):
        backend(script).create(vf_spec(rate_limit_bps=1_500_000))
    assert script.ran == []


def test_a_missing_tool_is_unavailable():
    script = Script((PORT_SHOW, Unavailable("devlink: not installed")))
    with pytest.raises(Unavailable):
        backend(script).create(vf_spec())
    script.done()


def made_vf(**facts: str) -> Provisioned:
    base = {"port": VF1, "pfnum": "0", "vfnum": "1", "mac": MAC}
    return Provisioned("pf0vf1", "vf:0/1", {**base, **facts})


def test_vf_update_applies_mac_mtu_rate_and_records_vlan_and_trust():
    old = vf_spec(rate_limit_bps=100_000_000)
    new = vf_spec(mac="02:00:00:00:0b:01", mtu=4000, rate_limit_bps=0, vlan_id=7, trust=True)
    script = Script(
        (PORT_SHOW, ports_with(_2=MAC)),
        (f"devlink port function set {VF1} hw_addr 02:00:00:00:0b:01", ""),
        ("ip link set dev pf0vf1 mtu 4000", ""),
        (f"devlink port function rate set {VF1} tx_max 0mbit", ""),
    )
    made = backend(script).update(old, new, made_vf())
    script.done()
    assert made.facts["mac"] == "02:00:00:00:0b:01"
    assert made.facts["vlan_id"] == "7"
    assert made.facts["trust"] == "on"
    assert made.facts["rate_bps"] == "0"
    assert made.facts["port"] == VF1


def test_vf_update_rolls_back_what_it_changed():
    old, new = vf_spec(), vf_spec(mac="02:00:00:00:0b:01", mtu=4000, rate_limit_bps=2_000_000)
    error = failed(f"devlink port function rate set {VF1} tx_max 2mbit")
    script = Script(
        (PORT_SHOW, ports_with(_2=MAC)),
        (f"devlink port function set {VF1} hw_addr 02:00:00:00:0b:01", ""),
        ("ip link set dev pf0vf1 mtu 4000", ""),
        (f"devlink port function rate set {VF1} tx_max 2mbit", error),
        ("ip link set dev pf0vf1 mtu 1500", ""),
        (f"devlink port function set {VF1} hw_addr {MAC}", ""),
    )
    with pytest.raises(CommandFailed) as caught:
        backend(script).update(old, new, made_vf())
    script.done()
    assert caught.value is error


def test_vf_update_of_recorded_fields_only_runs_nothing():
    script = Script()
    made = backend(script).update(vf_spec(), vf_spec(vlan_id=9, spoof_check=False), made_vf())
    assert script.ran == []
    assert (made.facts["vlan_id"], made.facts["spoof_check"]) == ("9", "off")


def test_vf_delete_undoes_rate_mtu_and_mac_last():
    script = Script(
        (PORT_SHOW, ports_with(_2=MAC)),
        (f"devlink port function rate set {VF1} tx_max 0mbit", ""),
        ("ip link set dev pf0vf1 mtu 1500", ""),
        (f"devlink port function set {VF1} hw_addr 00:00:00:00:00:00", ""),
    )
    backend(script).delete(vf_spec(rate_limit_bps=100_000_000), made_vf())
    script.done()


def test_vf_delete_after_a_crashed_create_finds_the_vf_by_its_mac():
    mac = derived_mac("web-1")
    script = Script(
        (PORT_SHOW, ports_with(_3=mac)),
        ("ip link set dev pf0vf2 mtu 1500", ""),
        ("devlink port function set pci/0000:03:00.0/3 hw_addr 00:00:00:00:00:00", ""),
    )
    backend(script).delete(vf_spec(mac=""), Provisioned("", ""))
    script.done()


@pytest.mark.parametrize(
    "listing",
    [
        pytest.param(data("devlink-port-show.json"), id="no-port-has-the-mac"),
        pytest.param(ports_with(_2="02:00:00:00:0c:01"), id="recorded-port-reused"),
    ],
)
def test_vf_delete_is_idempotent(listing):
    script = Script((PORT_SHOW, listing))
    backend(script).delete(vf_spec(), made_vf())
    script.done()


def test_vf_delete_refuses_to_guess_between_two_vfs_with_the_mac():
    script = Script((PORT_SHOW, ports_with(_2=MAC, _3=MAC)))
    with pytest.raises(FailedPrecondition, match="on 2 devices"):
        backend(script).delete(vf_spec(), Provisioned("", ""))
    script.done()


def test_vf_present():
    script = Script((PORT_SHOW, ports_with(_2=MAC)), (PORT_SHOW, data("devlink-port-show.json")))
    assert backend(script).present(vf_spec(), made_vf()) is True
    assert backend(script).present(vf_spec(), made_vf()) is False
    script.done()


def test_vf_restore_follows_the_mac_to_its_port():
    script = Script((PORT_SHOW, ports_with(_3=MAC)))
    made = backend(script).restore(vf_spec(), made_vf())
    script.done()
    assert (made.representor_port, made.facts["port"]) == ("pf0vf2", "pci/0000:03:00.0/3")


# ---------------------------------------------------------------- SF

SF_ADD = "devlink -j port add pci/0000:03:00.0 flavour pcisf pfnum 0 sfnum 100 controller 1"


def test_sf_create_adds_activates_and_reads_the_renamed_representor():
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (SF_ADD, data("devlink-port-add-sf.txt")),
        (f"devlink port function set {SF} hw_addr {MAC} state active", ""),
        (f"devlink port function rate set {SF} tx_max 10000mbit", ""),
        (f"devlink -j port show {SF}", data("devlink-port-show-sf.json")),
        ("ip link set dev en3f0c1pf0sf100 mtu 1500", ""),
    )
    made = backend(script).create(sf_spec(rate_limit_bps=10_000_000_000))
    script.done()
    assert made.representor_port == "en3f0c1pf0sf100"
    assert made.host_device == "sf:0/100"
    assert (made.facts["port"], made.facts["sfnum"]) == (SF, "100")


def test_sf_create_takes_the_next_free_sf_number_and_the_local_controller():
    listing = ports_plus(data("devlink-port-show-sf.json"))  # sfnum 100 is taken
    add = data("devlink-port-add-sf.txt").replace('"sfnum":100', '"sfnum":101')
    add = add.replace("229410", "229411").replace('"controller":1', '"controller":0')
    h = "pci/0000:03:00.0/229411"
    show = data("devlink-port-show-sf.json").replace("229410", "229411")
    script = Script(
        (PORT_SHOW, listing),
        ("devlink -j port add pci/0000:03:00.0 flavour pcisf pfnum 0 sfnum 101", add),
        (f"devlink port function set {h} hw_addr 02:00:00:00:0a:09 state active", ""),
        (f"devlink -j port show {h}", show),
        ("ip link set dev en3f0c1pf0sf100 mtu 1500", ""),
    )
    backend(script, controller=0).create(sf_spec(mac="02:00:00:00:0a:09"))
    script.done()


def test_sf_create_finds_the_new_port_when_add_prints_nothing_readable():
    listing = ports_plus(data("devlink-port-show-sf.json"))
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (SF_ADD, "\n"),
        (PORT_SHOW, listing),
        (f"devlink port function set {SF} hw_addr {MAC} state active", ""),
        (f"devlink -j port show {SF}", data("devlink-port-show-sf.json")),
        ("ip link set dev en3f0c1pf0sf100 mtu 1500", ""),
    )
    backend(script).create(sf_spec())
    script.done()


def test_sf_create_rolls_back_when_activation_fails():
    error = failed(f"devlink port function set {SF} hw_addr {MAC} state active")
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (SF_ADD, data("devlink-port-add-sf.txt")),
        (f"devlink port function set {SF} hw_addr {MAC} state active", error),
        (f"devlink port del {SF}", ""),
    )
    with pytest.raises(CommandFailed) as caught:
        backend(script).create(sf_spec())
    script.done()
    assert caught.value is error


def test_sf_create_rolls_back_when_the_last_step_fails():
    error = failed("ip link set dev en3f0c1pf0sf100 mtu 9216", "Invalid argument")
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (SF_ADD, data("devlink-port-add-sf.txt")),
        (f"devlink port function set {SF} hw_addr {MAC} state active", ""),
        (f"devlink -j port show {SF}", data("devlink-port-show-sf.json")),
        ("ip link set dev en3f0c1pf0sf100 mtu 9216", error),
        (f"devlink port function set {SF} state inactive", ""),
        (f"devlink port del {SF}", ""),
    )
    with pytest.raises(CommandFailed) as caught:
        backend(script).create(sf_spec(mtu=9216))
    script.done()
    assert caught.value is error


def test_sf_add_failure_leaves_nothing_to_undo():
    script = Script(
        (PORT_SHOW, data("devlink-port-show.json")),
        (SF_ADD, failed(SF_ADD, "Error: mlx5_core: SF number is already in use")),
    )
    with pytest.raises(CommandFailed, match="already in use"):
        backend(script).create(sf_spec())
    script.done()


def test_sf_with_no_free_number_is_resource_exhausted():
    script = Script((PORT_SHOW, ports_plus(data("devlink-port-show-sf.json"))))
    with pytest.raises(ResourceExhausted, match="SF number"):
        backend(script, sfnum_count=1).create(sf_spec(mac="02:00:00:00:0a:07"))
    script.done()


def made_sf() -> Provisioned:
    return Provisioned("en3f0c1pf0sf100", "sf:0/100", {"port": SF, "sfnum": "100", "mac": MAC})


def test_sf_delete_deactivates_then_deletes():
    script = Script(
        (PORT_SHOW, ports_plus(data("devlink-port-show-sf.json"))),
        (f"devlink port function set {SF} state inactive", ""),
        (f"devlink port del {SF}", ""),
    )
    backend(script).delete(sf_spec(), made_sf())
    script.done()


def test_sf_delete_of_an_inactive_sf_only_deletes():
    inactive = data("devlink-port-show-sf.json").replace('"active"', '"inactive"')
    script = Script(
        (PORT_SHOW, ports_plus(inactive)),
        (f"devlink port del {SF}", ""),
    )
    backend(script).delete(sf_spec(), Provisioned("", ""))
    script.done()


def test_sf_delete_is_idempotent():
    script = Script((PORT_SHOW, data("devlink-port-show.json")))
    backend(script).delete(sf_spec(), made_sf())
    script.done()


def test_sf_update_changes_the_mac_while_inactive():
    script = Script(
        (PORT_SHOW, ports_plus(data("devlink-port-show-sf.json"))),
        (f"devlink port function set {SF} state inactive", ""),
        (f"devlink port function set {SF} hw_addr 02:00:00:00:0b:01 state active", ""),
    )
    made = backend(script).update(sf_spec(), sf_spec(mac="02:00:00:00:0b:01"), made_sf())
    script.done()
    assert made.facts["mac"] == "02:00:00:00:0b:01"


def test_sf_update_rollback_restores_the_old_mac_and_state():
    new = sf_spec(mac="02:00:00:00:0b:01", mtu=9000)
    error = failed("ip link set dev en3f0c1pf0sf100 mtu 9000")
    script = Script(
        (PORT_SHOW, ports_plus(data("devlink-port-show-sf.json"))),
        (f"devlink port function set {SF} state inactive", ""),
        (f"devlink port function set {SF} hw_addr 02:00:00:00:0b:01 state active", ""),
        ("ip link set dev en3f0c1pf0sf100 mtu 9000", error),
        (f"devlink port function set {SF} state inactive", ""),
        (f"devlink port function set {SF} hw_addr {MAC} state active", ""),
    )
    with pytest.raises(CommandFailed):
        backend(script).update(sf_spec(), new, made_sf())
    script.done()


def test_update_without_the_recorded_port_is_failed_precondition():
    script = Script()
    with pytest.raises(FailedPrecondition, match="no port"):
        backend(script).update(sf_spec(), sf_spec(mtu=9000), Provisioned("x", "y"))
    assert script.ran == []


# ---------------------------------------------------------------- virtio-net

HOTPLUG = f"virtnet hotplug -i mlx5_0 -m {VIRTIO_MAC} -t 1500 -n 4 -s 256"
REP = "en3f0pf0sf1001"


def test_virtio_net_create_hotplugs_and_sets_the_representor_mtu():
    script = Script(
        ("virtnet list", virtnet_list(0)),
        (HOTPLUG, data("virtnet-hotplug.json")),
        (f"ip link set dev {REP} mtu 1500", ""),
    )
    made = backend(script).create(virtio_spec())
    script.done()
    assert made.representor_port == REP
    assert made.host_device == "pci:84:0.0"
    assert (made.facts["virtnet_id"], made.facts["bdf"]) == ("1", "84:0.0")


def test_virtio_net_create_passes_features_and_queues_from_the_settings():
    script = Script(
        ("virtnet list", virtnet_list()),
        (
            f"virtnet hotplug -i mlx5_1 -f 0x80000 -m {VIRTIO_MAC} -t 9000 -n 8 -s 1024",
            data("virtnet-hotplug.json"),
        ),
        (f"ip link set dev {REP} mtu 9000", ""),
    )
    settings = {"ib_device": "mlx5_1", "virtio_features": "0x80000"}
    backend(script, virtio_queues=8, virtio_queue_size=1024, **settings).create(
        virtio_spec(mtu=9000)
    )
    script.done()


def test_virtio_net_create_rolls_back_rate_then_unplugs():
    error = failed(f"ip link set dev {REP} mtu 9000")
    script = Script(
        ("virtnet list", virtnet_list(0)),
        (HOTPLUG.replace("-t 1500", "-t 9000"), data("virtnet-hotplug.json")),
        (PORT_SHOW, data("devlink-port-show.json")),
        ("devlink port function rate set pci/0000:03:00.0/229409 tx_max 50mbit", ""),
        (f"ip link set dev {REP} mtu 9000", error),
        ("devlink port function rate set pci/0000:03:00.0/229409 tx_max 0mbit", ""),
        ("virtnet unplug -p 1", data("virtnet-status-ok.json")),
    )
    with pytest.raises(CommandFailed) as caught:
        backend(script).create(virtio_spec(mtu=9000, rate_limit_bps=50_000_000))
    script.done()
    assert caught.value is error


def test_virtio_net_hotplug_error_in_its_json_is_failed_precondition():
    script = Script(
        ("virtnet list", virtnet_list()),
        (HOTPLUG, data("virtnet-status-error.json")),
    )
    with pytest.raises(FailedPrecondition, match="already in use"):
        backend(script).create(virtio_spec())
    script.done()


def test_virtio_net_hotplug_without_an_id_is_found_by_mac_and_unplugged():
    script = Script(
        ("virtnet list", virtnet_list()),
        (HOTPLUG, '{"bdf": "84:0.0"}'),
        ("virtnet list", virtnet_list(1)),
        ("virtnet unplug -p 1", data("virtnet-status-ok.json")),
    )
    with pytest.raises(FailedPrecondition, match="no device id"):
        backend(script).create(virtio_spec())
    script.done()


def test_virtio_net_refuses_a_mac_a_device_has():
    script = Script(("virtnet list", virtnet_list(0, 1)))
    with pytest.raises(FailedPrecondition, match="already used by a virtio-net device"):
        backend(script).create(virtio_spec())
    script.done()


def made_virtio() -> Provisioned:
    return Provisioned(REP, "pci:84:0.0", {"virtnet_id": "1", "mac": VIRTIO_MAC})


def test_virtio_net_delete_unplugs_and_is_idempotent():
    script = Script(
        ("virtnet list", virtnet_list(0, 1)),
        ("virtnet unplug -p 1", data("virtnet-status-ok.json")),
        ("virtnet list", virtnet_list(0)),
    )
    backend(script).delete(virtio_spec(), made_virtio())
    backend(script).delete(virtio_spec(), made_virtio())
    script.done()


def test_virtio_net_delete_lifts_the_rate_first():
    script = Script(
        ("virtnet list", virtnet_list(0, 1)),
        (PORT_SHOW, data("devlink-port-show.json")),
        ("devlink port function rate set pci/0000:03:00.0/229409 tx_max 0mbit", ""),
        ("virtnet unplug -p 1", data("virtnet-status-ok.json")),
    )
    backend(script).delete(virtio_spec(rate_limit_bps=5_000_000), Provisioned("", ""))
    script.done()


def test_virtio_net_delete_leaves_a_device_that_reused_the_id():
    script = Script(("virtnet list", virtnet_list(0, 1)))  # id 1 now has another MAC
    backend(script).delete(virtio_spec(mac="02:00:00:00:0d:01"), made_virtio())
    script.done()


def test_virtio_net_update_mac_and_rate_but_not_mtu():
    script = Script(
        ("virtnet modify -p 1 device -m 02:00:00:00:0d:01", data("virtnet-status-ok.json")),
        (PORT_SHOW, data("devlink-port-show.json")),
        ("devlink port function rate set pci/0000:03:00.0/229409 tx_max 20mbit", ""),
    )
    b = backend(script)
    made = b.update(
        virtio_spec(),
        virtio_spec(mac="02:00:00:00:0d:01", rate_limit_bps=20_000_000),
        made_virtio(),
    )
    script.done()
    assert made.facts["port"] == "pci/0000:03:00.0/229409"
    assert made.facts["mac"] == "02:00:00:00:0d:01"
    with pytest.raises(FailedPrecondition, match="MTU"):
        b.update(virtio_spec(), virtio_spec(mtu=9000), made)


def test_virtio_net_present():
    script = Script(("virtnet list", virtnet_list(0, 1)), ("virtnet list", virtnet_list(0)))
    assert backend(script).present(virtio_spec(), made_virtio()) is True
    assert backend(script).present(virtio_spec(), made_virtio()) is False
    script.done()


# ---------------------------------------------------------------- NVMe and virtio-blk

CTRL = "dpu_disk_1"


def test_nvme_create_makes_subsystem_namespace_and_controller_on_a_free_pf():
    script = Script(
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
        (f"snap_rpc.py nvme_subsystem_create --nqn {NQN}", ""),
        (f"snap_rpc.py nvme_namespace_create --nqn {NQN} --nsid 1 --bdev_name vol-a", ""),
        (
            f"snap_rpc.py nvme_controller_create --nqn {NQN} --pf_id 1 --ctrl {CTRL} --suspended",
            '{"ctrl_id": "dpu_disk_1"}',
        ),
        (f"snap_rpc.py nvme_controller_attach_ns --ctrl {CTRL} --nsid 1", ""),
        (f"snap_rpc.py nvme_controller_resume --ctrl {CTRL}", ""),
    )
    made = backend(script).create(nvme_spec())
    script.done()
    assert made.representor_port == ""
    assert made.host_device == "pci:af:00.3"
    assert made.facts["nqn"] == NQN
    assert (made.facts["ctrl"], made.facts["pf_id"], made.facts["bdev"]) == (CTRL, "1", "vol-a")
    assert "mac" not in made.facts


def test_nvme_create_rolls_back_in_reverse():
    error = failed(f"snap_rpc.py nvme_controller_attach_ns --ctrl {CTRL} --nsid 1")
    script = Script(
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
        (f"snap_rpc.py nvme_subsystem_create --nqn {NQN}", ""),
        (f"snap_rpc.py nvme_namespace_create --nqn {NQN} --nsid 1 --bdev_name vol-a", ""),
        (f"snap_rpc.py nvme_controller_create --nqn {NQN} --pf_id 1 --ctrl {CTRL} --suspended", ""),
        (f"snap_rpc.py nvme_controller_attach_ns --ctrl {CTRL} --nsid 1", error),
        (f"snap_rpc.py nvme_controller_destroy --ctrl {CTRL}", ""),
        (f"snap_rpc.py nvme_namespace_destroy --nqn {NQN} --nsid 1", ""),
        (f"snap_rpc.py nvme_subsystem_destroy --nqn {NQN}", ""),
    )
    with pytest.raises(CommandFailed) as caught:
        backend(script).create(nvme_spec())
    script.done()
    assert caught.value is error


def test_nvme_create_uses_the_bdev_template_and_snap_command():
    bdev = "dpu-vol-a-disk-1"
    create_ns = f"nvme_namespace_create --nqn {NQN} --nsid 1 --bdev_name {bdev}"
    wrapper = ("crictl-snap", "snap_rpc.py")
    script = Script(
        (
            "crictl-snap snap_rpc.py emulation_function_list",
            data("snap-emulation-function-list.json"),
        ),
        (f"crictl-snap snap_rpc.py nvme_subsystem_create --nqn {NQN}", ""),
        (
            f"crictl-snap snap_rpc.py {create_ns}",
            failed(create_ns, f"bdev {bdev} not found"),
        ),
        (f"crictl-snap snap_rpc.py nvme_subsystem_destroy --nqn {NQN}", ""),
    )
    b = backend(script, snap_rpc=wrapper, bdev_template="dpu-{volume_id}-{function_id}")
    with pytest.raises(CommandFailed, match="not found"):
        b.create(nvme_spec())
    script.done()


def test_no_free_emulated_function_is_resource_exhausted():
    script = Script((SNAP_FUNCTIONS, snap_functions(NVME_1="other")))
    with pytest.raises(ResourceExhausted, match="NVME"):
        backend(script).create(nvme_spec())
    script.done()


def test_nvme_delete_tears_down_in_order():
    script = Script(
        (SNAP_FUNCTIONS, snap_functions(NVME_1=CTRL)),
        (SNAP_SUBSYSTEMS, data("snap-nvme-subsystem-list.json")),
        (f"snap_rpc.py nvme_controller_detach_ns --ctrl {CTRL} --nsid 1", ""),
        (f"snap_rpc.py nvme_controller_destroy --ctrl {CTRL}", ""),
        (f"snap_rpc.py nvme_namespace_destroy --nqn {NQN} --nsid 1", ""),
        (f"snap_rpc.py nvme_subsystem_destroy --nqn {NQN}", ""),
    )
    backend(script).delete(nvme_spec(), Provisioned("", ""))
    script.done()


def test_nvme_delete_after_a_crash_removes_only_what_is_left():
    subsystems = json.loads(data("snap-nvme-subsystem-list.json"))
    subsystems[0]["controllers"] = []
    subsystems[0]["namespaces"][0]["controllers"] = []
    script = Script(
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
        (SNAP_SUBSYSTEMS, json.dumps(subsystems)),
        (f"snap_rpc.py nvme_namespace_destroy --nqn {NQN} --nsid 1", ""),
        (f"snap_rpc.py nvme_subsystem_destroy --nqn {NQN}", ""),
    )
    backend(script).delete(nvme_spec(), Provisioned("", ""))
    script.done()


def test_nvme_delete_is_idempotent():
    script = Script(
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
        (SNAP_SUBSYSTEMS, "[]"),
    )
    backend(script).delete(nvme_spec(), Provisioned("", ""))
    script.done()


def test_snap_listing_that_is_not_a_list_is_failed_precondition():
    script = Script((SNAP_FUNCTIONS, '{"error": "method not found"}'))
    with pytest.raises(FailedPrecondition, match="expected a list"):
        backend(script).create(nvme_spec())
    script.done()


def test_virtio_blk_create_skips_hotplugged_functions():
    script = Script(
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
        ("snap_rpc.py virtio_blk_controller_create --pf_id 1 --bdev vol-b --ctrl dpu_disk_2", ""),
    )
    made = backend(script).create(vblk_spec())
    script.done()
    assert made.host_device == "pci:af:00.4"
    assert (made.facts["ctrl"], made.facts["bdev"]) == ("dpu_disk_2", "vol-b")


def test_virtio_blk_create_failure_runs_nothing_after():
    argv = "snap_rpc.py virtio_blk_controller_create --pf_id 1 --bdev vol-b --ctrl dpu_disk_2"
    script = Script(
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
        (argv, failed(argv, "bdev vol-b does not exist")),
    )
    with pytest.raises(CommandFailed, match="does not exist"):
        backend(script).create(vblk_spec())
    script.done()


def test_virtio_blk_delete_present_and_idempotent():
    used = snap_functions(VBLK_1="dpu_disk_2")
    script = Script(
        (SNAP_FUNCTIONS, used),
        (SNAP_FUNCTIONS, used),
        ("snap_rpc.py virtio_blk_controller_destroy --ctrl dpu_disk_2", ""),
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
        (SNAP_FUNCTIONS, data("snap-emulation-function-list.json")),
    )
    b = backend(script)
    assert b.present(vblk_spec(), Provisioned("", "")) is True
    b.delete(vblk_spec(), Provisioned("", ""))
    b.delete(vblk_spec(), Provisioned("", ""))
    assert b.present(vblk_spec(), Provisioned("", "")) is False
    script.done()


def test_block_update_only_records():
    script = Script()
    made = Provisioned("", "pci:af:00.4", {"ctrl": "dpu_disk_2"})
    new = FunctionSpec("disk-2", FunctionType.VIRTIO_BLK, volume_id="vol-b", trust=True)
    made2 = backend(script).update(vblk_spec(), new, made)
    assert script.ran == []
    assert made2.facts == {"ctrl": "dpu_disk_2", "trust": "on", "spoof_check": "on"}
