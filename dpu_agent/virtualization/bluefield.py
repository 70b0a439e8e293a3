"""The `bluefield` function backend: functions on an NVIDIA BlueField in DPU mode.

Thin: every step is one command of the vendor's own tools, run through a `Runner`.
What each function type costs (docs/bluefield.md has the exact command lines):

- vf: the host made its VFs (`sriov_numvfs`); the backend takes a free one from
  `devlink -j port show` (flavour pcivf of our PF on the external-host controller, with
  no MAC yet), sets its MAC with `devlink port function set`, its cap with
  `devlink port function rate set ... tx_max`, and the representor's MTU with `ip link`.
- sf: `devlink port add ... flavour pcisf`, MAC and `state active`, rate, representor MTU.
- virtio-net: `virtnet hotplug` (NVIDIA's virtio-net-controller), rate on its SF port.
- virtio-blk / nvme: SNAP (`snap_rpc.py`): a controller on a free emulated PF, backed by
  the SPDK bdev that `bdev_template` names for the volume. The agent's volume store is
  not an SPDK bdev: block functions need a bdev bridge that does not exist yet.

Not enforced here, recorded in `facts` only: trust and spoof-check (devlink has no such
port-function attribute; on BlueField the eswitch rules decide what a function may send)
and the VLAN (enforced by flow rules on the representor, which the network service owns).

The MAC is the mark of ownership: a VF or SF is ours when its function's hw_addr is the
spec's MAC (or, for a spec without one, a MAC derived from the function id), so `delete`
finds what a crashed `create` left even when it has no facts. Nothing here has run on
BlueField hardware; it is tested against recorded and documented command output only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from typing import TYPE_CHECKING, Final, TypeVar

from dpu_agent.errors import AgentError, FailedPrecondition, InvalidArgument, ResourceExhausted
from dpu_agent.virtualization.backend import FunctionBackend
from dpu_agent.virtualization.commands import SubprocessRunner
from dpu_agent.virtualization.model import DEFAULT_MTU, FunctionType, Provisioned

if TYPE_CHECKING:
    from dpu_agent.virtualization.commands import Runner
    from dpu_agent.virtualization.model import FunctionSpec

log = logging.getLogger(__name__)
_T = TypeVar("_T")

ZERO_MAC: Final = "00:00:00:00:00:00"
MBIT: Final = 1_000_000
# Recorded in facts["not_enforced"]: the spec fields this backend keeps but does not apply.
NOT_ENFORCED: Final = "vlan_id,trust,spoof_check"


@dataclasses.dataclass(frozen=True)
class BlueFieldSettings:
    """Where the functions go, and how the vendor tools are reached."""

    pf: str = "p0"  # the uplink netdev (p0) or the PF's PCI address (0000:03:00.0)
    pfnum: int = 0  # the host PF the VFs and SFs belong to
    controller: int = 1  # devlink controller of the external host (1 in DPU mode)
    sfnum_first: int = 100  # SF numbers this backend hands out ...
    sfnum_count: int = 900  # ... below 1000, which virtio-net-controller takes for itself
    ib_device: str = "mlx5_0"  # virtnet hotplug -i
    virtio_features: str = ""  # virtnet hotplug -f (hex); "" = the controller's default
    virtio_queues: int = 4  # virtnet hotplug -n
    virtio_queue_size: int = 256  # virtnet hotplug -s
    snap_rpc: tuple[str, ...] = ("snap_rpc.py",)  # how to call SNAP's RPC client
    bdev_template: str = "{volume_id}"  # the SPDK bdev that holds a volume
    nqn_prefix: str = "nqn.2024-01.io.dpu-offload"  # NVMe subsystem NQN = prefix:function_id


@dataclasses.dataclass(frozen=True)
class DevlinkPort:
    """One entry of `devlink -j port show`."""

    handle: str  # pci/0000:03:00.0/1
    flavour: str = ""
    netdev: str = ""
    controller: int = 0
    pfnum: int | None = None
    vfnum: int | None = None
    sfnum: int | None = None
    hw_addr: str = ""
    state: str = ""

    @property
    def device(self) -> str:
        """The devlink device the port belongs to (pci/0000:03:00.0)."""
        return self.handle.rpartition("/")[0]


def parse_json(text: str, tool: str) -> object:
    """A tool's JSON output; FailedPrecondition if it is not JSON.

    `devlink -j port add` prints its port as a bare `"handle":{...}` member (iproute2
    opens no enclosing object for it), so such output is read as that one-member object.
    """
    body = text.strip()
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        if body.startswith('"'):
            try:
                return json.loads("{" + body + "}")
            except json.JSONDecodeError:
                pass
    raise FailedPrecondition(f"{tool}: cannot read its output as JSON: {body[:200]!r}")


def parse_ports(text: str) -> dict[str, DevlinkPort]:
    """The ports in `devlink -j port show` (or `port add`) output, by handle."""
    data = parse_json(text, "devlink")
    table = data.get("port", data) if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise FailedPrecondition(f"devlink: expected a port table, got {text.strip()[:200]!r}")
    ports = {}
    for handle, entry in table.items():
        if isinstance(entry, dict):
            ports[handle] = _port(handle, entry)
    return ports


def _port(handle: str, entry: dict[str, object]) -> DevlinkPort:
    function = entry.get("function")
    fn = function if isinstance(function, dict) else {}
    return DevlinkPort(
        handle=handle,
        flavour=_str(entry.get("flavour")),
        netdev=_str(entry.get("netdev")),
        controller=_int(entry.get("controller")) or 0,
        pfnum=_int(entry.get("pfnum")),
        vfnum=_int(entry.get("vfnum")),
        sfnum=_int(entry.get("sfnum")),
        hw_addr=_str(fn.get("hw_addr")).lower(),
        state=_str(fn.get("state")),
    )


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def derived_mac(function_id: str) -> str:
    """A locally administered unicast MAC that only this function id maps to (mostly)."""
    digest = hashlib.sha256(function_id.encode()).digest()
    return ":".join(f"{b:02x}" for b in (0x02, *digest[:5]))


def tx_max(rate_bps: int) -> str:
    """The devlink rate value for a cap in bit/s ("0mbit" lifts the cap)."""
    return f"{rate_bps // MBIT}mbit"


class _Steps:
    """Commands run so far and how to undo them, undone in reverse order on failure."""

    def __init__(self, run: Runner) -> None:
        self._run = run
        self._undo: list[list[str]] = []

    def run(self, argv: list[str], undo: list[str] | None = None) -> str:
        out = self._run(argv)
        if undo is not None:
            self._undo.append(undo)
        return out

    def on_failure(self, undo: list[str]) -> None:
        self._undo.append(undo)

    def rollback(self) -> None:
        while self._undo:
            argv = self._undo.pop()
            try:
                self._run(argv)
            except AgentError as exc:
                log.warning("undo failed", extra={"argv": argv, "error": str(exc)})


class BlueFieldFunctionBackend(FunctionBackend):
    """VFs, SFs, virtio-net, virtio-blk and NVMe functions on a BlueField DPU."""

    name = "bluefield"

    def __init__(
        self, runner: Runner | None = None, settings: BlueFieldSettings | None = None
    ) -> None:
        self._run: Runner = runner if runner is not None else SubprocessRunner()
        self.settings = settings or BlueFieldSettings()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ interface
    def create(self, spec: FunctionSpec) -> Provisioned:
        """Make the function, all of it or nothing (undo in reverse, then the first error)."""
        _check_rate(spec.rate_limit_bps)
        with self._lock:
            steps = _Steps(self._run)
            try:
                return self._create(spec, steps)
            except BaseException:
                steps.rollback()
                raise

    def update(self, old: FunctionSpec, new: FunctionSpec, made: Provisioned) -> Provisioned:
        """Apply the changed MAC, MTU and rate; record the rest. All or nothing."""
        _check_rate(new.rate_limit_bps)
        with self._lock:
            steps = _Steps(self._run)
            try:
                made2 = self._update(old, new, made, steps)
            except BaseException:
                steps.rollback()
                raise
        facts = {**made2.facts, **_common_facts(new, self._mac(new))}
        return dataclasses.replace(made2, facts=facts)

    def delete(self, spec: FunctionSpec, made: Provisioned) -> None:
        """Remove what `create` made; nothing to do if it is gone. Works without facts."""
        with self._lock:
            kind = spec.type
            if kind is FunctionType.VF:
                self._delete_vf(spec, made)
            elif kind is FunctionType.SF:
                self._delete_sf(spec, made)
            elif kind is FunctionType.VIRTIO_NET:
                self._delete_virtio_net(spec, made)
            elif kind is FunctionType.NVME:
                self._delete_nvme(spec)
            else:
                self._delete_virtio_blk(spec)

    def present(self, spec: FunctionSpec, made: Provisioned) -> bool:
        """Whether the function's device is still there and still ours."""
        with self._lock:
            kind = spec.type
            if kind in {FunctionType.VF, FunctionType.SF}:
                return self._find_port(self._ports(), spec, made) is not None
            if kind is FunctionType.VIRTIO_NET:
                return self._find_virtio_net(spec, made) is not None
            return self._ctrl_name(spec) in self._snap_ctrl_ids()

    def restore(self, spec: FunctionSpec, made: Provisioned) -> Provisioned:
        """Nothing to bring back; a VF's or SF's port and representor name are re-read."""
        if spec.type not in {FunctionType.VF, FunctionType.SF}:
            return made
        with self._lock:
            port = self._find_port(self._ports(), spec, made)
        if port is None or not port.netdev:
            return made
        return dataclasses.replace(
            made, representor_port=port.netdev, facts={**made.facts, "port": port.handle}
        )

    # ------------------------------------------------------------------ create
    def _create(self, spec: FunctionSpec, steps: _Steps) -> Provisioned:
        if spec.type is FunctionType.VF:
            return self._create_vf(spec, steps)
        if spec.type is FunctionType.SF:
            return self._create_sf(spec, steps)
        if spec.type is FunctionType.VIRTIO_NET:
            return self._create_virtio_net(spec, steps)
        if spec.type is FunctionType.NVME:
            return self._create_nvme(spec, steps)
        return self._create_virtio_blk(spec, steps)

    def _create_vf(self, spec: FunctionSpec, steps: _Steps) -> Provisioned:
        mac = self._mac(spec)
        ports = self._ports()
        _check_mac_unused(ports, mac)
        port = self._free_vf(ports)
        h = port.handle
        steps.run(_fn_set(h, "hw_addr", mac), undo=_fn_set(h, "hw_addr", ZERO_MAC))
        steps.run(_mtu(port.netdev, spec.mtu), undo=_mtu(port.netdev, DEFAULT_MTU))
        if spec.rate_limit_bps:
            steps.run(_rate(h, spec.rate_limit_bps), undo=_rate(h, 0))
        facts = {"port": h, "pfnum": str(port.pfnum), "vfnum": str(port.vfnum)}
        facts |= _common_facts(spec, mac)
        return Provisioned(port.netdev, f"vf:{port.pfnum}/{port.vfnum}", facts)

    def _create_sf(self, spec: FunctionSpec, steps: _Steps) -> Provisioned:
        mac = self._mac(spec)
        ports = self._ports()
        _check_mac_unused(ports, mac)
        device = self._device(ports)
        sfnum = self._free_sfnum(ports, device)
        out = steps.run(self._sf_add(device, sfnum))
        port = self._added_sf(out, device, sfnum)
        h = port.handle
        steps.on_failure(["devlink", "port", "del", h])
        steps.run(
            _fn_set(h, "hw_addr", mac, "state", "active"), undo=_fn_set(h, "state", "inactive")
        )
        if spec.rate_limit_bps:  # goes with the port: no undo of its own
            steps.run(_rate(h, spec.rate_limit_bps))
        # udev renames the representor once the SF exists: read its name now
        netdev = self._port_show(h).netdev
        if not netdev:
            raise FailedPrecondition(f"devlink: port {h} has no representor netdev")
        steps.run(_mtu(netdev, spec.mtu))
        s = self.settings
        facts = {"port": h, "pfnum": str(s.pfnum), "sfnum": str(sfnum)}
        facts |= _common_facts(spec, mac)
        return Provisioned(netdev, f"sf:{s.pfnum}/{sfnum}", facts)

    def _create_virtio_net(self, spec: FunctionSpec, steps: _Steps) -> Provisioned:
        mac = self._mac(spec)
        if any(d.mac == mac for d in self._virtnet_devices()):
            raise FailedPrecondition(f"mac {mac} is already used by a virtio-net device")
        s = self.settings
        argv = ["virtnet", "hotplug", "-i", s.ib_device]
        if s.virtio_features:
            argv += ["-f", s.virtio_features]
        argv += ["-m", mac, "-t", str(spec.mtu)]
        argv += ["-n", str(s.virtio_queues), "-s", str(s.virtio_queue_size)]
        answer = _virtnet_answer(steps.run(argv))
        pf_id = _int(answer.get("id"))
        if pf_id is None:
            # it may have been made all the same: find it by its MAC to take it away again
            found = next((d for d in self._virtnet_devices() if d.mac == mac), None)
            if found is not None:
                steps.on_failure(_unplug(found.pf_id))
            raise FailedPrecondition(f"virtnet hotplug: no device id in {answer!r}")
        steps.on_failure(_unplug(pf_id))
        rep = _str(answer.get("sf_rep_net_device"))
        if not rep:
            raise FailedPrecondition(f"virtnet hotplug: no sf_rep_net_device in {answer!r}")
        facts = {"virtnet_id": str(pf_id), "bdf": _str(answer.get("bdf"))}
        if spec.rate_limit_bps:
            h = self._port_of_netdev(rep).handle
            steps.run(_rate(h, spec.rate_limit_bps), undo=_rate(h, 0))
            facts["port"] = h
        steps.run(_mtu(rep, spec.mtu), undo=_mtu(rep, DEFAULT_MTU))
        facts |= _common_facts(spec, mac)
        return Provisioned(rep, f"pci:{facts['bdf']}", facts)

    def _create_nvme(self, spec: FunctionSpec, steps: _Steps) -> Provisioned:
        fn = self._free_snap_function("NVME")
        nqn, ctrl, bdev = self._nqn(spec), self._ctrl_name(spec), self._bdev(spec)
        snap = self._snap
        steps.run(snap("nvme_subsystem_create", "--nqn", nqn))
        steps.on_failure(snap("nvme_subsystem_destroy", "--nqn", nqn))
        steps.run(snap("nvme_namespace_create", "--nqn", nqn, "--nsid", "1", "--bdev_name", bdev))
        steps.on_failure(snap("nvme_namespace_destroy", "--nqn", nqn, "--nsid", "1"))
        pf_id = str(fn.pf_index)
        args = ["--nqn", nqn, "--pf_id", pf_id, "--ctrl", ctrl, "--suspended"]
        steps.run(
            snap("nvme_controller_create", *args),
            undo=snap("nvme_controller_destroy", "--ctrl", ctrl),
        )
        steps.run(
            snap("nvme_controller_attach_ns", "--ctrl", ctrl, "--nsid", "1"),
            undo=snap("nvme_controller_detach_ns", "--ctrl", ctrl, "--nsid", "1"),
        )
        steps.run(snap("nvme_controller_resume", "--ctrl", ctrl))
        facts = {"nqn": nqn, "nsid": "1", "ctrl": ctrl, "pf_id": pf_id}
        facts |= {"bdev": bdev, "bdf": fn.pci_bdf} | _common_facts(spec, "")
        return Provisioned("", f"pci:{fn.pci_bdf}", facts)

    def _create_virtio_blk(self, spec: FunctionSpec, steps: _Steps) -> Provisioned:
        fn = self._free_snap_function("VBLK")
        ctrl, bdev = self._ctrl_name(spec), self._bdev(spec)
        pf_id = str(fn.pf_index)
        steps.run(
            self._snap(
                "virtio_blk_controller_create", "--pf_id", pf_id, "--bdev", bdev, "--ctrl", ctrl
            )
        )
        facts = {"ctrl": ctrl, "pf_id": pf_id, "bdev": bdev, "bdf": fn.pci_bdf}
        facts |= _common_facts(spec, "")
        return Provisioned("", f"pci:{fn.pci_bdf}", facts)

    # ------------------------------------------------------------------ update
    def _update(
        self, old: FunctionSpec, new: FunctionSpec, made: Provisioned, steps: _Steps
    ) -> Provisioned:
        if new.type.is_block:
            return made  # trust and spoof-check are recorded only
        if new.type is FunctionType.VIRTIO_NET:
            return self._update_virtio_net(old, new, made, steps)
        old_mac, new_mac = self._mac(old), self._mac(new)
        h, rep = _fact(made, "port"), made.representor_port
        if new_mac != old_mac:
            _check_mac_unused(self._ports(), new_mac)
            if new.type is FunctionType.VF:
                steps.run(_fn_set(h, "hw_addr", new_mac), undo=_fn_set(h, "hw_addr", old_mac))
            else:  # an SF takes a new MAC only while inactive
                steps.run(
                    _fn_set(h, "state", "inactive"),
                    undo=_fn_set(h, "hw_addr", old_mac, "state", "active"),
                )
                steps.run(
                    _fn_set(h, "hw_addr", new_mac, "state", "active"),
                    undo=_fn_set(h, "state", "inactive"),
                )
        if new.mtu != old.mtu:
            steps.run(_mtu(rep, new.mtu), undo=_mtu(rep, old.mtu))
        if new.rate_limit_bps != old.rate_limit_bps:
            steps.run(_rate(h, new.rate_limit_bps), undo=_rate(h, old.rate_limit_bps))
        return made

    def _update_virtio_net(
        self, old: FunctionSpec, new: FunctionSpec, made: Provisioned, steps: _Steps
    ) -> Provisioned:
        if new.mtu != old.mtu:
            raise FailedPrecondition(
                "a virtio-net function's MTU is set when it is plugged: delete and create it"
            )
        pf_id = _fact(made, "virtnet_id")
        old_mac, new_mac = self._mac(old), self._mac(new)
        if new_mac != old_mac:
            # the guest sees the new MAC after it unbinds and binds its virtio driver
            steps.run(_modify_mac(pf_id, new_mac), undo=_modify_mac(pf_id, old_mac))
        if new.rate_limit_bps != old.rate_limit_bps:
            h = made.facts.get("port") or self._port_of_netdev(made.representor_port).handle
            steps.run(_rate(h, new.rate_limit_bps), undo=_rate(h, old.rate_limit_bps))
            return dataclasses.replace(made, facts={**made.facts, "port": h})
        return made

    # ------------------------------------------------------------------ delete
    def _delete_vf(self, spec: FunctionSpec, made: Provisioned) -> None:
        port = self._find_port(self._ports(), spec, made)
        if port is None:
            return
        h = port.handle
        if spec.rate_limit_bps:
            self._run(_rate(h, 0))
        if port.netdev:
            self._run(_mtu(port.netdev, DEFAULT_MTU))
        self._run(_fn_set(h, "hw_addr", ZERO_MAC))  # the mark of ownership goes last

    def _delete_sf(self, spec: FunctionSpec, made: Provisioned) -> None:
        port = self._find_port(self._ports(), spec, made)
        if port is None:
            return
        if port.state != "inactive":
            self._run(_fn_set(port.handle, "state", "inactive"))
        self._run(["devlink", "port", "del", port.handle])

    def _delete_virtio_net(self, spec: FunctionSpec, made: Provisioned) -> None:
        device = self._find_virtio_net(spec, made)
        if device is None:
            return
        if spec.rate_limit_bps and device.rep:
            port = self._ports_by_netdev().get(device.rep)
            if port is not None:
                self._run(_rate(port.handle, 0))
        self._run(_unplug(device.pf_id))

    def _delete_nvme(self, spec: FunctionSpec) -> None:
        nqn, ctrl = self._nqn(spec), self._ctrl_name(spec)
        ctrl_present = ctrl in self._snap_ctrl_ids()
        subsystem = next((s for s in self._snap_subsystems() if s.get("nqn") == nqn), None)
        namespace = _namespace(subsystem, 1) if subsystem is not None else None
        snap = self._snap
        if namespace is not None and ctrl in _attached(namespace):
            self._run(snap("nvme_controller_detach_ns", "--ctrl", ctrl, "--nsid", "1"))
        if ctrl_present:
            self._run(snap("nvme_controller_destroy", "--ctrl", ctrl))
        if namespace is not None:
            self._run(snap("nvme_namespace_destroy", "--nqn", nqn, "--nsid", "1"))
        if subsystem is not None:
            self._run(snap("nvme_subsystem_destroy", "--nqn", nqn))

    def _delete_virtio_blk(self, spec: FunctionSpec) -> None:
        ctrl = self._ctrl_name(spec)
        if ctrl in self._snap_ctrl_ids():
            self._run(self._snap("virtio_blk_controller_destroy", "--ctrl", ctrl))

    # ------------------------------------------------------------------ devlink
    def _ports(self) -> dict[str, DevlinkPort]:
        return parse_ports(self._run(["devlink", "-j", "port", "show"]))

    def _port_show(self, handle: str) -> DevlinkPort:
        ports = parse_ports(self._run(["devlink", "-j", "port", "show", handle]))
        if handle not in ports:
            raise FailedPrecondition(f"devlink: port {handle} is not in its own listing")
        return ports[handle]

    def _ports_by_netdev(self) -> dict[str, DevlinkPort]:
        return {p.netdev: p for p in self._ports().values() if p.netdev}

    def _port_of_netdev(self, netdev: str) -> DevlinkPort:
        port = self._ports_by_netdev().get(netdev)
        if port is None:
            raise FailedPrecondition(f"devlink: no port has the netdev {netdev}")
        return port

    def _device(self, ports: dict[str, DevlinkPort]) -> str:
        """pci/<address> of our PF, from settings.pf (an address or the uplink's netdev)."""
        pf = self.settings.pf
        if pf.count(":") == 2 and "." in pf:  # 0000:03:00.0
            return f"pci/{pf}"
        for port in ports.values():
            if port.netdev == pf and port.flavour == "physical":
                return port.device
        raise FailedPrecondition(f"devlink: no physical port has the netdev {pf}")

    def _ours(self, port: DevlinkPort, flavour: str) -> bool:
        s = self.settings
        return port.flavour == flavour and port.pfnum == s.pfnum and port.controller == s.controller

    def _free_vf(self, ports: dict[str, DevlinkPort]) -> DevlinkPort:
        device = self._device(ports)
        free = [
            p
            for p in ports.values()
            if p.device == device
            and self._ours(p, "pcivf")
            and p.netdev
            and p.vfnum is not None
            and p.hw_addr in {"", ZERO_MAC}
        ]
        if not free:
            raise ResourceExhausted(
                f"no free VF on {device} pfnum {self.settings.pfnum}: every VF the host "
                "made has a MAC (make more with sriov_numvfs on the host)"
            )
        return min(free, key=lambda p: p.vfnum or 0)

    def _free_sfnum(self, ports: dict[str, DevlinkPort], device: str) -> int:
        s = self.settings
        used = {p.sfnum for p in ports.values() if p.device == device and p.flavour == "pcisf"}
        for sfnum in range(s.sfnum_first, s.sfnum_first + s.sfnum_count):
            if sfnum not in used:
                return sfnum
        raise ResourceExhausted(f"no free SF number in {s.sfnum_first}..+{s.sfnum_count}")

    def _sf_add(self, device: str, sfnum: int) -> list[str]:
        s = self.settings
        argv = ["devlink", "-j", "port", "add", device, "flavour", "pcisf"]
        argv += ["pfnum", str(s.pfnum), "sfnum", str(sfnum)]
        if s.controller:
            argv += ["controller", str(s.controller)]
        return argv

    def _added_sf(self, out: str, device: str, sfnum: int) -> DevlinkPort:
        """The port `devlink port add` made: from its output, else from a fresh listing."""
        try:
            added = list(parse_ports(out).values()) if out.strip() else []
        except FailedPrecondition:
            added = []
        if len(added) != 1:
            added = [
                p
                for p in self._ports().values()
                if p.device == device and self._ours(p, "pcisf") and p.sfnum == sfnum
            ]
        if len(added) != 1:
            raise FailedPrecondition(f"devlink port add: cannot find the port of sfnum {sfnum}")
        return added[0]

    def _find_port(
        self, ports: dict[str, DevlinkPort], spec: FunctionSpec, made: Provisioned
    ) -> DevlinkPort | None:
        """Our VF/SF: the recorded port if it still has our MAC, else the port with our MAC."""
        mac = self._mac(spec)
        flavour = "pcivf" if spec.type is FunctionType.VF else "pcisf"
        recorded = ports.get(made.facts.get("port", ""))
        if recorded is not None and recorded.hw_addr == mac and recorded.flavour == flavour:
            return recorded
        matches = [p for p in ports.values() if self._ours(p, flavour) and p.hw_addr == mac]
        return _only(matches, mac)

    # ------------------------------------------------------------------ virtnet
    def _virtnet_devices(self) -> list[_VirtnetDevice]:
        data = _virtnet_answer(self._run(["virtnet", "list"]))
        devices = data.get("devices", [])
        if not isinstance(devices, list):
            raise FailedPrecondition(f"virtnet list: devices is not a list: {devices!r}")
        found = []
        for entry in devices:
            if isinstance(entry, dict) and (pf_id := _int(entry.get("pf_id"))) is not None:
                mac = _str(entry.get("mac")).lower()
                found.append(_VirtnetDevice(pf_id, mac, _str(entry.get("sf_rep_net_device"))))
        return found

    def _find_virtio_net(self, spec: FunctionSpec, made: Provisioned) -> _VirtnetDevice | None:
        """Our device: the recorded id if its MAC is still ours, else the one with our MAC."""
        mac = self._mac(spec)
        devices = self._virtnet_devices()
        pf_id = _int(made.facts.get("virtnet_id"))
        for device in devices:
            if device.pf_id == pf_id and device.mac in {mac, ""}:
                return device
        return _only([d for d in devices if d.mac == mac], mac)

    # ------------------------------------------------------------------ SNAP
    def _snap(self, *args: str) -> list[str]:
        return [*self.settings.snap_rpc, *args]

    def _snap_json(self, method: str) -> list[dict[str, object]]:
        data = parse_json(self._run(self._snap(method)), "snap_rpc.py")
        if not isinstance(data, list):
            raise FailedPrecondition(f"snap_rpc.py {method}: expected a list, got {data!r}"[:300])
        return [e for e in data if isinstance(e, dict)]

    def _snap_functions(self) -> list[_SnapFunction]:
        return [
            _SnapFunction(
                _str(e.get("emulation_type")).upper(),
                pf_index,
                _str(e.get("pci_bdf")),
                _str(e.get("ctrl_id")),
                e.get("hotplugged") is True,
            )
            for e in self._snap_json("emulation_function_list")
            if (pf_index := _int(e.get("pf_index"))) is not None
        ]

    def _snap_ctrl_ids(self) -> set[str]:
        return {f.ctrl_id for f in self._snap_functions() if f.ctrl_id}

    def _snap_subsystems(self) -> list[dict[str, object]]:
        return self._snap_json("nvme_subsystem_list")

    def _free_snap_function(self, emulation_type: str) -> _SnapFunction:
        """The lowest static emulated PF of that type without a controller."""
        free = [
            f
            for f in self._snap_functions()
            if f.emulation_type == emulation_type and not f.ctrl_id and not f.hotplugged
        ]
        if not free:
            raise ResourceExhausted(
                f"no free {emulation_type} emulated function in SNAP's emulation_function_list"
            )
        return min(free, key=lambda f: f.pf_index)

    # ------------------------------------------------------------------ names
    def _mac(self, spec: FunctionSpec) -> str:
        return spec.mac or derived_mac(spec.function_id)

    def _ctrl_name(self, spec: FunctionSpec) -> str:
        return "dpu_" + spec.function_id.replace("-", "_")

    def _nqn(self, spec: FunctionSpec) -> str:
        return f"{self.settings.nqn_prefix}:{spec.function_id}"

    def _bdev(self, spec: FunctionSpec) -> str:
        return self.settings.bdev_template.format(
            volume_id=spec.volume_id, function_id=spec.function_id
        )


