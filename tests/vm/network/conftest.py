"""Fixtures for the tc flower suite (see topology.py for what they build).

Run it in the test VM (the host kernel has no cls_flower)::

    python3 deploy/testvm/testvm.py run -- .venv/bin/python -m pytest tests/vm/network

Where tc flower is not usable (the host), every test skips with the reason;
deploy/testvm/check_junit.py makes a skip in the VM run a failure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from dpu_agent.network.tc_backend import TcFlowBackend
from tests.vm.network.topology import (
    DPU,
    HOSTS,
    Topology,
    build,
    flower_unusable,
    flush_filters,
    sh,
    teardown,
)

if TYPE_CHECKING:
    from collections.abc import Iterator


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "tc: needs tc flower (runs in the test VM)")


@pytest.fixture(scope="session")
def tc_available() -> None:
    """Skip (with the reason) where clsact + cls_flower cannot be used."""
    reason = flower_unusable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def topology(tc_available: None) -> Iterator[Topology]:  # noqa: ARG001 - skips first
    """dpu + h1..h3 with veth pairs repN <-> hN:eth0; removed after the module."""
    existing = sh("ip", "netns", "list").stdout.split()
    clash = [ns for ns in (DPU, *HOSTS) if ns in existing]
    if clash:
        pytest.fail(f"network namespaces {clash} exist already; remove them (ip netns del NAME)")
    try:
        macs = build()
        yield Topology(dpu=DPU, macs=macs)
    finally:
        teardown()


@pytest.fixture
def backend(topology: Topology) -> Iterator[TcFlowBackend]:
    """A TcFlowBackend on rep* in the dpu namespace; every filter is gone afterwards."""
    flow = TcFlowBackend(("rep*",), netns=topology.dpu)
    try:
        yield flow
    finally:
        flow.close()
        flush_filters()
