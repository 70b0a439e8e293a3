"""Inline sources (docs/data-plane.md 2.8) through the SDK and a real agent over tcp.

The SDK sends a source that fits the session's `inline_max` inside the SUBMIT, from
the buffer's memory; the agent then sends no READ for it. Larger sources, and every
source with `open_session(inline=False)`, are READ as before.
"""

import os

import crc32c
import pytest

import host_client
from dpu_wire.transport.tcp import TcpHostLink
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio


def _reads(session: host_client.Session) -> int:
    link = session._link  # the tcp host link counts the READs it served
    assert isinstance(link, TcpHostLink)
    return link.reads_served


async def test_small_sources_go_inline_and_large_ones_are_read(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp", queue_depth=4) as session,
    ):
        assert session.inline_max == 4096
        data = os.urandom(8192)
        buf = await session.alloc(8192, readable=True, writable=True)
        buf.view[:] = data
        small, large = buf[0:4096], buf
        assert await session.crc32c(small) == crc32c.crc32c(data[:4096])
        await client.create_volume("inline", 1 << 20)
        await session.write_volume("volumes/inline", 4096, small, fua=True)
        await session.write_volume("volumes/inline", 8192, buf[4096:8192])  # batched, not FUA
        assert _reads(session) == 0, "an inline source was READ"
        assert await session.crc32c(large) == crc32c.crc32c(data)
        assert _reads(session) == 1
        out = await session.alloc(4096, writable=True)
        await session.read_volume("volumes/inline", 4096, out)
        assert bytes(out.view) == data[:4096]
        await session.read_volume("volumes/inline", 8192, out)
        assert bytes(out.view) == data[4096:]


async def test_inline_off_reads_every_source(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp", inline=False) as session,
    ):
        assert session.inline_max == 0
        buf = await session.alloc(512, readable=True)
        buf.view[:] = b"x" * 512
        assert await session.crc32c(buf) == crc32c.crc32c(b"x" * 512)
        assert _reads(session) == 1


async def test_an_agent_that_offers_no_inline_gets_none(tmp_path):
    agent = start_agent(tmp_path, env={"DPU_AGENT_INLINE_MAX": "0"})
    try:
        async with (
            host_client.Client(agent.address) as client,
            await client.open_session(transport="tcp") as session,
        ):
            assert session.inline_max == 0
            buf = await session.alloc(64, readable=True)
            buf.view[:] = bytes(range(64))
            assert await session.crc32c(buf) == crc32c.crc32c(bytes(range(64)))
            assert _reads(session) == 1
    finally:
        assert agent.terminate() == 0