@dataclasses.dataclass(frozen=True)
class _VirtnetDevice:
    pf_id: int
    mac: str  # lower case; "" when the listing has none
    rep: str


@dataclasses.dataclass(frozen=True)
class _SnapFunction:
    emulation_type: str  # NVME or VBLK
    pf_index: int
    pci_bdf: str
    ctrl_id: str
    hotplugged: bool


def _only(matches: list[_T], mac: str) -> _T | None:
    """The one device with our MAC, None if none; two are more than we can tell apart."""
    if len(matches) > 1:
        raise FailedPrecondition(f"mac {mac} is on {len(matches)} devices: {matches!r}"[:300])
    return matches[0] if matches else None


def _fact(made: Provisioned, key: str) -> str:
    value = made.facts.get(key, "")
    if not value:
        raise FailedPrecondition(f"the function's record has no {key}: delete and create it")
    return value


def _check_rate(rate_bps: int) -> None:
    if rate_bps % MBIT:
        raise InvalidArgument(
            f"rate_limit_bps: {rate_bps} is not a whole number of Mbit/s, "
            "which is what the BlueField eswitch (mlx5) takes"
        )


def _check_mac_unused(ports: dict[str, DevlinkPort], mac: str) -> None:
    for port in ports.values():
        if port.hw_addr == mac:
            raise FailedPrecondition(f"mac {mac} is already the address of {port.handle}")


