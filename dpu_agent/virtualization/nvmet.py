"""A block device exported over NVMe-oF/RDMA with the kernel's target, and connected.

Target (the DPU side), through configfs (`/sys/kernel/config/nvmet`), as nvmetcli does:

- subsystem `<NQN_PREFIX><function id>` with `attr_allow_any_host = 1`, namespace 1
  backed by the device (`device_path`), enabled;
- one RDMA port per (address, service id), shared by every function's subsystem; it is
  created on first use and removed when its last subsystem goes.

Initiator (the host side): a write of `transport=rdma,traddr=...,trsvcid=...,nqn=...`
to `/dev/nvme-fabrics`, as `nvme connect` does; the kernel answers
`instance=N,cntlid=M`, and the namespace's block device is the one whose subsystem NQN
is ours. Disconnecting writes 1 to the controller's `delete_controller`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path
from typing import Final

from dpu_agent.errors import FailedPrecondition, Unavailable

NVMET: Final = Path("/sys/kernel/config/nvmet")
FABRICS: Final = Path("/dev/nvme-fabrics")
NVME_CLASS: Final = Path("/sys/class/nvme")
NQN_PREFIX: Final = "nqn.2026-11.io.dpu-offload:function:"
DEVICE_WAIT_S: Final = 15.0
_NAMESPACE_NODE: Final = re.compile(r"^nvme\d+n1$")


def nqn(function_id: str) -> str:
    """The subsystem NQN of a function (at most 223 bytes, NVMe's limit)."""
    name = NQN_PREFIX + function_id
    if len(name.encode()) > 223:  # NVMe base spec: an NQN has at most 223 bytes
        raise FailedPrecondition(f"function id {function_id!r} is too long for an NVMe NQN")
    return name


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise FailedPrecondition(
            f"nvmet: cannot write {value!r} to {path}: {exc.strerror}"
        ) from None


def _mkdir(path: Path) -> None:
    try:
        path.mkdir()
    except OSError as exc:
        raise FailedPrecondition(f"nvmet: cannot create {path}: {exc.strerror}") from None


class NvmetTarget:
    """Subsystems and ports in the kernel NVMe target."""

    def __init__(self, address: str, service_id: int, root: Path = NVMET) -> None:
        self.address = address
        self.service_id = str(service_id)
        self.root = root

    def check(self) -> None:
        """FailedPrecondition when the target cannot be used at all."""
        if not self.address:
            raise FailedPrecondition(
                "block functions need [virtualization] nvmf_address (the RDMA interface address)"
            )
        if not self.root.is_dir():
            raise FailedPrecondition(
                f"{self.root} is missing: load nvmet and nvmet-rdma and mount configfs"
            )

    def subsystems(self) -> list[str]:
        """NQNs of the target's subsystems that are ours."""
        base = self.root / "subsystems"
        return sorted(p.name for p in base.iterdir() if p.name.startswith(NQN_PREFIX))

    def export(self, subsystem: str, device_path: str) -> None:
        """Create the subsystem with namespace 1 on `device_path` (not yet on a port)."""
        sub = self.root / "subsystems" / subsystem
        _mkdir(sub)
        _write(sub / "attr_allow_any_host", "1")
        ns = sub / "namespaces" / "1"
        _mkdir(ns)
        _write(ns / "device_path", device_path)
        _write(ns / "enable", "1")

    def _port(self) -> Path | None:
        for port in sorted((self.root / "ports").iterdir()):
            try:
                fields = {
                    k: (port / k).read_text().strip()
                    for k in ("addr_trtype", "addr_traddr", "addr_trsvcid")
                }
            except OSError:
                continue
            if fields == {
                "addr_trtype": "rdma",
                "addr_traddr": self.address,
                "addr_trsvcid": self.service_id,
            }:
                return port
        return None

    def publish(self, subsystem: str) -> None:
        """Put the subsystem on the shared RDMA port (made when missing)."""
        port = self._port()
        if port is None:
            used = {int(p.name) for p in (self.root / "ports").iterdir() if p.name.isdigit()}
            port = self.root / "ports" / str(next(i for i in range(1, 65536) if i not in used))
            _mkdir(port)
            try:
                _write(port / "addr_trtype", "rdma")
                _write(port / "addr_adrfam", "ipv6" if ":" in self.address else "ipv4")
                _write(port / "addr_traddr", self.address)
                _write(port / "addr_trsvcid", self.service_id)
            except FailedPrecondition:
                port.rmdir()
                raise
        link = port / "subsystems" / subsystem
        try:
            link.symlink_to(self.root / "subsystems" / subsystem)
        except OSError as exc:
            # the RDMA listener starts here: a bad address fails now
            self._drop_port_if_empty(port)
            raise FailedPrecondition(
                f"nvmet: cannot listen on rdma {self.address}:{self.service_id}: {exc.strerror}"
            ) from None

    def unpublish(self, subsystem: str) -> None:
        """Take the subsystem off every port; remove ports left empty that are ours."""
        for port in (self.root / "ports").iterdir():
            link = port / "subsystems" / subsystem
            if link.is_symlink():
                link.unlink()
        ours = self._port()
        if ours is not None:
            self._drop_port_if_empty(ours)

    @staticmethod
    def _drop_port_if_empty(port: Path) -> None:
        if not any((port / "subsystems").iterdir()):
            with contextlib.suppress(OSError):
                port.rmdir()

    def remove(self, subsystem: str) -> None:
        """Remove the subsystem (after `unpublish`); no error if it is gone."""
        sub = self.root / "subsystems" / subsystem
        if not sub.exists():
            return
        for ns in (sub / "namespaces").iterdir():
            with contextlib.suppress(OSError):
                (ns / "enable").write_text("0")
            ns.rmdir()
        for host in (sub / "allowed_hosts").iterdir():
            host.unlink()
        sub.rmdir()


def controllers(subsystem: str) -> list[str]:
    """Host-side controllers (nvmeN) connected to the subsystem."""
    found: list[str] = []
    if not NVME_CLASS.is_dir():
        return found
    for ctrl in sorted(NVME_CLASS.iterdir()):
        try:
            if (ctrl / "subsysnqn").read_text().strip() == subsystem:
                found.append(ctrl.name)
        except OSError:
            continue
    return found


def connect(subsystem: str, address: str, service_id: int, host_address: str = "") -> str:
    """Connect the host side over RDMA (from `host_address` if given); the controller (nvmeN)."""
    options = f"transport=rdma,traddr={address},trsvcid={service_id},nqn={subsystem}"
    if host_address:
        options += f",host_traddr={host_address}"
    try:
        fd = os.open(FABRICS, os.O_RDWR)
    except OSError as exc:
        raise Unavailable(f"cannot open {FABRICS}: {exc.strerror} (load nvme-rdma)") from None
    try:
        os.write(fd, options.encode())
        answer = os.read(fd, 4096).decode()
    except OSError as exc:
        raise FailedPrecondition(
            f"nvme connect to {address}:{service_id}: {exc.strerror}"
        ) from None
    finally:
        os.close(fd)
    fields = dict(item.split("=", 1) for item in answer.strip().split(",") if "=" in item)
    if "instance" not in fields:
        raise FailedPrecondition(f"nvme connect: unexpected answer {answer!r}")
    return f"nvme{fields['instance']}"


def namespace_device(controller: str, subsystem: str) -> str:
    """/dev path of namespace 1 behind the controller, once the kernel has made it."""
    deadline = time.monotonic() + DEVICE_WAIT_S
    while time.monotonic() < deadline:
        for block in sorted(Path("/sys/block").glob("nvme*n1")):
            if not _NAMESPACE_NODE.match(block.name):  # nvmeXcYn1: a hidden path of it
                continue
            try:
                nqn_file = block / "device" / "subsysnqn"
                if not nqn_file.exists():  # multipath node: its device is the subsystem
                    nqn_file = block.resolve().parent.parent / "subsysnqn"
                if nqn_file.read_text().strip() == subsystem:
                    return f"/dev/{block.name}"
            except OSError:
                continue
        time.sleep(0.05)
    raise FailedPrecondition(f"no namespace appeared behind {controller} within {DEVICE_WAIT_S} s")


def disconnect(controller: str) -> None:
    """Delete a host-side controller (no error if it is gone)."""
    path = NVME_CLASS / controller / "delete_controller"
    with contextlib.suppress(FileNotFoundError):
        path.write_text("1")
