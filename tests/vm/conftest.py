"""Fixtures for the suite that runs inside the soft-RoCE test VM (deploy/testvm).

Run it with::

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m pytest tests/vm

Where there is no RDMA device (the host kernel has no rdma_rxe), the tests that need
one are skipped with the reason; deploy/testvm/check_junit.py turns such a skip into a
failure of the VM run.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any

import pytest

PREFERRED_DEVICE = os.environ.get("DPU_TEST_RDMA_DEVICE", "rxe0")
PORT = 1
HOW_TO_RUN = "run it in the soft-RoCE VM: python3 deploy/testvm/testvm.py run -- ..."


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "rdma: needs an RDMA device (runs in the soft-RoCE test VM)")


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
    """The RDMA port to test on (rxe0 port 1 in the VM); skips where there is none."""
    import pyverbs.device as d  # noqa: PLC0415
    import pyverbs.enums as e  # noqa: PLC0415

    names = _device_names()
    name = PREFERRED_DEVICE if PREFERRED_DEVICE in names else names[0]
    with d.Context(name=name) as ctx:
        attr = ctx.query_port(PORT)
        if attr.state != e.IBV_PORT_ACTIVE:
            pytest.fail(f"{name} port {PORT} is not ACTIVE (state {attr.state})")
        found = _roce_v2_ipv4_gid(ctx, PORT, int(attr.gid_tbl_len))
    if found is None:
        pytest.fail(f"{name} port {PORT} has no IPv4-mapped RoCEv2 GID (is its netdev addressed?)")
    index, gid = found
    return RdmaPort(device=name, port=PORT, gid_index=index, gid=gid)
