"""The SDK session when its data plane fails while a SubmitJob call is being answered.

Found by tests/faults/test_agent_sigkill.py: the agent answered SubmitJob and was then
killed; the watch stream's failure failed every pending job *before* the reply was
handled, so the new job's completion future was registered afterwards and never
resolved. The session layer is tested here with a stand-in `Rpc` whose SubmitJob
fails the session before it answers.
"""

import asyncio
import types

import pytest

from dpu_wire.transport.tcp import TcpHostLink
from dpu_wire.v1 import job_pb2
from host_client import UnavailableError
from host_client._session import Session

pytestmark = pytest.mark.asyncio

QUEUE_DEPTH = 4


class _RpcFailingDuringSubmit:
    """Answers SubmitJob, but only after the session's data plane has failed."""

    def __init__(self) -> None:
        self.session: Session | None = None
        self.stubs = types.SimpleNamespace(jobs=types.SimpleNamespace(SubmitJob=object()))

    async def call(self, _method, _request, **_kwargs):
        assert self.session is not None
        self.session._on_failure(UnavailableError("UNAVAILABLE", "watch stream lost"))
        return job_pb2.Job(job_id=(1 << 63) + 1)


async def test_a_job_answered_after_the_session_failed_fails_too():
    rpc = _RpcFailingDuringSubmit()
    transport = TcpHostLink()
    session = Session(rpc, transport, QUEUE_DEPTH)  # type: ignore[arg-type]
    rpc.session = session
    try:
        spec = job_pb2.JobSpec()
        spec.crc32c.source.region = "sessions/s-1/regions/r1"
        job = await session.submit_spec(spec)

        async def outcome():
            return await job

        with pytest.raises(UnavailableError, match="watch stream lost"):
            await asyncio.wait_for(outcome(), 5)
        assert session.failed
        assert session._credits.free == QUEUE_DEPTH, "the job's queue credit leaked"
    finally:
        await transport.close()
