"""A session streaming a long job does not stall the agent's other work (tcp and verbs).

Session A runs one long copy in 4 KiB chunks: a chain of thousands of RDMA
operations, each posted when the previous one completes. While it runs, session B's
small copies, a SubmitJob on A's own session and a control-plane call must all be
answered. Each is checked against A's job still running (an order, not a time): a
link poll that kept taking the chain's completions would hold the reactor until A's
job ended, and everything else would finish after it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import host_client
from tests.integration.conftest import start_agent

if TYPE_CHECKING:
    from pathlib import Path

LONG_COPY = 64 << 20  # 16384 chunks of 4 KiB: seconds on any machine
SMALL_JOBS = 20


async def others_progress_while_a_session_streams(
    tmp_path: Path, transport: str, env: dict[str, str], device: str | None = None
) -> None:
    """Run the scenario (module doc)."""
    agent = start_agent(tmp_path, env={**env, "DPU_AGENT_CHUNK_SIZE": "4096"})
    try:
        async with host_client.Client(agent.address, timeout=120) as client:
            busy = await client.open_session(transport=transport, queue_depth=4, rdma_device=device)
            other = await client.open_session(
                transport=transport, queue_depth=4, rdma_device=device
            )
            src = await busy.alloc(LONG_COPY, readable=True)
            dst = await busy.alloc(LONG_COPY, writable=True)
            crc_src = await busy.alloc(4096, readable=True)
            small_src = await other.alloc(4096, readable=True)
            small_dst = await other.alloc(4096, writable=True)
            long_job = await busy.submit_copy(src, dst)

            for index in range(SMALL_JOBS):
                completion = await (await other.submit_copy(small_src, small_dst))
                assert completion.bytes_written == 4096
                assert not long_job.done(), f"session B's job {index} waited for A's long job"
            rpc_job = await busy.submit_rpc("crc32c", crc_src)
            assert not long_job.done(), "SubmitJob on the busy session waited for its long job"
            assert len(await client.list_sessions()) >= 2
            assert not long_job.done(), "a control-plane call waited for the long job"

            assert (await long_job).bytes_written == LONG_COPY
            await rpc_job
            await other.close()
            await busy.close()
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()
