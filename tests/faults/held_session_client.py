"""A host program the client-death tests SIGKILL: sessions held open, full of work.

    python -m tests.faults.held_session_client ADDRESS TRANSPORT SESSIONS [RDMA_DEVICE]

For each of SESSIONS busy sessions it registers `REGIONS` buffers, attaches a volume
and fills the whole queue with slow copies (the agent is started with a tiny chunk
size), half by capsule and half by SubmitJob. One more session only registers its
buffers and stays idle (its data plane silent). Then it prints one JSON line
({"busy": [names], "idle": name, "jobs": N, "done": finished so far}) and waits to be
killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

import host_client

REGIONS = 4
QUEUE_DEPTH = 8
COPY_BYTES = 64 << 20  # at 4 KiB chunks, one buffer a session: seconds a job
VOLUME = "volumes/held-1"


async def main(address: str, transport: str, count: int, device: str | None) -> None:
    """Open the sessions, queue the work, report, wait forever."""
    async with host_client.Client(address, timeout=60) as client:
        await client.create_volume(VOLUME.removeprefix("volumes/"), 1 << 20, crc32c=True)
        sessions, jobs = [], []
        for _ in range(count):
            session = await client.open_session(
                transport=transport, queue_depth=QUEUE_DEPTH, rdma_device=device
            )
            src = await session.alloc(COPY_BYTES, readable=True)
            dst = await session.alloc(COPY_BYTES, writable=True)
            for _ in range(REGIONS - 2):
                await session.alloc(4096, readable=True, writable=True)
            await session.attach(VOLUME)
            for index in range(QUEUE_DEPTH):
                if index % 2:
                    jobs.append(await session.submit_rpc("copy", src, dst))
                else:
                    jobs.append(await session.submit_copy(src, dst))
            sessions.append(session.name)
        idle = await client.open_session(
            transport=transport, queue_depth=QUEUE_DEPTH, rdma_device=device
        )
        for _ in range(REGIONS):
            await idle.alloc(4096, readable=True, writable=True)
        report = {
            "busy": sessions,
            "idle": idle.name,
            "jobs": len(jobs),
            "done": sum(job.done() for job in jobs),
        }
        print(json.dumps(report), flush=True)  # noqa: T201 - the test reads this line
        await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    )
