"""Faults and load over verbs on rxe0 (the soft-RoCE VM): agent and hosts as processes.

- the host's queue pair forced into the error state with jobs in flight: they fail
  with UnavailableError, the agent reports the session failed, a new session works;
- the agent SIGKILLed with volume writes in flight (tests/faults/inflight_writes.py), and
  again and again while hosts overwrite volumes (tests/torture/agent_kills.py);
- the host program SIGKILLed (tests/faults/client_death.py): over verbs an idle
  session's data plane cannot tell the host is gone, so the orphan timeout closes it;
- load: 4 clients (2 processes x 2) x 200 mixed jobs, every byte checked, memory flat.
"""

from __future__ import annotations

import asyncio
import os

import crc32c
import pytest

import host_client
from dpu_wire.v1 import session_pb2
from tests.faults import client_death, inflight_writes, load
from tests.faults.common import metric, scrape, session_state, until
from tests.integration.conftest import start_agent
from tests.integration.mqtt_broker import free_port
from tests.torture import agent_kills

pytestmark = [pytest.mark.rdma, pytest.mark.asyncio]

MiB = 1 << 20
FAILED = session_pb2.SESSION_STATE_FAILED
VM_KILLS = 5  # the host suite kills 24 times over tcp; the VM runs Python ~7x slower


def _verbs_env(rdma_port) -> dict[str, str]:
    return {"DPU_AGENT_TRANSPORTS": "verbs", "DPU_AGENT_RDMA_DEVICE": rdma_port.device}


def _force_error_state(session: host_client.Session) -> None:
    """Move the host side's RC queue pair to IBV_QPS_ERR, as a fatal local error would."""
    import pyverbs.enums as e  # noqa: PLC0415 - only in the VM
    from pyverbs.qp import QPAttr  # noqa: PLC0415

    qp = session._link._qp._qp  # type: ignore[attr-defined]  # the pyverbs QP
    attr = QPAttr()
    attr.qp_state = e.IBV_QPS_ERR
    qp.modify(attr, e.IBV_QP_STATE)


async def _outcome(job: host_client.Job) -> object:
    try:
        return await job
    except host_client.DpuError as exc:
        return exc


async def test_qp_forced_to_error_fails_pending_jobs_and_a_new_session_works(
    rdma_port, host_port, tmp_path
):
    metrics_address = f"127.0.0.1:{free_port()}"
    env = {
        **_verbs_env(rdma_port),
        "DPU_AGENT_CHUNK_SIZE": "4096",  # slow copies, one at a time: in flight when the
        "DPU_AGENT_STAGING_BUFFERS": "1",  # QP breaks
        "DPU_AGENT_METRICS_LISTEN": metrics_address,
    }
    agent = start_agent(tmp_path, env=env)
    try:
        async with host_client.Client(agent.address, timeout=60) as client:
            async with await client.open_session(
                transport="verbs", queue_depth=8, rdma_device=host_port.device
            ) as session:
                src = await session.alloc(32 * MiB, readable=True)  # 8,192 chunks a job
                dst = await session.alloc(32 * MiB, writable=True)
                jobs = [await session.submit_copy(src, dst) for _ in range(6)]
                jobs += [await session.submit_rpc("copy", src, dst) for _ in range(2)]
                pending = [job for job in jobs if not job.done()]
                assert pending, "every job finished before the QP broke: make them slower"
                _force_error_state(session)

                outcomes = await asyncio.wait_for(asyncio.gather(*map(_outcome, pending)), 120)
                for outcome in outcomes:
                    assert isinstance(outcome, host_client.UnavailableError), outcome
                assert session.failed
                with pytest.raises(host_client.UnavailableError):
                    await session.submit_copy(src, dst)

                # the agent finds out on its next RDMA operation (retries exhausted), fails
                # the session, and closes it once nobody watches it
                seen: set[int | None] = set()

                async def agent_gave_up() -> bool:
                    seen.add(await session_state(client, session.name))
                    return None in seen

                await until(agent_gave_up, "the agent to fail and close the session", 120)
                samples = scrape(metrics_address)
                assert metric(samples, "dpu_agent_dataplane_errors_total", transport="verbs") == 1
                assert metric(samples, "dpu_agent_sessions_closed_total", reason="failed") == 1
                assert metric(samples, "dpu_agent_jobs_in_flight") == 0
                assert metric(samples, "dpu_agent_dataplane_links") == 0
                failures = [
                    entry
                    for entry in agent.log_entries()
                    if entry.get("msg") == "session failed" and entry.get("session") == session.name
                ]
                assert failures, "the agent did not log the session's failure"
                print(  # noqa: T201 - what the report quotes
                    f"\nstates seen while polling: {sorted(s or 0 for s in seen)} "
                    f"(FAILED={FAILED}); agent said: {failures[0].get('error')}"
                )

            async with await client.open_session(
                transport="verbs", queue_depth=8, rdma_device=host_port.device
            ) as fresh:
                src = await fresh.alloc(MiB, readable=True)
                dst = await fresh.alloc(MiB, writable=True)
                data = os.urandom(MiB)
                src.view[:] = data
                await fresh.copy(src, dst)
                assert dst.view == data
                assert await fresh.crc32c(src) == crc32c.crc32c(data)
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()


async def test_agent_sigkill_loses_no_acknowledged_write_over_rxe(rdma_port, tmp_path):
    ledger = await inflight_writes.acknowledged_writes_survive(
        tmp_path, "verbs", _verbs_env(rdma_port)
    )
    assert ledger.acknowledged >= inflight_writes.KILL_AFTER


async def test_overwrites_survive_repeated_sigkills_over_rxe(rdma_port, tmp_path):
    summary = await agent_kills.overwrites_survive_kills(
        tmp_path, "verbs", _verbs_env(rdma_port), VM_KILLS
    )
    print(f"\n{summary.line()}")  # noqa: T201 - the numbers the report quotes
    assert summary.kills == VM_KILLS
    assert summary.in_doubt_at_kills > 0
    assert summary.violations == [], "\n".join(summary.violations[:40])


async def test_killed_host_sessions_are_freed_over_rxe(rdma_port, host_port, tmp_path):
    closed = await client_death.agent_frees_a_killed_hosts_sessions(
        tmp_path, "verbs", _verbs_env(rdma_port), host_port.device
    )
    # the idle session's data plane cannot tell the host is gone: only the orphan
    # timeout closes it; the busy ones fail on their next RDMA operation (or orphan)
    assert closed["orphaned"] >= 1, closed
    assert closed["closed"] == 0, closed


async def test_4_clients_x_200_mixed_jobs_over_rxe(rdma_port, host_port, tmp_path):
    agent = start_agent(tmp_path, env=_verbs_env(rdma_port))
    try:
        _, full = await load.run(
            agent.address, agent.proc.pid, "verbs", 2, 2, 200, host_port.device
        )
        assert full.totals["jobs"] == 800
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()
