"""The `linux` function backend: plain Linux DPUs and the soft-RoCE test VM.

- Network functions (vf, sf, virtio-net): a veth pair, see `linux_net`.
- Block functions (virtio-blk, nvme): the volume is served by the agent on a kernel
  NBD device (`nbd`), which the kernel NVMe-oF target exports over RDMA and the host
  side connects to with nvme-rdma (`nvmet`); with `block_export = "nbd"` the NBD
  device itself is the host's device. The host sees `/dev/nvmeXn1` (or
  `/dev/nbdN`); every block passes the volume's data services.

Every create runs under an undo stack: a failing step takes the earlier ones back
before the error is raised. `delete` also works from the function id alone (the
representor's alias, the namespace name and the subsystem NQN are derived from it),
which is how leftovers of a create interrupted by a crash are removed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from dpu_agent.errors import FailedPrecondition
from dpu_agent.virtualization import nbd, nvmet
from dpu_agent.virtualization.backend import FunctionBackend
from dpu_agent.virtualization.commands import Runner, SubprocessRunner
from dpu_agent.virtualization.linux_net import FUNCTION_IFNAME, LinuxNet
from dpu_agent.virtualization.model import Provisioned
from dpu_agent.virtualization.undo import Undo

if TYPE_CHECKING:
    from dpu_agent.storage.backend import VolumeStore
    from dpu_agent.virtualization.model import FunctionSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LinuxSettings:
    """Where things go (see the `[virtualization]` configuration)."""

    dpu_netns: str = ""
    host_netns_prefix: str = "fn-"
    block_export: str = "nvmf-rdma"  # or "nbd"
    nvmf_address: str = ""
    nvmf_port: int = 4420
    nvmf_host_address: str = ""  # the host side connects from here ("": the kernel picks)


def mounted(device: str) -> str | None:
    """Where a block device is mounted (or what holds it), or None."""
    try:
        rdev = Path(device).stat().st_rdev
    except OSError:
        return None
    wanted = f"{os.major(rdev)}:{os.minor(rdev)}"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        if (
            len(fields) > 4 and fields[2] == wanted
        ):  # mountinfo: id parent major:minor root mount-point
            return f"{device} is mounted on {fields[4]}"
    holders = Path("/sys/class/block") / Path(device).name / "holders"
    if holders.is_dir() and any(holders.iterdir()):
        return f"{device} is held by {', '.join(p.name for p in holders.iterdir())}"
    return None


class LinuxFunctionBackend(FunctionBackend):
    """veth pairs and namespaces for network functions, NBD + NVMe-oF for block functions."""

    name = "linux"

    def __init__(
        self,
        settings: LinuxSettings,
        *,
        volumes: VolumeStore | None,
        runner: Runner | None = None,
    ) -> None:
        self.settings = settings
        self.net = LinuxNet(runner or SubprocessRunner(), settings.dpu_netns,
                            settings.host_netns_prefix)  # fmt: skip
        self.target = nvmet.NvmetTarget(settings.nvmf_address, settings.nvmf_port)
        self._volumes = volumes
        self._exports: dict[str, nbd.NbdExport] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ create
    def create(self, spec: FunctionSpec) -> Provisioned:
        """Make the function; on any failure nothing of it remains."""
        with self._lock, Undo(f"create function {spec.function_id}") as undo:
            if spec.type.is_block:
                return self._create_block(spec, undo)
            rep, ns, mac = self.net.create(spec, undo)
            return Provisioned(rep, f"{ns}/{FUNCTION_IFNAME}", {"netns": ns, "mac": mac})

    def _create_block(self, spec: FunctionSpec, undo: Undo) -> Provisioned:
        if self._volumes is None:
            raise FailedPrecondition("block functions need a volume store")
        nvmf = self.settings.block_export == "nvmf-rdma"
        if nvmf:
            self.target.check()
        export = nbd.NbdExport(self._volumes, spec.volume_id, nbd.free_device())
        export.start()
        self._exports[spec.function_id] = export
        undo.push(f"nbd {export.device}", lambda: self._stop_export(spec.function_id))
        facts = {"nbd": export.device, "block_export": self.settings.block_export}
        if not nvmf:
            return Provisioned("", export.path, facts)
        sub = nvmet.nqn(spec.function_id)
        undo.push(f"subsystem {sub}", lambda: self.target.remove(sub))
        self.target.export(sub, export.path)
        undo.push(f"port of {sub}", lambda: self.target.unpublish(sub))
        self.target.publish(sub)
        address, port = self.settings.nvmf_address, self.settings.nvmf_port
        controller = nvmet.connect(sub, address, port, self.settings.nvmf_host_address)
        undo.push(f"controller {controller}", lambda: nvmet.disconnect(controller))
        device = nvmet.namespace_device(controller, sub)
        facts |= {"nqn": sub, "controller": controller, "traddr": address, "trsvcid": str(port)}
        return Provisioned("", device, facts)

    def _stop_export(self, function_id: str) -> None:
        export = self._exports.pop(function_id, None)
        if export is not None:
            export.stop()

    # ------------------------------------------------------------------ update
    def update(self, old: FunctionSpec, new: FunctionSpec, made: Provisioned) -> Provisioned:
        """MTU, MAC, VLAN, rate limit and spoof check; on failure the old settings come back."""
        if new.type.is_block:
            return made  # trust/spoof check mean nothing for a block device
        with self._lock:
            ns = made.facts.get("netns") or self.net.netns(new.function_id)
            old_mac = made.facts.get("mac") or old.mac
            mac = new.mac or old_mac
            self.net.set_link(made.representor_port, ns, new, mac)
            self.net.clear_controls(ns)
            try:
                self.net.apply_controls(ns, new, mac)
            except BaseException:
                self.net.clear_controls(ns)
                self.net.set_link(made.representor_port, ns, old, old_mac)
                self.net.apply_controls(ns, old, old_mac)
                raise
            return dataclasses.replace(made, facts={**made.facts, "mac": mac})

    # ------------------------------------------------------------------ delete
    def delete(self, spec: FunctionSpec, made: Provisioned) -> None:
        """Remove everything of the function, found from the record or from its id."""
        with self._lock:
            if spec.type.is_block:
                self._delete_block(spec)
            else:
                self.net.delete(spec.function_id, made.representor_port)

    def _delete_block(self, spec: FunctionSpec) -> None:
        sub = nvmet.nqn(spec.function_id)
        for controller in nvmet.controllers(sub):
            nvmet.disconnect(controller)
        if self.target.root.is_dir():
            self.target.unpublish(sub)
            self.target.remove(sub)
        self._stop_export(spec.function_id)

    def busy(self, spec: FunctionSpec, made: Provisioned) -> str | None:
        """A block function whose device is mounted (or held) is busy."""
        if spec.type.is_block and made.host_device:
            return mounted(made.host_device)
        return None

    def present(self, spec: FunctionSpec, made: Provisioned) -> bool:
        """Network functions: the namespace and representor exist. Block: re-made at start."""
        if spec.type.is_block:
            return True
        return self.net.present(spec.function_id, made.representor_port)

    def restore(self, spec: FunctionSpec, made: Provisioned) -> Provisioned:
        """A block export ends with the process that served it: make it again."""
        if not spec.type.is_block or spec.function_id in self._exports:
            return made
        self.delete(spec, made)
        return self.create(spec)

    def close(self) -> None:
        """Stop serving block exports (their devices fail I/O until the agent is back)."""
        with self._lock:
            for function_id in list(self._exports):
                self._stop_export(function_id)
