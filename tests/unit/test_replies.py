"""Idempotent retries (`dpu_agent.replies`): the first reply, once per key, per tenant."""

from __future__ import annotations

import asyncio

import pytest

from dpu_agent import replies
from dpu_agent.errors import InvalidArgument, NotFound
from dpu_agent.replies import Replies, request_id_of
from dpu_wire.v1 import job_pb2, session_pb2, storage_pb2

DELETE = "/dpu.v1.StorageService/DeleteVolume"


class Calls:
    """A service method that counts how often it acted."""

    def __init__(self) -> None:
        self.acted = 0
        self.gate = asyncio.Event()

    async def act(self) -> str:
        self.acted += 1
        await asyncio.sleep(0)
        return f"reply {self.acted}"

    async def slow(self) -> str:
        """`act` once `gate` is set."""
        await self.gate.wait()
        return await self.act()


@pytest.mark.asyncio
async def test_a_retry_gets_the_first_reply_without_acting_again():
    book, calls = Replies(), Calls()
    assert await book.call("a", DELETE, "rid-1", calls.act) == "reply 1"
    assert await book.call("a", DELETE, "rid-1", calls.act) == "reply 1"
    assert calls.acted == 1
    assert await book.call("a", DELETE, "rid-2", calls.act) == "reply 2"  # another key acts
    assert await book.call("b", DELETE, "rid-1", calls.act) == "reply 3"  # another tenant too
    other = "/dpu.v1.StorageService/ResizeVolume"
    assert await book.call("a", other, "rid-1", calls.act) == "reply 4"  # another method too


@pytest.mark.asyncio
async def test_a_call_that_failed_keeps_nothing():
    book, calls = Replies(), Calls()

    async def missing() -> str:
        raise NotFound("volume 'v' does not exist")

    with pytest.raises(NotFound):
        await book.call("a", DELETE, "rid", missing)
    assert len(book) == 0
    assert await book.call("a", DELETE, "rid", calls.act) == "reply 1"


@pytest.mark.asyncio
async def test_a_retry_during_the_first_call_waits_for_its_answer():
    book, calls = Replies(), Calls()
    first = asyncio.create_task(book.call("a", DELETE, "rid", calls.slow))
    retry = asyncio.create_task(book.call("a", DELETE, "rid", calls.slow))
    await asyncio.sleep(0.01)
    calls.gate.set()
    assert await first == await retry == "reply 1"
    assert calls.acted == 1


@pytest.mark.asyncio
async def test_a_retry_waiting_on_a_cancelled_first_call_acts_itself():
    book, calls = Replies(), Calls()
    first = asyncio.create_task(book.call("a", DELETE, "rid", calls.slow))
    await asyncio.sleep(0.01)
    retry = asyncio.create_task(book.call("a", DELETE, "rid", calls.slow))
    await asyncio.sleep(0.01)
    first.cancel()  # the first client went away
    await asyncio.sleep(0.01)
    calls.gate.set()
    assert await retry == "reply 1"
    assert first.cancelled()


@pytest.mark.asyncio
async def test_other_tenants_cannot_push_a_tenants_replies_out(monkeypatch):
    """A shared list of 4,096 remembered creates let one tenant evict another's (an audit)."""
    monkeypatch.setattr(replies, "MAX_PER_TENANT", 8)
    book, calls = Replies(), Calls()
    assert await book.call("a", DELETE, "mine", calls.act) == "reply 1"
    for i in range(100):
        await book.call("b", DELETE, f"flood-{i}", calls.act)
    assert await book.call("a", DELETE, "mine", calls.act) == "reply 1"
    assert len(book) == 1 + 8  # bounded per tenant, the oldest forgotten first
    for i in range(8):
        await book.call("a", DELETE, f"more-{i}", calls.act)
    acted = calls.acted
    assert await book.call("a", DELETE, "mine", calls.act) != "reply 1"
    assert calls.acted == acted + 1


