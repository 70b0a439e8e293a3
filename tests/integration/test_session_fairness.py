"""One client cannot take every session slot, with the agent's default settings.

Issue 14: a client that opened 64 sessions and never watched them kept everyone else
out, and took the slots again as they expired. Here a greedy client opens sessions
over its own gRPC connection (raw stubs, never a WatchCompletions stream) until the
agent refuses; then the same tenant over another connection, another tenant, and a
second greedy connection all still get sessions that work, and the greedy sessions
are gone within `first_watch_timeout` while the watched ones stay. Real agent process,
real mTLS gRPC, real tcp data planes.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import crc32c
import grpc
import pytest

import host_client
from dpu_agent.config import AgentConfig
from dpu_wire import endpoints
from dpu_wire.transport.tcp import TcpHostLink
from dpu_wire.v1 import agent_pb2, session_pb2, session_pb2_grpc
from tests.integration.conftest import start_agent
from tests.integration.pki import LabPki, make_pki

if TYPE_CHECKING:
    from tests.integration.conftest import AgentProcess

# the defaults (test_the_defaults_are_these ties them to AgentConfig)
MAX_SESSIONS, PER_CONNECTION, PER_TENANT, FIRST_WATCH_TIMEOUT = 64, 8, 16, 5.0
ATTEMPTS = MAX_SESSIONS + 6  # before the fix the greedy client got every one of the 64


class Greedy:
    """Opens sessions over a gRPC connection of its own and never watches them."""

    def __init__(self, agent: AgentProcess, pki: LabPki, tenant: str) -> None:
        tls = pki.client(tenant)
        assert tls.cert is not None
        assert tls.key is not None
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.ca.read_bytes(),
            private_key=tls.key.read_bytes(),  # type: ignore[union-attr]
            certificate_chain=tls.cert.read_bytes(),  # type: ignore[union-attr]
        )
        # a local subchannel pool: this channel's connection is its own
        self.channel = grpc.aio.secure_channel(
            agent.address, credentials, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.stub = session_pb2_grpc.SessionServiceStub(self.channel)
        self.hosts: list[TcpHostLink] = []

    async def open(self) -> str:
        host = TcpHostLink("127.0.0.1")
        host.listen()
        self.hosts.append(host)
        request = session_pb2.OpenSessionRequest(
            transport=agent_pb2.TRANSPORT_TCP,
            queue_depth=1,
            client_label="greedy",
            host_endpoint=endpoints.to_proto(host.address),
        )
        reply = await self.stub.OpenSession(request, timeout=30)
        await host.connect(endpoints.from_proto(reply.agent_endpoint))
        return reply.name

    async def grab(self, attempts: int) -> tuple[list[str], grpc.aio.AioRpcError | None]:
        """Open sessions until the agent refuses one; (the names, the refusal)."""
        names = []
        for _ in range(attempts):
            try:
                names.append(await self.open())
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                return names, exc
        return names, None

    async def close(self) -> None:
        await self.channel.close(None)
        for host in self.hosts:
            await host.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> LabPki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def agent(tmp_path, pki):
    process = start_agent(tmp_path, pki=pki, env={"DPU_AGENT_TRANSPORTS": "tcp"})
    yield process
    assert process.terminate() == 0, process.log_path.read_text()


async def works(client: host_client.Client) -> host_client.Session:
    """A new session of `client` that runs a job."""
    session = await client.open_session(transport="tcp", queue_depth=4)
    buffer = await session.alloc(4096, readable=True)
    buffer.view[:] = b"f" * 4096
    assert await session.crc32c(buffer) == crc32c.crc32c(b"f" * 4096)
    return session


def test_the_defaults_are_these():
    defaults = AgentConfig()
    assert defaults.max_sessions == MAX_SESSIONS
    assert defaults.max_sessions_per_connection == PER_CONNECTION
    assert defaults.quota_max_sessions == PER_TENANT
    assert defaults.first_watch_timeout == FIRST_WATCH_TIMEOUT


@pytest.mark.asyncio
async def test_a_greedy_client_cannot_keep_its_tenant_or_others_out(agent, pki):
    greedy = Greedy(agent, pki, "tenant-a")
    second = Greedy(agent, pki, "tenant-a")
    try:
        taken, refused = await greedy.grab(ATTEMPTS)
        assert refused is not None, f"the greedy connection took {len(taken)} sessions"
        assert len(taken) == PER_CONNECTION
        assert "max_sessions_per_connection" in (refused.details() or "")

        tls = pki.client
        async with (
            host_client.Client(agent.address, tls=tls("tenant-a")) as same_tenant,
            host_client.Client(agent.address, tls=tls("tenant-b")) as other_tenant,
            host_client.Client(agent.address, tls=tls("ops", admin=True)) as admin,
        ):
            kept = [await works(same_tenant), await works(other_tenant)]

            # a second greedy connection of the tenant: stopped by the tenant's quota
            more, refused = await second.grab(ATTEMPTS)
            assert refused is not None
            assert "quota.max_sessions" in (refused.details() or "")
            assert len(taken) + len(more) + 1 == PER_TENANT
            kept.append(await works(other_tenant))  # still room for everyone else

            # sessions nobody ever watched end after first_watch_timeout; watched ones stay
            async def greedy_ones() -> set[str]:
                names = {s.name for s in await admin.list_sessions()}
                return names & {*taken, *more}

            async with asyncio.timeout(FIRST_WATCH_TIMEOUT + 10):
                while await greedy_ones():  # noqa: ASYNC110 - polling the agent
                    await asyncio.sleep(0.2)
            for session in kept:
                got = await admin.get_session(session.name)
                assert got.state == session_pb2.SESSION_STATE_ACTIVE
                assert not session.failed
            again, _ = await greedy.grab(1)  # the greedy client may come back, within bounds
            assert len(again) == 1
            for session in kept:
                await session.close()
    finally:
        await greedy.close()
        await second.close()
