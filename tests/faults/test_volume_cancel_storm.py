"""A host that cancels every volume job it sends cannot pile storage calls up in the agent.

A real agent (file store) and a raw tcp host A (tests/conformance/rawtcp.py) that sends,
as fast as its socket takes them, pairs of "trim my whole 1 GiB volume" + CANCEL and
"write these 4 KiB, durably (FUA)" + CANCEL. Each job ends CANCELLED at once and frees
its queue slot, but its storage call may not have returned: without a bound every pair
left one more call queued on the agent's storage workers (memory grew ~3.6 KB per pair,
and another session's FUA write waited for the whole backlog, past its 60 s deadline).
Now a session's storage calls count against its queue depth until they return
(data-plane.md 2.6, "Storage calls"), an ended job's call that has not started is
dropped, and the workers serve sessions in turn. So, counted rather than timed:

- the io workers never had more calls waiting than the two sessions' queue depths;
- B's FUA write, issued once A's last capsule was handled, waited for at most A's
  `queue_depth` writes (the store's write counter of A's volume), and succeeded within
  its default deadline;
- the agent's memory did not grow with the number of pairs.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import uuid

import pytest

import host_client
from dpu_wire.v1 import agent_pb2, job_pb2, session_pb2
from tests.conformance import wire
from tests.conformance.rawtcp import RawTcpHost
from tests.faults.common import MiB, rss_bytes
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

GiB = 1 << 30
QD = 8  # A's queue depth
PAIRS = 40_000  # SUBMIT + CANCEL pairs A sends: half trims, half FUA writes
MARKER = 1 << 40  # the job id of the inline CRC-32C A sends last
RSS_GROWTH = 64 * MiB  # the old agent held ~3.6 KB per pair still queued
_COMPLETION_ID = struct.Struct("<8xQ")  # a capsule's job_id


def _pairs(handle: int) -> bytes:
    """8 pairs (one per queue slot: each job ends before the next SUBMIT), repeated."""
    data = bytes(4096)
    pairs = []
    for job_id in range(1, 9):
        if job_id % 2:
            submit = wire.submit(job_id, wire.Kind.VOLUME_TRIM, handle=handle, length=GiB)
        else:
            submit = wire.submit_inline(
                job_id, wire.Kind.VOLUME_WRITE, data, handle=handle, flags=wire.FUA
            )
        pairs.append(wire.capsule_frame(submit) + wire.capsule_frame(wire.cancel(job_id)))
    return b"".join(pairs)


def _storm(sock: socket.socket, handle: int) -> int:
    """Send PAIRS pairs, then an inline CRC (MARKER); read until its COMPLETION came.

    Capsules are handled in order, so once the marker is answered every pair was.
    Returns how many COMPLETIONs came.
    """
    sock.setblocking(True)
    blob = _pairs(handle)
    marker = wire.capsule_frame(wire.submit_inline(MARKER, wire.Kind.CRC32C, b"mark"))
    sent: list[BaseException] = []

    def send() -> None:
        try:
            for _ in range(PAIRS // 8):
                sock.sendall(blob)
            sock.sendall(marker)
        except OSError as exc:
            sent.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    completions = 0
    buffer = bytearray()
    while True:
        chunk = sock.recv(1 << 20)
        assert chunk, f"the agent closed A's connection ({sent})"
        buffer += chunk
        while len(buffer) >= wire.FRAME.size:
            frame = wire.Frame(*wire.FRAME.unpack_from(buffer))
            end = wire.FRAME.size + frame.length
            if len(buffer) < end:
                break
            assert frame.type == wire.Ft.CAPSULE, f"the agent sent {frame}"
            (job_id,) = _COMPLETION_ID.unpack_from(buffer, wire.FRAME.size)
            del buffer[:end]
            completions += 1
            if job_id == MARKER:
                thread.join(30)
                return completions


def _writes_of(metrics: dict[str, float], volume: str) -> float:
    """The store's write counter of a volume (its label ends with the volume's id)."""
    (value,) = [
        v
        for k, v in metrics.items()
        if k.startswith("dpu_agent_volume_ops_total{") and f'{volume}"' in k and 'op="write"' in k
    ]
    return value


async def test_cancelled_volume_jobs_leave_at_most_queue_depth_storage_calls(tmp_path):
    agent = start_agent(tmp_path, env={"DPU_AGENT_STORAGE_BACKEND": "file"})
    host = RawTcpHost()
    try:
        async with host_client.Client(agent.address, timeout=120) as client:
            await client.create_volume("avol", GiB)
            await client.create_volume("bvol", MiB)
            host.listen()
            opened = await client.stubs.sessions.OpenSession(
                session_pb2.OpenSessionRequest(
                    request_id=uuid.uuid4().hex,
                    transport=agent_pb2.TRANSPORT_TCP,
                    queue_depth=QD,
                    host_endpoint=host.endpoint(),
                )
            )
            await host.connected(opened.agent_endpoint.tcp.token)
            lease = client.stubs.jobs.WatchCompletions(  # a watched session is not orphaned
                job_pb2.WatchCompletionsRequest(session=opened.name, origin=job_pb2.JOB_ORIGIN_RPC)
            )
            await lease.initial_metadata()
            attached = await client.stubs.sessions.AttachVolume(
                session_pb2.AttachVolumeRequest(
                    session=opened.name, volume="volumes/avol", request_id=uuid.uuid4().hex
                )
            )
            host.stop_reading()
            assert host.sock is not None
            before = rss_bytes(agent.proc.pid)

            answered = await asyncio.to_thread(_storm, host.sock, attached.handle)

            grown = rss_bytes(agent.proc.pid) - before
            writes = _writes_of(agent.metrics(), "avol")
            async with await client.open_session(transport="tcp", queue_depth=1) as b:
                data = await b.alloc(4096, readable=True)
                data.view[:] = bytes(range(256)) * 16
                await b.write_volume("volumes/bvol", 0, data, fua=True)  # default deadline
            metrics = agent.metrics()
            waited_for = _writes_of(metrics, "avol") - writes
            lease.cancel()

        assert answered == PAIRS + 1  # one COMPLETION per SUBMIT, none per CANCEL
        assert waited_for <= QD, f"B's write waited for {waited_for:.0f} of A's writes"
        assert metrics['dpu_agent_dataplane_offload_waiting_peak{pool="io"}'] <= QD + 1
        assert grown < RSS_GROWTH, f"the agent grew {grown / MiB:.0f} MiB"
    finally:
        await host.close()
        assert agent.terminate() == 0, agent.log_path.read_text()
