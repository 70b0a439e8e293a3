"""`rtnl.Rtnl.batch` against the host kernel: many requests, one ack, refusals by index.

tc flower is not on the host (tests/vm/network runs the flower batches); bridges are
a request every kernel takes, so they show the socket layer on its own: requests
packed into several datagrams, the kernel carrying on after a refusal, and exactly
the refused requests reported, with the kernel's reason.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
from typing import TYPE_CHECKING

import pytest

from dpu_agent.network import netlink as nl
from dpu_agent.network.rtnl import BATCH_DATAGRAM, Rtnl

if TYPE_CHECKING:
    from collections.abc import Iterator

IFLA_LINKINFO = 18
IFLA_INFO_KIND = 1
BRIDGES = 1200


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"dpu-rtnl-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace: {made.stderr.strip()}")
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def new_bridge(name: str) -> tuple[int, int, bytes]:
    body = nl.IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + nl.string(nl.IFLA_IFNAME, name)
    body += nl.nest(IFLA_LINKINFO, nl.string(IFLA_INFO_KIND, "bridge"))
    return nl.RTM_NEWLINK, nl.NLM_F_REQUEST | nl.NLM_F_CREATE | nl.NLM_F_EXCL, body


def links(netns: str) -> set[str]:
    shown = subprocess.run(
        ["ip", "-n", netns, "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    return {line.split(": ")[1].split("@")[0] for line in shown.splitlines()}


def test_a_batch_reports_exactly_the_refused_requests(netns):
    requests = [new_bridge(f"br{n}") for n in range(BRIDGES)]
    requests[10] = new_bridge("br3")  # exists by then: refused, the rest goes on
    requests[1100] = new_bridge("x" * 20)  # too long a name: refused
    assert sum(len(body) + 16 for _, _, body in requests) > 2 * BATCH_DATAGRAM
    rtnl = Rtnl(netns)
    try:
        refused = rtnl.batch(requests)
        assert sorted(refused) == [10, 1100]
        assert refused[10].code == errno.EEXIST
        assert refused[1100].code == errno.ERANGE
        assert "policy" in refused[1100].message  # the extended ack: the kernel's reason
        made = links(netns)
        assert {f"br{n}" for n in range(BRIDGES) if n not in (10, 1100)} <= made
        assert "br10" not in made
        assert "br1100" not in made
        again = rtnl.batch([new_bridge("br0"), new_bridge("br10")])  # the last one acked
        assert sorted(again) == [0]
        assert "br10" in links(netns)
        assert rtnl.batch([]) == {}
    finally:
        rtnl.close()
