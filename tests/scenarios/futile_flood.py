"""A tenant floods its data plane with capsules that run no job: shared by the tcp and
verbs suites.

The flooder sends three seconds' worth of its allowance (`[dataplane] refusals_per_s`)
of SUBMITs that fail at admission (an unknown rkey), far beyond its credits, in one go
(on verbs the SDK's send ring lets them out as the agent's RECVs take them). The agent
must answer each (data-plane.md 2.5), a second's worth at once and the rest no faster
than the allowance, count the pauses against the flooder only, and run another tenant's
jobs meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING

import host_client
from dpu_wire import capsule
from dpu_wire.capsule import Span
from dpu_wire.jobkinds import JobKind
from tests.integration.conftest import start_agent, tokens_file

if TYPE_CHECKING:
    from pathlib import Path

RATE = 200  # the agent's allowance: futile capsules a tenant may send a second
FLOOD = 3 * RATE
PAUSES = "dpu_agent_dataplane_tenant_pauses_total"


async def run(tmp_path: Path, transport: str, env: dict[str, str]) -> None:
    """Start an agent with two tenants (`env` added), flood as one, work as the other."""
    path, tokens = tokens_file(tmp_path, "flooder", "victim")
    agent = start_agent(
        tmp_path,
        env={
            "DPU_AGENT_AUTH_TOKENS_FILE": str(path),
            "DPU_AGENT_REFUSALS_PER_S": str(RATE),
            **env,
        },
    )
    try:
        async with (
            host_client.Client(agent.address, token=tokens["flooder"], timeout=60) as flooder,
            await flooder.open_session(transport=transport, queue_depth=4) as flooding,
            host_client.Client(agent.address, token=tokens["victim"], timeout=60) as victim,
            await victim.open_session(transport=transport, queue_depth=1) as working,
        ):
            src = await flooding.alloc(4096, readable=True)
            unknown_rkey = Span(src.ref().span().addr, 4096, 0xDEAD)
            loop = asyncio.get_running_loop()
            answers = []
            for job_id in range(1, FLOOD + 1):
                future = loop.create_future()
                flooding._pending[job_id] = (future, False)  # as a raw host would
                answers.append(future)
            start = time.monotonic()
            flooding._link.send(  # far beyond its credits, at once
                [capsule.pack_submit(i, JobKind.CRC32C, unknown_rkey) for i in range(1, FLOOD + 1)]
            )
            copies = asyncio.create_task(_copies(working, answers))
            done = await asyncio.wait_for(asyncio.gather(*answers), 120)
            elapsed = time.monotonic() - start
            copied = await copies
        assert {(d.state, d.code) for d in done} == {("FAILED", "INVALID_ARGUMENT")}
        assert [d.job_id for d in done] == list(range(1, FLOOD + 1))
        metrics = agent.metrics()
        assert metrics.get(f'{PAUSES}{{tenant="flooder"}}', 0) >= 1, metrics
        assert f'{PAUSES}{{tenant="victim"}}' not in metrics
        # a second's worth at once, the rest no faster than RATE (slower is allowed)
        assert elapsed >= (FLOOD - RATE) / RATE * 0.9, elapsed
        assert copied >= 1  # the victim's jobs ran while the flooder waited
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()


async def _copies(session: host_client.Session, flood: list[asyncio.Future[object]]) -> int:
    """4 KiB copies, each checked, until the flood is all answered; how many ran."""
    src = await session.alloc(4096, readable=True)
    dst = await session.alloc(4096, writable=True)
    count = 0
    while not all(f.done() for f in flood):
        src.view[:] = os.urandom(4096)
        (await session.copy(src, dst)).raise_for_status()
        assert dst.view == src.view
        count += 1
    return count
