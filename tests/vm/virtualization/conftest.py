"""Fixtures for the virtualization suite: real veth pairs, namespaces, NBD and NVMe-oF.

Run it in the test VM (the host has no tc flower, no rxe and no NVMe target)::

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m pytest tests/vm/virtualization

Where the kernel lacks what a test needs, the test skips with the reason;
deploy/testvm/check_junit.py makes a skip in the VM run a failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.vm.network.topology import flower_unusable, sh

if TYPE_CHECKING:
    from collections.abc import Iterator

DPU = "dpuv"  # the representors' namespace (the DPU side)
PREFIX = "vfn-"  # functions' namespaces (the host side)
NVMF_ADDRESS = "192.168.77.1"  # veth0, where the test VM puts rxe0 (the DPU's node)
NVMF_HOST_ADDRESS = "192.168.77.2"  # veth1, rxe1: the host's node connects from here
NVMET = Path("/sys/kernel/config/nvmet")
NQN_PREFIX = "nqn.2026-11.io.dpu-offload:function:"


def kernel_state() -> dict[str, list[str]]:
    """What of ours the kernel holds: namespaces, representors, subsystems, NBD, NVMe."""
    netns = [n for n in sh("ip", "netns", "list").stdout.split() if n.startswith(PREFIX)]
    links = json.loads(sh("ip", "-n", DPU, "-j", "link", "show").stdout or "[]")
    reps = [
        f"{x['ifname']} ({x.get('ifalias', '')})"
        for x in links
        if x["ifname"].startswith("pf0") or x.get("ifalias", "").startswith("dpu-function:")
    ]
    subsystems = (
        sorted(p.name for p in (NVMET / "subsystems").iterdir() if p.name.startswith(NQN_PREFIX))
        if NVMET.is_dir()
        else []
    )
    ports = sorted(p.name for p in (NVMET / "ports").iterdir()) if NVMET.is_dir() else []
    nbd = sorted(p.parent.name for p in Path("/sys/block").glob("nbd*/pid"))
    nvme = [
        p.name
        for p in Path("/sys/class/nvme").glob("nvme*")
        if (p / "subsysnqn").read_text().startswith(NQN_PREFIX)
    ]
    return {
        "netns": netns,
        "representors": reps,
        "subsystems": subsystems,
        "ports": ports,
        "nbd": nbd,
        "nvme": nvme,
    }


EMPTY: dict[str, list[str]] = {
    key: [] for key in ("netns", "representors", "subsystems", "ports", "nbd", "nvme")
}


@pytest.fixture(scope="module")
def dpu_side() -> Iterator[str]:
    """The DPU namespace; skips where tc flower cannot run. Everything of ours goes after."""
    reason = flower_unusable()
    if reason is not None:
        pytest.skip(reason)
    if DPU in sh("ip", "netns", "list").stdout.split():
        pytest.fail(f"network namespace {DPU} exists already; remove it (ip netns del {DPU})")
    sh("ip", "netns", "add", DPU)
    sh("ip", "-n", DPU, "link", "set", "lo", "up")
    try:
        yield DPU
    finally:
        for ns in sh("ip", "netns", "list").stdout.split():
            if ns.startswith(PREFIX) or ns == DPU:
                sh("ip", "netns", "del", ns, check=False)


def remove_functions() -> None:
    """Delete every function namespace and representor (what a failed test may leave)."""
    for ns in sh("ip", "netns", "list").stdout.split():
        if ns.startswith(PREFIX):
            sh("ip", "netns", "del", ns, check=False)
    if DPU in sh("ip", "netns", "list").stdout.split():
        for link in json.loads(sh("ip", "-n", DPU, "-j", "link", "show").stdout or "[]"):
            if link["ifname"].startswith("pf0"):
                sh("ip", "-n", DPU, "link", "del", link["ifname"], check=False)


@pytest.fixture
def clean_kernel(dpu_side: str) -> Iterator[str]:
    """The DPU namespace, with no function left in the kernel before and after the test."""
    remove_functions()
    try:
        yield dpu_side
    finally:
        remove_functions()


@pytest.fixture(scope="session")
def block_ready() -> None:
    """Skip (with the reason) without NBD, the NVMe target over RDMA, or root."""
    if os.geteuid() != 0:
        pytest.skip("block functions need root (NBD ioctls, configfs)")
    if not Path("/sys/block/nbd0").exists():
        pytest.skip("no /dev/nbd0: the nbd module is not loaded (the test VM loads it)")
    if not NVMET.is_dir() or not Path("/dev/nvme-fabrics").exists():
        pytest.skip("no nvmet configfs or /dev/nvme-fabrics: load nvmet-rdma and nvme-rdma")
    if not Path("/sys/class/infiniband").is_dir() or not any(
        Path("/sys/class/infiniband").iterdir()
    ):
        pytest.skip("no RDMA device for NVMe-oF over RDMA; run it in the test VM")
