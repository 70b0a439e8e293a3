"""Bad capsules on a live session: each gets an error completion, the session survives.

Shared by the tcp (host) and verbs (VM) suites: the agent must refuse every one of
these before posting any RDMA operation (on verbs a refused access would kill the QP).
"""

from __future__ import annotations

import asyncio
import os
import struct
from typing import TYPE_CHECKING

from dpu_wire import capsule
from dpu_wire.capsule import JobKind, Span

if TYPE_CHECKING:
    import host_client


async def raw_submit(session: host_client.Session, data: bytes) -> host_client.Completion:
    """Send raw capsule bytes on the session's data plane; return the answer."""
    job_id = struct.unpack_from("<Q", data, 8)[0] if len(data) >= 16 else 0
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    session._pending[job_id] = (future, False)
    await session._credits.take()
    session._link.send([data])
    return await asyncio.wait_for(future, 30)


async def run(client: host_client.Client, transport: str) -> None:
    """Send each bad capsule, check its error completion, then run a good job."""
    async with await client.open_session(transport=transport, queue_depth=4) as session:
        src = await session.alloc(8192, readable=True)
        dst = await session.alloc(8192, writable=True)
        s, d = src.ref().span(), dst.ref().span()
        good = capsule.Submit(100, JobKind.COPY, s, d).encode()
        invalid = "INVALID_ARGUMENT"
        cases = {
            "short": (good[:40], invalid, "header says 80 bytes but the capsule has 40"),
            "version": (good[:2] + b"\x09" + good[3:], invalid, "version 9"),
            "kind": (good[:16] + b"\x63\x00" + good[18:], invalid, "kind 99"),
            "out of bounds": (
                capsule.Submit(101, JobKind.COPY, Span(s.addr + 4096, 8192, s.rkey), d).encode(),
                invalid,
                "outside region",
            ),
            "wrong rkey": (
                capsule.Submit(102, JobKind.CRC32C, Span(s.addr, 16, 0xDEAD)).encode(),
                invalid,
                "no region with rkey",
            ),
            "length overflow": (
                capsule.Submit(
                    103, JobKind.CRC32C, Span(capsule.U64_MAX - 8, 4096, s.rkey)
                ).encode(),
                invalid,
                "overflows 64 bits",
            ),
            "write to read-only": (
                capsule.Submit(104, JobKind.COPY, s, s).encode(),
                "PERMISSION_DENIED",
                "does not grant REMOTE_WRITE",
            ),
            "agent's id space": (
                capsule.Submit(1 << 63, JobKind.CRC32C, s).encode(),
                invalid,
                "2**63",
            ),
        }
        for name, (data, code, fragment) in cases.items():
            done = await raw_submit(session, data)
            assert (done.state, done.code) == ("FAILED", code), name
            assert fragment in done.message, (name, done.message)
        src.view[:] = os.urandom(8192)
        await session.copy(src, dst)
        assert dst.view == src.view
