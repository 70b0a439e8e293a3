"""Connections to the gRPC port that never speak: bounded in number and in time.

A hostile peer opening TCP connections that never finish the HTTP/2 handshake needs no
credentials. Before `[agent] max_connections` and `handshake_timeout` the agent held
each for gRPC's default 120 s with no limit, until its descriptors ran out and it could
accept no one (an outside attack pass: 20,000 connections, every tenant locked out).
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

import host_client
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

CAP = 8
HANDSHAKE_S = 1.0


def _descriptors(pid: int) -> int:
    return sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1 << 16) == b""  # EOF: the agent closed it
    except ConnectionResetError:
        return True
    except BlockingIOError:
        return False


@pytest.fixture
def capped_agent(tmp_path):
    agent = start_agent(
        tmp_path,
        env={
            "DPU_AGENT_MAX_CONNECTIONS": str(CAP),
            "DPU_AGENT_HANDSHAKE_TIMEOUT": str(HANDSHAKE_S),
        },
    )
    yield agent
    assert agent.terminate() == 0, agent.log_path.read_text()


async def test_silent_connections_are_capped_and_closed(capped_agent):
    host, port = capped_agent.address.rsplit(":", 1)
    pid = capped_agent.proc.pid
    before = _descriptors(pid)
    silent = []
    for _ in range(4 * CAP):
        sock = socket.create_connection((host, int(port)), timeout=5)
        sock.setblocking(False)
        silent.append(sock)
    await asyncio.sleep(0.3)  # the agent's accepts (and closes) happen on its own threads
    held = _descriptors(pid) - before
    assert held <= CAP + 2, f"{held} descriptors for {len(silent)} silent connections"
    refused = sum(_closed_by_peer(s) for s in silent)
    assert refused >= 3 * CAP - 2, f"only {refused} of {len(silent)} closed at accept"

    deadline = time.monotonic() + HANDSHAKE_S + 5
    while time.monotonic() < deadline and not all(_closed_by_peer(s) for s in silent):  # noqa: ASYNC110 - the agent closes them
        await asyncio.sleep(0.1)
    assert all(_closed_by_peer(s) for s in silent), "a silent connection outlived the timeout"
    for sock in silent:
        sock.close()

    async with host_client.Client(capped_agent.address) as client:  # room again
        assert await client.health() == "SERVING"
