"""Fixtures for the suite that runs inside the soft-RoCE test VM (deploy/testvm).

Run it with::

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m pytest tests/vm

Outside the VM (no $DPU_TESTVM) these suites are not run: they need rxe0, tc flower,
nbd and nvmet, which the VM provides. They are deselected, and one line at the end of
the run says so and how to run them (`make test-vm`); set DPU_TEST_VM_SUITES=1 to run
them on a host that has all of that. Inside the VM a test whose kernel facility is
missing skips with the reason, and deploy/testvm/check_junit.py turns any skip into a
failure of the VM run.
"""

from __future__ import annotations

import ipaddress
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PREFERRED_DEVICE = os.environ.get("DPU_TEST_RDMA_DEVICE", "rxe0")  # the agent's node
# The host's node: the VM's rxe1 on veth1 (deploy/testvm/vmguest.py); unset, the agent's.
HOST_DEVICE = os.environ.get("DPU_TEST_HOST_RDMA_DEVICE", "")
PORT = 1
HOW_TO_RUN = "run it in the soft-RoCE VM: python3 deploy/testvm/testvm.py run -- ..."


RUN_HERE_ENV = ("DPU_TESTVM", "DPU_TEST_VM_SUITES")  # either set to 1: collect and run
SUITE_DIR = Path(__file__).parent
_NOT_RUN = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "rdma: needs an RDMA device (runs in the soft-RoCE test VM)")


def _run_here() -> bool:
    return any(os.environ.get(name) == "1" for name in RUN_HERE_ENV)


