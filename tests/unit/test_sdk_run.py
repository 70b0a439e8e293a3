"""`Session.run`: a job awaited alone, its SUBMIT and COMPLETION in one link call when
the link can (`HostLink.call`), the usual way when it cannot.

The session is tested with a stand-in link whose `call` answers as the verbs link's
core does in each case: the fields at once, sent but answered later, or not sent. The
core itself runs over rxe in tests/vm/test_native_verbs.py.
"""

from __future__ import annotations

import asyncio
import types
from typing import TYPE_CHECKING

import pytest

from dpu_wire import capsule
from dpu_wire.capsule import FLAG_INLINE, Span
from dpu_wire.jobkinds import JobKind
from dpu_wire.transport.base import Access, HostLink, PeerAddress, Region, TransportError
from host_client import JobRequest, UnavailableError
from host_client._session import RUN_TURNS, Session

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from dpu_wire.capsule import CompletionFields
    from dpu_wire.transport.base import OutCapsule

pytestmark = pytest.mark.asyncio

QUEUE_DEPTH = 4
REQUEST = JobRequest(JobKind.CRC32C, Span(0x1000, 4096, 7))


def _fields(job_id: int, result: int = 0xABCD) -> CompletionFields:
    return (job_id, 3, 0, 4096, 0, result, 1, 2, 3, "")


class _Link(HostLink):
    """Answers `call` with `mode`: "fields", "later" (True, then the COMPLETION on the
    loop), "unsent" (False: the session sends it) or "fail" (TransportError)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls: list[tuple[OutCapsule, int]] = []
        self.sent: list[OutCapsule] = []
        self.on_capsule: Callable[[memoryview], None] | None = None
        self.held: list[int] = []  # jobs `send` answers only when `release` is called
        self.hold = False

    @property
    def address(self) -> PeerAddress:
        raise NotImplementedError

    async def connect(self, agent: PeerAddress | None) -> None:
        raise NotImplementedError

    def register(self, length: int, access: Access) -> Region:
        raise NotImplementedError

    def deregister(self, region: Region) -> None:
        raise NotImplementedError

    def start(self, on_capsule, on_failure, expecting) -> None:
        raise NotImplementedError

    def _answer_later(self, job_id: int) -> None:
        assert self.on_capsule is not None
        data = capsule.pack_completion(*_fields(job_id)[:9])
        asyncio.get_running_loop().call_soon(self.on_capsule, memoryview(data))

    def send(self, capsules: Sequence[OutCapsule]) -> None:
        for out in capsules:
            self.sent.append(out)
            head = out[0] if isinstance(out, tuple) else out
            job_id = capsule.peek_header(head)[1]
            if self.hold:
                self.held.append(job_id)
            else:
                self._answer_later(job_id)

    def release(self) -> None:
        for job_id in self.held:
            self._answer_later(job_id)
        self.held.clear()

    def call(self, capsule_: OutCapsule, job_id: int) -> CompletionFields | bool:
        self.calls.append((capsule_, job_id))
        if self.mode == "fields":
            return _fields(job_id)
        if self.mode == "later":
            self._answer_later(job_id)
            return True
        if self.mode == "fail":
            raise TransportError("the queue pair is in the error state")
        return False

    async def close(self) -> None:
        pass


def _session(mode: str) -> tuple[Session, _Link]:
    link = _Link(mode)
    rpc = types.SimpleNamespace()
    session = Session(rpc, link, QUEUE_DEPTH)  # type: ignore[arg-type]
    link.on_capsule = session._on_capsule
    return session, link


@pytest.mark.parametrize("mode", ["fields", "later", "unsent"])
async def test_run_returns_the_jobs_completion_whichever_way_it_came(mode):
    session, link = _session(mode)
    done = await asyncio.wait_for(session.run(REQUEST), 5)
    assert (done.state, done.code, done.crc32c) == ("SUCCEEDED", "OK", 0xABCD)
    [(out, job_id)] = link.calls
    assert done.job_id == job_id
    submit = capsule.decode(out if isinstance(out, bytes) else out[0])
    assert isinstance(submit, capsule.Submit)
    assert (submit.job_id, submit.kind, submit.source) == (job_id, JobKind.CRC32C, REQUEST.source)
    assert link.sent == ([] if mode != "unsent" else [out])
    assert session._credits.free == QUEUE_DEPTH
    assert not session._pending


async def test_run_behind_other_jobs_takes_the_usual_way():
    session, link = _session("fields")
    link.hold = True
    first = await session.submit(REQUEST)  # in flight: run must not spin past it
    link.hold = False
    done = await asyncio.wait_for(session.run(REQUEST), 5)
    link.release()
    assert link.calls == []
    sent = [out for out in link.sent if isinstance(out, bytes)]
    assert [capsule.peek_header(out)[1] for out in sent] == [first.job_id, done.job_id]
    assert (await first).ok


async def test_runs_answered_in_the_call_let_the_event_loop_turn():
    session, _ = _session("fields")
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    started = turns
    runs = 10 * (RUN_TURNS + 1)
    for _ in range(runs):
        await session.run(REQUEST)
    task.cancel()
    assert turns - started >= runs // (RUN_TURNS + 1)


async def test_a_failed_call_fails_the_session_and_gives_its_credit_back():
    session, _ = _session("fail")
    with pytest.raises(UnavailableError, match="error state"):
        await session.run(REQUEST)
    assert session.failed
    assert session._credits.free == QUEUE_DEPTH


async def test_an_inline_source_goes_to_the_call_as_a_pair():
    session, link = _session("fields")
    data = memoryview(bytearray(b"x" * 4096))
    session.inline_max = 4096
    link.local_view = lambda _span: data  # type: ignore[method-assign,assignment]
    await session.run(REQUEST)
    [(out, _)] = link.calls
    assert isinstance(out, tuple)
    head, tail = out
    assert tail is data
    submit = capsule.submit_fields(head + bytes(tail))
    assert submit[2] & FLAG_INLINE
