"""Where the agent aims its queue pair, over rxe (data-plane.md 1.2, DP-1.2-3..6).

An outside audit found that an OpenSession whose `host_endpoint.verbs.gid` names an
address nobody answers ARP for stopped the whole agent for about a second (the RDMA
core resolves the MAC inside modify-QP to RTR, and pyverbs keeps the GIL): four in a
row cost 4.6 s in which another tenant's jobs and every RPC waited, and a multicast GID
was accepted. Here, against an agent process on rxe0 with a host on rxe1:

- a multicast GID, IPv4-mapped or not, is refused INVALID_ARGUMENT;
- GIDs of addresses nobody holds are refused UNAVAILABLE, all with one message;
- while three of those wait for ARP answers, a session's jobs complete and
  ListSessions answers, again and again; the session works before and after.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os

import grpc
import pytest

import host_client
from dpu_wire.v1 import agent_pb2, session_pb2, session_pb2_grpc
from tests.integration.conftest import start_agent

pytestmark = [pytest.mark.rdma, pytest.mark.asyncio]


def _mapped(ip: ipaddress.IPv4Address | str) -> bytes:
    return ipaddress.IPv6Address(f"::ffff:{ip}").packed


def _silent(host_gid: str, count: int) -> list[bytes]:
    """GIDs of addresses in the host's /24 that nobody holds (from .254 down)."""
    own = ipaddress.IPv6Address(host_gid).ipv4_mapped
    assert own is not None
    last = [n for n in range(254, 200, -1) if n != own.packed[3]]
    return [_mapped(ipaddress.IPv4Address(own.packed[:3] + bytes([n]))) for n in last[:count]]


def _request(gid: bytes) -> session_pb2.OpenSessionRequest:
    endpoint = session_pb2.VerbsEndpoint(gid=gid, qp_num=0x55, psn=1, mtu=1024)
    return session_pb2.OpenSessionRequest(
        request_id=os.urandom(8).hex(),
        transport=agent_pb2.TRANSPORT_VERBS,
        queue_depth=1,
        client_label="nobody-there",
        host_endpoint=session_pb2.Endpoint(verbs=endpoint),
    )


async def _open(stub: session_pb2_grpc.SessionServiceAsyncStub, gid: bytes) -> grpc.aio.AioRpcError:
    try:
        await stub.OpenSession(_request(gid), timeout=60)
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError(f"a session was opened towards {ipaddress.IPv6Address(gid)}")


async def test_a_host_nobody_answers_for_holds_up_nobody_else(rdma_port, host_port, tmp_path):
    env = {"DPU_AGENT_TRANSPORTS": "verbs", "DPU_AGENT_RDMA_DEVICE": rdma_port.device}
    agent = start_agent(tmp_path, env=env)
    try:
        async with (
            grpc.aio.insecure_channel(agent.address) as channel,
            host_client.Client(agent.address, timeout=60) as client,
        ):
            stub = session_pb2_grpc.SessionServiceStub(channel)
            listing = session_pb2.ListSessionsRequest(page_size=100)
            async with await client.open_session(
                transport="verbs", queue_depth=4, rdma_device=host_port.device
            ) as session:
                src = await session.alloc(4096, readable=True)
                dst = await session.alloc(4096, writable=True)
                src.view[:] = os.urandom(4096)
                await session.copy(src, dst)
                assert dst.view == src.view

                for multicast in (ipaddress.IPv6Address("ff02::1").packed, _mapped("224.0.0.1")):
                    refused = await _open(stub, multicast)
                    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused

                opens = [
                    asyncio.ensure_future(_open(stub, gid)) for gid in _silent(host_port.gid, 3)
                ]
                rounds = 0  # a copy done and ListSessions answered, every open still waiting
                try:
                    while not any(task.done() for task in opens):
                        dst.view[:] = bytes(4096)
                        await session.copy(src, dst)
                        assert dst.view == src.view
                        await stub.ListSessions(listing, timeout=60)
                        rounds += not any(task.done() for task in opens)
                finally:
                    errors = await asyncio.gather(*opens)
                assert {e.code() for e in errors} == {grpc.StatusCode.UNAVAILABLE}, errors
                assert len({e.details() for e in errors}) == 1, [e.details() for e in errors]
                print(  # noqa: T201 - what the report quotes
                    f"\n{rounds} copies and ListSessions while 3 OpenSessions waited for ARP; "
                    f"they ended {errors[0].code().name}: {errors[0].details()!r}"
                )
                assert rounds >= 3, f"only {rounds} copies while the OpenSessions waited"

                listed = await stub.ListSessions(listing, timeout=60)
                assert [s.name for s in listed.sessions] == [session.name]  # nothing left
                await session.copy(src, dst)
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()