LAST = SUITE_DIR / "test_container_verbs.py"  # podman and its clean-up processes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Outside the VM: deselect this directory's tests (one summary line, not a skip each).

    In the VM, the containerised agent's test runs last: podman's storage (on the
    guest's tmpfs) and its clean-up processes must not crowd the RDMA tests after it
    (under TCG a long stall exhausts an RC queue pair's retries: 1.9 s, 0.47 s before).
    """
    if _run_here():
        items.sort(key=lambda item: item.path == LAST)  # stable: the rest keep their order
        return
    vm_only = [item for item in items if item.path.is_relative_to(SUITE_DIR)]
    if not vm_only:
        return
    config.hook.pytest_deselected(items=vm_only)
    items[:] = [item for item in items if not item.path.is_relative_to(SUITE_DIR)]
    config.stash[_NOT_RUN] = len(vm_only)


def pytest_report_header() -> str | None:
    """Which machine and which two RDMA nodes the suite runs on (an arm64 guest says so)."""
    if not _run_here():
        return None
    host = HOST_DEVICE or PREFERRED_DEVICE
    return f"rdma nodes: agent {PREFERRED_DEVICE}, host {host}; machine {platform.machine()}"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The one line that says why the VM suites did not run here."""
    not_run = config.stash.get(_NOT_RUN, 0)
    if not_run:
        terminalreporter.write_line(
            f"tests/vm: {not_run} tests deselected: they need the soft-RoCE test VM (rxe0, "
            "tc flower, nbd, nvmet); `make test-vm` runs them there "
            "(DPU_TEST_VM_SUITES=1 runs them on a host that has all of that)"
        )


@dataclass(frozen=True)
class RdmaPort:
    """An ACTIVE RDMA port and the IPv4-mapped RoCEv2 GID to address it with."""

    device: str
    port: int
    gid_index: int
    gid: str


def _device_names() -> list[str]:
    """Names of the RDMA devices, or skip the test with the reason there are none."""
    try:
        import pyverbs.device as d  # noqa: PLC0415 - absent on machines without rdma-core
        from pyverbs.pyverbs_error import PyverbsError  # noqa: PLC0415
    except ImportError as exc:
        pytest.skip(f"pyverbs is not importable ({exc}); needs Debian's python3-pyverbs")
    try:
        devices = d.get_device_list()
    except PyverbsError as exc:
        pytest.skip(f"no RDMA device: get_device_list() failed ({exc}); {HOW_TO_RUN}")
    names = [dev.name.decode() for dev in devices]
    if not names:
        pytest.skip(f"no RDMA device: get_device_list() is empty; {HOW_TO_RUN}")
    return names


def _roce_v2_ipv4_gid(ctx: Any, port: int, table_len: int) -> tuple[int, str] | None:
    """The first GID that is RoCEv2 and IPv4-mapped (::ffff:a.b.c.d), as (index, gid)."""
    import pyverbs.enums as e  # noqa: PLC0415
    from pyverbs.pyverbs_error import PyverbsRDMAError  # noqa: PLC0415

    for index in range(table_len):
        try:
            entry = ctx.query_gid_ex(port, index)
        except PyverbsRDMAError:  # ENODATA: an empty slot
            continue
        if int(entry.gid_type) != int(e.IBV_GID_TYPE_ROCE_V2):
            continue
        gid = str(ctx.query_gid(port, index))
        if ipaddress.IPv6Address(gid).ipv4_mapped is not None:
            return index, gid
    return None


@pytest.fixture(scope="session")
def rdma_port() -> RdmaPort:
    """The agent's RDMA port (rxe0 port 1 in the VM); skips where there is none."""
    names = _device_names()
    return _port_of(PREFERRED_DEVICE if PREFERRED_DEVICE in names else names[0])


@pytest.fixture(scope="session")
def host_port(rdma_port: RdmaPort) -> RdmaPort:
    """The host's RDMA port: rxe1 in the VM, a second node across veth0/veth1.

    Where no second device is named (a machine with one RDMA port), the agent's.
    """
    if not HOST_DEVICE or rdma_port.device == HOST_DEVICE:
        return rdma_port
    if HOST_DEVICE not in _device_names():
        pytest.fail(f"DPU_TEST_HOST_RDMA_DEVICE={HOST_DEVICE} names no RDMA device")
    return _port_of(HOST_DEVICE)


def _port_of(name: str) -> RdmaPort:
    import pyverbs.device as d  # noqa: PLC0415
    import pyverbs.enums as e  # noqa: PLC0415

    with d.Context(name=name) as ctx:
        attr = ctx.query_port(PORT)
        if attr.state != e.IBV_PORT_ACTIVE:
            pytest.fail(f"{name} port {PORT} is not ACTIVE (state {attr.state})")
        found = _roce_v2_ipv4_gid(ctx, PORT, int(attr.gid_tbl_len))
    if found is None:
        pytest.fail(f"{name} port {PORT} has no IPv4-mapped RoCEv2 GID (is its netdev addressed?)")
    index, gid = found
    return RdmaPort(device=name, port=PORT, gid_index=index, gid=gid)


# ------------------------------------------------------------------ the wire was crossed


def _netdev_of(device: str) -> str | None:
    """The netdev an rxe device sits on (from its GID attributes), or None."""
    ndevs = Path(f"/sys/class/infiniband/{device}/ports/{PORT}/gid_attrs/ndevs")
    for entry in sorted(ndevs.glob("*")) if ndevs.is_dir() else []:
        try:
            name = entry.read_text().strip()
        except OSError:  # an empty GID slot
            continue
        if name:
            return name
    return None


def _received(device: str, netdev: str) -> tuple[int, int]:
    """(RoCE packets `device` received, packets its netdev received), counters now."""
    rdma = Path(f"/sys/class/infiniband/{device}/ports/{PORT}/hw_counters/rcvd_pkts")
    net = Path(f"/sys/class/net/{netdev}/statistics/rx_packets")
    return int(rdma.read_text()), int(net.read_text())


def _two_nodes() -> list[tuple[str, str]]:
    """(device, netdev) of the agent's and the host's node when they differ, else []."""
    if not HOST_DEVICE or HOST_DEVICE == PREFERRED_DEVICE:
        return []
    pairs = [(dev, _netdev_of(dev)) for dev in (PREFERRED_DEVICE, HOST_DEVICE)]
    return [(dev, net) for dev, net in pairs if net is not None]


@pytest.fixture(autouse=True)
def rdma_crossed_the_wire() -> Any:
    """Every RoCE packet a node received came over its netdev: no self-loop passed a test.

    With two nodes (the VM: rxe0 on veth0, rxe1 on veth1, routed across the pair), a
    packet one device sends to itself, or that the kernel loops back instead of sending
    across the pair, raises the device's `rcvd_pkts` without its netdev's `rx_packets`.
    """
    nodes = _two_nodes() if _run_here() else []
    before = {dev: _received(dev, net) for dev, net in nodes}
    yield
    for dev, net in nodes:
        rdma, wire = (
            now - then for now, then in zip(_received(dev, net), before[dev], strict=True)
        )
        assert rdma <= wire, (
            f"{dev} received {rdma} RoCE packets during the test but {net} only {wire}: "
            "RDMA traffic did not cross the veth pair (a device talked to itself)"
        )