@pytest.mark.asyncio
async def test_a_reply_is_kept_for_ttl_seconds():
    now = [0.0]
    book, calls = Replies(clock=lambda: now[0]), Calls()
    await book.call("a", DELETE, "rid", calls.act)
    now[0] = replies.TTL_S - 1
    assert await book.call("a", DELETE, "rid", calls.act) == "reply 1"
    now[0] = replies.TTL_S + 1
    assert await book.call("a", DELETE, "rid", calls.act) == "reply 2"


def test_which_calls_are_answered_here():
    assert request_id_of(DELETE, storage_pb2.DeleteVolumeRequest(request_id="r")) == "r"
    assert request_id_of(DELETE, storage_pb2.DeleteVolumeRequest()) == ""  # no key: acts
    get = "/dpu.v1.StorageService/GetVolume"
    assert request_id_of(get, storage_pb2.GetVolumeRequest(name="volumes/v")) == ""
    # these two keep their own record, tied to the session and the job they made
    opened = session_pb2.OpenSessionRequest(request_id="r")
    assert request_id_of("/dpu.v1.SessionService/OpenSession", opened) == ""
    submitted = job_pb2.SubmitJobRequest(request_id="r")
    assert request_id_of("/dpu.v1.JobService/SubmitJob", submitted) == ""


@pytest.mark.asyncio
async def test_the_replies_kept_are_bounded_in_bytes(monkeypatch):
    """Per tenant, and over all tenants (the least recently used tenant's go first)."""
    monkeypatch.setattr(replies, "MAX_BYTES_PER_TENANT", 10_000)
    monkeypatch.setattr(replies, "MAX_BYTES", 25_000)
    book = Replies()

    async def volume() -> storage_pb2.Volume:
        return storage_pb2.Volume(name="volumes/" + "v" * 990)  # about 1,000 bytes

    size = (await volume()).ByteSize()
    for i in range(50):
        await book.call("a", DELETE, f"a-{i}", volume)
    assert book.bytes <= 10_000
    assert book.bytes == len(book) * size
    for tenant in ("b", "c"):
        for i in range(50):
            await book.call(tenant, DELETE, f"{tenant}-{i}", volume)
    assert book.bytes <= 25_000
    assert book.bytes == len(book) * size
    assert len(book) == 2 * (10_000 // size)  # a's, the least recently used, went first


@pytest.mark.asyncio
async def test_a_request_id_reused_for_another_request_is_refused_and_changes_nothing():
    """AIP-155: the key is one request's. Before, a CancelJob of job B with the key of an
    earlier CancelJob of job A was answered with A's reply, and B was never cancelled."""
    book, calls = Replies(), Calls()
    first = replies.request_digest(
        storage_pb2.DeleteVolumeRequest(name="volumes/a", request_id="r")
    )
    other = replies.request_digest(
        storage_pb2.DeleteVolumeRequest(name="volumes/b", request_id="r")
    )
    assert first != other
    assert await book.call("a", DELETE, "r", calls.act, first) == "reply 1"
    with pytest.raises(InvalidArgument, match="'r' was used for another DeleteVolume request"):
        await book.call("a", DELETE, "r", calls.act, other)
    assert calls.acted == 1
    assert await book.call("a", DELETE, "r", calls.act, first) == "reply 1"  # its retry still
    assert await book.call("b", DELETE, "r", calls.act, other) == "reply 2"  # another tenant's


@pytest.mark.asyncio
async def test_a_different_request_is_refused_while_the_first_still_runs():
    book, calls = Replies(), Calls()
    running = asyncio.create_task(book.call("a", DELETE, "r", calls.slow, b"first"))
    await asyncio.sleep(0)
    with pytest.raises(InvalidArgument):  # at once, not after the first call's answer
        await asyncio.wait_for(book.call("a", DELETE, "r", calls.act, b"second"), 5)
    calls.gate.set()
    assert await running == "reply 1"
    assert calls.acted == 1
