"""Fuzzed capsules on an open tcp data-plane session.

Random bytes, damaged capsules and well-formed ones with random fields (most of them
naming the session's real buffers, volume handles and key). Each capsule of at most
256 bytes gets exactly the answer the protocol promises (see tests/fuzz/capsules.py),
never INTERNAL; the session survives and runs good jobs afterwards. A capsule longer
than 256 bytes ends the session with the reason in the agent's log, and the agent
serves new sessions.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Final

import crc32c
import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

import host_client
from dpu_wire import capsule
from dpu_wire.transport import tcp
from tests.fuzz import capsules
from tests.fuzz.capsules import Target
from tests.fuzz.conftest import check_alive
from tests.fuzz.stats import LARGE_REPRS_OK, PROFILE, STATS

pytestmark = LARGE_REPRS_OK

EXAMPLES: Final = 400
BATCH: Final = 6
BUFFER: Final = 64 * 1024


class CapsuleSession:
    """A session with buffers, two attached volumes and a key, for raw capsules."""

    def __init__(self, session: host_client.Session, buffers: list[host_client.Buffer]) -> None:
        self.session = session
        self.buffers = buffers
        self.target = Target(readable=(), writable=(), volumes=(), keys=())

    async def prepare(self) -> None:
        volumes = [await self.session.attach(f"volumes/fz-vol-{i}") for i in (0, 2, 3)]
        key = await self.session.register_key(os.urandom(32))
        src, dst, both = (b.ref().span() for b in self.buffers)
        self.target = Target(
            readable=(src, both), writable=(dst, both), volumes=tuple(volumes), keys=(key,)
        )

    async def good_jobs(self) -> None:
        """A copy, a CRC32C and a volume round trip must all work."""
        src, dst, both = self.buffers
        data = os.urandom(BUFFER)
        src.view[:] = data
        await self.session.copy(src, dst)
        assert bytes(dst.view) == data
        assert await self.session.crc32c(src) == crc32c.crc32c(data)
        await self.session.write_volume("volumes/fz-vol-2", 0, src)
        both.view[:] = bytes(BUFFER)
        await self.session.read_volume("volumes/fz-vol-2", 0, both)
        assert bytes(both.view) == data


@pytest.fixture(scope="module")
def capsule_session(fuzz_loop, client, world):
    async def open_it() -> CapsuleSession:
        session = await client.open_session(transport="tcp", queue_depth=64, label="capsules")
        buffers = [
            await session.alloc(BUFFER, readable=True),
            await session.alloc(BUFFER, writable=True),
            await session.alloc(BUFFER, readable=True, writable=True),
        ]
        made = CapsuleSession(session, buffers)
        await made.prepare()
        return made

    fuzz_loop.run(world.restore())  # the volumes exist
    made = fuzz_loop.run(open_it())
    yield made
    fuzz_loop.run(made.session.close())


def _fuzz(fuzz_loop, fuzz_agent, capsule_session, strategy, name):
    sent = 0

    @seed(STATS.seed)
    @settings(PROFILE, max_examples=EXAMPLES)
    @given(st.lists(strategy, min_size=BATCH, max_size=BATCH))
    def run(batch):
        nonlocal sent
        session = capsule_session.session
        for capsule_round in capsules.rounds(batch):
            answers = fuzz_loop.run(
                capsules.exchange(session, capsule_round), timeout=capsules.HANG_S * 2
            )
            sent += len(capsule_round)
            for data, done in zip(capsule_round, answers, strict=True):
                STATS.count("capsule", name, "no answer" if done is None else done.code)
                why = capsules.verdict(data, done)
                assert why is None, f"{why} for capsule {data.hex()}"
        check_alive(fuzz_agent)
        assert not session.failed, session.error
        assert session.protocol_errors == 0

    run()
    fuzz_loop.run(capsule_session.good_jobs())
    return sent


def test_structured_capsules(fuzz_loop, fuzz_agent, capsule_session):
    strategy = capsules.structured(capsule_session.target)
    sent = _fuzz(fuzz_loop, fuzz_agent, capsule_session, strategy, capsules.STRUCTURED)
    assert sent >= EXAMPLES * BATCH


def test_random_and_damaged_capsules(fuzz_loop, fuzz_agent, capsule_session):
    strategy = capsules.damaged(capsule_session.target)
    sent = _fuzz(fuzz_loop, fuzz_agent, capsule_session, strategy, capsules.DAMAGED)
    assert sent >= EXAMPLES * BATCH


@pytest.mark.parametrize("over", [1, 4096])
def test_an_oversized_capsule_ends_the_session_and_says_why(fuzz_loop, fuzz_agent, client, over):
    limit = 0

    async def send_oversized() -> tuple[str, bool]:
        nonlocal limit
        async with await client.open_session(transport="tcp", label="oversized") as session:
            # the longest capsule is an INLINE SUBMIT of inline_max bytes (data-plane.md 2.8)
            limit = max(capsule.MAX_CAPSULE, capsule.SUBMIT_SIZE + session.inline_max)
            size = limit + over
            link = session._link  # past the SDK's own size check: a raw CAPSULE frame
            link._stream.queue(tcp.pack(tcp.FrameType.CAPSULE, length=size), bytes(size))
            link._flush()
            for _ in range(200):
                if session.failed:
                    break
                await asyncio.sleep(0.05)
            return session.name, session.failed

    name, failed = fuzz_loop.run(send_oversized())
    assert failed, "the session survived a capsule longer than MAX_CAPSULE"
    reasons = [
        entry.get("error", "")
        for entry in fuzz_agent.log_entries()
        if entry.get("msg") == "session failed" and entry.get("session") == name
    ]
    assert reasons == [f"capsule of {limit + over} bytes exceeds {limit}"], json.dumps(reasons)
    check_alive(fuzz_agent)

    async def fresh_session_works() -> None:
        async with await client.open_session(transport="tcp") as session:
            src = await session.alloc(4096, readable=True)
            src.view[:] = b"x" * 4096
            assert await session.crc32c(src) == crc32c.crc32c(b"x" * 4096)

    fuzz_loop.run(fresh_session_works())