def _common_facts(spec: FunctionSpec, mac: str) -> dict[str, str]:
    facts = {
        "trust": "on" if spec.trust else "off",
        "spoof_check": "on" if spec.spoof_check else "off",
    }
    if spec.type.is_block:
        return facts
    return {
        "mac": mac,
        "mtu": str(spec.mtu),
        "rate_bps": str(spec.rate_limit_bps),
        "vlan_id": "" if spec.vlan_id is None else str(spec.vlan_id),
        "not_enforced": NOT_ENFORCED,
        **facts,
    }


def _fn_set(handle: str, *attrs: str) -> list[str]:
    return ["devlink", "port", "function", "set", handle, *attrs]


def _rate(handle: str, rate_bps: int) -> list[str]:
    return ["devlink", "port", "function", "rate", "set", handle, "tx_max", tx_max(rate_bps)]


def _mtu(netdev: str, mtu: int) -> list[str]:
    return ["ip", "link", "set", "dev", netdev, "mtu", str(mtu)]


def _unplug(pf_id: int | str) -> list[str]:
    return ["virtnet", "unplug", "-p", str(pf_id)]


def _modify_mac(pf_id: str, mac: str) -> list[str]:
    return ["virtnet", "modify", "-p", pf_id, "device", "-m", mac]


def _virtnet_answer(out: str) -> dict[str, object]:
    """The JSON object virtnet answered; an `errno` other than 0 in it is a failure."""
    data = parse_json(out, "virtnet")
    if not isinstance(data, dict):
        raise FailedPrecondition(f"virtnet: expected a JSON object, got {out.strip()[:200]!r}")
    errno = data.get("errno", 0)
    if errno not in {0, "0"}:
        raise FailedPrecondition(f"virtnet: {_str(data.get('errstr')) or f'errno {errno}'}")
    return data


def _namespace(subsystem: dict[str, object], nsid: int) -> dict[str, object] | None:
    namespaces = subsystem.get("namespaces")
    for ns in namespaces if isinstance(namespaces, list) else []:
        if isinstance(ns, dict) and _int(ns.get("nsid")) == nsid:
            return ns
    return None


def _attached(namespace: dict[str, object]) -> set[str]:
    ctrls = namespace.get("controllers")
    return {
        _str(c.get("ctrl_id"))
        for c in (ctrls if isinstance(ctrls, list) else [])
        if isinstance(c, dict)
    }
