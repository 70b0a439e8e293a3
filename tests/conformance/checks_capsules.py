"""Checks of section 2 of docs/data-plane.md: capsules, admission, credits, ordering,
deadlines, compute kinds."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import crc32c
import grpc
import lz4.frame
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import host_client
from dpu_wire import capsule as sdk_capsule
from dpu_wire.v1 import job_pb2, session_pb2
from tests.conformance import wire
from tests.conformance.harness import CHUNK, PROMPT, WAIT, Ctx, HostRegion, Sess, code_of
from tests.conformance.rawtcp import READ, WRITE, RawTcpHost
from tests.conformance.rawverbs import RawVerbsHost
from tests.conformance.shutdown import shutdown_scenario
from tests.conformance.wire import Kind, Span, St

K = wire.Kind


async def _failed(
    session: Sess, kind: int, src: Span = wire.ZERO, dst: Span = wire.ZERO, **f: int
) -> wire.Completion:
    done = await session.run(kind, src, dst, **f)
    assert done.state == St.FAILED, done
    return done


async def _rejected(
    session: Sess, capsule: bytes, job_id: int, *, bad: bool = True, open_id: bool = False
) -> wire.Completion:
    """The agent answers a capsule it cannot take: FAILED, status 3, no job made.

    `bad`: an undecodable one, whose message begins "bad capsule: ". `open_id`: the id
    is an open job's (which GetJob finds).
    """
    await session.send(capsule)
    done = await session.completion_for(job_id)
    assert (done.state, done.status) == (St.FAILED, 3), done
    assert done.message.startswith("bad capsule: ") or not bad, done
    if job_id and job_id < wire.AGENT_IDS and not open_id:
        assert await code_of(session.job(job_id)) == grpc.StatusCode.NOT_FOUND, "a job was made"
    return done


async def _a_job(session: Sess, job_id: int, status: int) -> None:
    """The job exists, FAILED with `status` (admission failures are jobs)."""
    job = await session.job(job_id)
    assert (job.state, job.completion.status.code) == (job_pb2.JOB_STATE_FAILED, status), job


async def _buffers(session: Sess, length: int = 4096) -> tuple[HostRegion, HostRegion]:
    src = await session.region(length, READ, fill=os.urandom(length))
    dst = await session.region(length, WRITE)
    return src, dst


# ---------------------------------------------------------------- 2.1, 2.2


async def agent_job_ids(ctx: Ctx) -> None:
    """DP-2.1-1."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    spec = job_pb2.JobSpec(
        copy=job_pb2.CopyJob(source=session.ref(src), destination=session.ref(dst))
    )
    ids = [int((await session.submit_rpc(spec)).job_id) for _ in range(2)]
    assert all(i >= wire.AGENT_IDS for i in ids), ids
    assert ids[0] != ids[1]


async def flags_and_reserved(ctx: Ctx) -> None:
    """DP-2.2-1."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    cases = [
        wire.submit(11, K.COPY, src.span(), dst.span(), flags=2),
        wire.submit(12, K.COPY, src.span(), dst.span(), flags=wire.FUA),
        wire.submit(13, K.CRC32C, src.span(), flags=0x8000),
        wire.submit(14, K.COPY, src.span(), dst.span(), reserved=1),
    ]
    for job_id, capsule in enumerate(cases, 11):
        await _rejected(session, capsule, job_id)
    volume = await ctx.volume(stubs=session.stubs)
    handle = await session.attach(volume)
    await _rejected(session, wire.submit(15, K.VOLUME_FLUSH, handle=handle, flags=wire.FUA), 15)
    await _rejected(
        session, wire.submit(16, K.VOLUME_WRITE, src.span(), handle=handle, flags=3), 16
    )
    fua = await session.run(K.VOLUME_WRITE, src.span(), handle=handle, flags=wire.FUA)
    assert fua.ok, fua


async def unused_fields_are_zero(ctx: Ctx) -> None:
    """DP-2.2-2 (issue 14, item 12)."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    volume = await ctx.volume(stubs=session.stubs)
    handle = await session.attach(volume)
    cases = [
        (K.COPY, src.span(), dst.span(), {"handle": 1}),
        (K.COPY, src.span(), dst.span(), {"offset": 4096}),
        (K.COPY, src.span(), dst.span(), {"length": 1}),
        (K.CRC32C, src.span(), wire.ZERO, {"handle": 7}),
        (K.SHA256, src.span(), dst.span(), {"offset": 1}),
        (K.COMPRESS, src.span(), dst.span(), {"handle": wire.LZ4, "length": 4096}),
        (K.VOLUME_FLUSH, wire.ZERO, wire.ZERO, {"handle": handle, "offset": 4096}),
        (K.VOLUME_FLUSH, wire.ZERO, wire.ZERO, {"handle": handle, "length": 4096}),
        (K.VOLUME_WRITE, src.span(), wire.ZERO, {"handle": handle, "length": 4096}),
        (K.VOLUME_READ, wire.ZERO, dst.span(), {"handle": handle, "length": 4096}),
    ]
    for kind, s, d, fields in cases:
        done = await _failed(session, kind, s, d, **fields)
        assert done.status == 3, (kind, fields, done)
        await _a_job(session, done.job_id, 3)


async def unused_spans_are_zero(ctx: Ctx) -> None:
    """DP-2.2-3."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    volume = await ctx.volume(stubs=session.stubs)
    handle = await session.attach(volume)
    cases = [
        (K.CRC32C, src.span(), dst.span(), {}),
        (K.CRC32C, src.span(), Span(0, 0, dst.rkey), {}),
        (K.VOLUME_WRITE, src.span(), Span(dst.addr, 0, 0), {"handle": handle}),
        (K.VOLUME_READ, src.span(), dst.span(), {"handle": handle}),
        (K.VOLUME_FLUSH, Span(0, 1, 0), wire.ZERO, {"handle": handle}),
        (K.VOLUME_TRIM, wire.ZERO, dst.span(), {"handle": handle, "length": 4096}),
    ]
    for kind, s, d, fields in cases:
        done = await _failed(session, kind, s, d, **fields)
        assert done.status == 3, (kind, s, d, done)


async def used_spans(ctx: Ctx) -> None:
    """DP-2.2-4."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    write_only = await session.region(4096, WRITE)
    read_only = await session.region(4096, READ)
    s, d = src.span(), dst.span()
    for bad_source in (
        Span(s.addr, 0, s.rkey),  # length 0
        Span(s.addr, 4096, s.rkey ^ 0x00FF_FF00),  # no such rkey
        Span(2**64 - 1, 2, s.rkey),  # past 2^64
        Span(s.addr + 1, 4096, s.rkey),  # outside the region
        Span(s.addr - 1, 16, s.rkey),
    ):
        assert (
            await _failed(session, K.COPY, bad_source, Span(d.addr, bad_source.length, d.rkey))
        ).status == 3
    assert (await _failed(session, K.CRC32C, write_only.span())).status == 7
    assert (await _failed(session, K.COPY, s, read_only.span())).status == 7
    assert (await _failed(session, K.COPY, s, Span(d.addr + 4095, 4096, d.rkey))).status == 3
    assert (
        await session.run(K.COPY, Span(s.addr + 4095, 1, s.rkey), Span(d.addr + 4095, 1, d.rkey))
    ).ok


async def kind_checks(ctx: Ctx) -> None:
    """DP-2.2-5."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    key = await session.key(os.urandom(32))
    s, d = src.span(), dst.span()
    cases = [
        (K.COPY, s, Span(d.addr, 4095, d.rkey), {}),
        (K.SHA256, s, Span(d.addr, 31, d.rkey), {}),
        (K.COMPRESS, s, d, {"handle": 0}),
        (K.DECOMPRESS, s, d, {"handle": 3}),
        (K.ENCRYPT, s, d, {"handle": key + 100}),
        (K.DECRYPT, s, d, {"handle": 0}),
        (K.VOLUME_WRITE, s, wire.ZERO, {"handle": 4242}),
        (K.VOLUME_READ, wire.ZERO, d, {"handle": 4242}),
    ]
    for kind, a, b, fields in cases:
        assert (await _failed(session, kind, a, b, **fields)).status == 3, (kind, fields)


async def every_kind(ctx: Ctx) -> None:
    """DP-2.2-6: each row of the kinds table, against the reference libraries."""
    session = await ctx.open(queue_depth=16)
    n = 3 * CHUNK + 1000  # several chunks and a short one
    data = os.urandom(n // 2) * 2 + os.urandom(n % 2)  # compressible
    src = await session.region(n, READ, fill=data)
    dst = await session.region(2 * n, WRITE | READ)
    copy = await session.run(K.COPY, src.span(), dst.span(0, n))
    assert copy.ok, copy
    assert bytes(dst.view[:n]) == data
    crc = await session.run(K.CRC32C, src.span())
    assert crc.ok, crc
    assert crc.result == crc32c.crc32c(data), crc
    check = await session.region(9, READ, fill=b"123456789")
    assert (await session.run(K.CRC32C, check.span())).result == 0xE3069283
    digest = await session.run(K.SHA256, src.span(), dst.span(0, 100))
    assert digest.ok, digest
    assert digest.result == 32, digest
    assert bytes(dst.view[:32]) == hashlib.sha256(data).digest()
    await _compression(session, src, dst, data)
    await _encryption(session, src, dst, data)
    await _volumes(session, src, dst, data)


async def _compression(session: Sess, src: HostRegion, dst: HostRegion, data: bytes) -> None:
    decompress = {
        wire.LZ4: lz4.frame.decompress,
        wire.ZSTD: zstandard.ZstdDecompressor().decompressobj,
    }
    n = len(data)
    for codec in (wire.LZ4, wire.ZSTD):
        done = await session.run(K.COMPRESS, src.span(), dst.span(), handle=codec)
        assert done.ok, done
        assert done.result == done.bytes_written > 0, done
        frame = bytes(dst.view[: done.result])
        out = (
            decompress[codec](frame) if codec == wire.LZ4 else decompress[codec]().decompress(frame)
        )
        assert out == data, f"codec {codec}"
    packed = await session.region(n + 4096, READ)
    for codec, blob in (
        (wire.LZ4, lz4.frame.compress(data)),
        (wire.ZSTD, zstandard.ZstdCompressor().compress(data)),
    ):
        packed.view[: len(blob)] = blob
        done = await session.run(K.DECOMPRESS, packed.span(0, len(blob)), dst.span(), handle=codec)
        assert done.ok, done
        assert done.result == n, done
        assert bytes(dst.view[:n]) == data


async def _encryption(session: Sess, src: HostRegion, dst: HostRegion, data: bytes) -> None:
    key = os.urandom(32)
    handle = await session.key(key)
    n = len(data)
    sealed = await session.run(K.ENCRYPT, src.span(), dst.span(), handle=handle)
    assert sealed.ok, sealed
    assert sealed.result == 12 + n + 16, sealed
    blob = bytes(dst.view[: sealed.result])
    assert AESGCM(key).decrypt(blob[:12], blob[12:], None) == data
    nonce = os.urandom(12)
    theirs = nonce + AESGCM(key).encrypt(nonce, data, None)
    box = await session.region(len(theirs), READ, fill=theirs)
    opened = await session.run(K.DECRYPT, box.span(), dst.span(), handle=handle)
    assert opened.ok, opened
    assert opened.result == n, opened
    assert bytes(dst.view[:n]) == data


async def _volumes(session: Sess, src: HostRegion, dst: HostRegion, data: bytes) -> None:
    volume = await session.ctx.volume(1 << 20, stubs=session.stubs)
    handle = await session.attach(volume)
    n = 3 * CHUNK  # whole blocks
    wrote = await session.run(
        K.VOLUME_WRITE, src.span(0, n), handle=handle, offset=4096, flags=wire.FUA
    )
    assert wrote.ok, wrote
    assert wrote.bytes_read == n, wrote
    assert (await session.run(K.VOLUME_FLUSH, handle=handle)).ok
    read = await session.run(K.VOLUME_READ, wire.ZERO, dst.span(0, n), handle=handle, offset=4096)
    assert read.ok, read
    assert bytes(dst.view[:n]) == data[:n]
    assert (await session.run(K.VOLUME_TRIM, handle=handle, offset=8192, length=8192)).ok
    read = await session.run(K.VOLUME_READ, wire.ZERO, dst.span(0, n), handle=handle, offset=4096)
    assert read.ok, read
    expected = data[:4096] + bytes(8192) + data[12288:n]
    assert bytes(dst.view[:n]) == expected


async def volume_alignment(ctx: Ctx) -> None:
    """DP-2.2-7."""
    session = await ctx.open()
    src, dst = await _buffers(session, 8192)
    volume = await ctx.volume(1 << 20, block_size=4096, stubs=session.stubs)
    handle = await session.attach(volume)
    s, d = src.span(), dst.span()
    cases = [
        (K.VOLUME_WRITE, s, wire.ZERO, {"offset": 512}),
        (K.VOLUME_WRITE, Span(s.addr, 1000, s.rkey), wire.ZERO, {}),
        (K.VOLUME_READ, wire.ZERO, Span(d.addr, 4095, d.rkey), {}),
        (K.VOLUME_READ, wire.ZERO, d, {"offset": 100}),
        (K.VOLUME_TRIM, wire.ZERO, wire.ZERO, {"offset": 4096, "length": 100}),
        (K.VOLUME_TRIM, wire.ZERO, wire.ZERO, {"offset": 1, "length": 4096}),
    ]
    for kind, a, b, fields in cases:
        done = await _failed(session, kind, a, b, handle=handle, **fields)
        assert done.status == 3, (kind, fields, done)


# ---------------------------------------------------------------- 2.3


async def cancel_of_nothing(ctx: Ctx) -> None:
    """DP-2.3-1."""
    session = await ctx.open()
    await session.send(wire.cancel(999), wire.cancel(2**63 + 5), wire.cancel(0))
    await session.quiet(0.5)
    src, dst = await _buffers(session)
    done = await session.run(K.COPY, src.span(), dst.span())
    assert done.ok
    cancelled = await session.run(K.COPY, src.span(), dst.span())  # finished: a CANCEL is too late
    await session.send(wire.cancel(cancelled.job_id))
    await session.quiet(0.3)


async def cancel_now(ctx: Ctx) -> None:
    """DP-2.3-2: between chunks; and (tcp) with a READ outstanding (issue 14, item 6)."""
    session = await ctx.open()
    job = await session.slow_write()
    await asyncio.sleep(0.3)
    sent = time.monotonic()
    await session.send(wire.cancel(job))
    done = await session.completion_for(job, timeout=WAIT)
    assert (done.state, done.status, done.message) == (St.CANCELLED, 1, "cancelled by request"), (
        done
    )
    assert time.monotonic() - sent < PROMPT, "the CANCEL took effect only when the job ended"
    if isinstance(session.host, RawTcpHost):
        job, read, _ = await session.held_copy()
        sent = time.monotonic()
        await session.send(wire.cancel(job))
        done = await session.completion_for(job, timeout=WAIT)
        assert (done.state, done.status) == (St.CANCELLED, 1), done
        assert time.monotonic() - sent < PROMPT, "the CANCEL waited for the outstanding READ"
        await session.host.answer_read(read)  # late, harmless
        session.host.hold_reads = False
        src, dst2 = await _buffers(session)
        assert (await session.run(K.COPY, src.span(), dst2.span())).ok


# ---------------------------------------------------------------- 2.4


async def completion_format(ctx: Ctx) -> None:
    """DP-2.4-1: `Sess.completion` parses strictly; here one of each kind of answer."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    answers = [
        await session.run(K.COPY, src.span(), dst.span()),
        await session.run(K.CRC32C, src.span()),
        await session.run(K.COPY, src.span(), Span(dst.addr, 1, dst.rkey)),
        await _rejected(session, wire.submit(900, K.COPY, version=7), 900),
        await _rejected(session, b"\x00" * 10, 0),
    ]
    job = await session.slow_write()
    await session.send(wire.cancel(job))
    answers.append(await session.completion_for(job))
    assert [a.state for a in answers] == [
        St.SUCCEEDED,
        St.SUCCEEDED,
        St.FAILED,
        St.FAILED,
        St.FAILED,
        St.CANCELLED,
    ]
    assert answers[1].result == crc32c.crc32c(bytes(src.view))
    assert answers[0].message == ""


async def completion_times(ctx: Ctx) -> None:
    """DP-2.4-2 (issue 14, item 11: rejected capsules carry the receive time)."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    slack = 5_000_000  # 5 ms: both read the same CLOCK_REALTIME
    before = time.time_ns()
    ok = await session.run(K.COPY, src.span(), dst.span())
    rejected = await _rejected(session, wire.submit(901, K.COPY, version=2), 901)
    refused = await session.run(K.COPY, Span(src.addr, 0, src.rkey), dst.span())
    after = time.time_ns()
    assert before - slack <= ok.submit_ns <= ok.start_ns <= ok.end_ns <= after + slack, ok
    assert rejected.start_ns == 0, rejected
    assert before - slack <= rejected.submit_ns == rejected.end_ns <= after + slack, rejected
    assert refused.start_ns == 0, refused
    assert before - slack <= refused.submit_ns <= refused.end_ns <= after + slack, refused


async def completion_bytes(ctx: Ctx) -> None:
    """DP-2.4-3."""
    session = await ctx.open()
    n = 2 * CHUNK + 123
    src = await session.region(n, READ, fill=os.urandom(n))
    dst = await session.region(n, WRITE)
    copy = await session.run(K.COPY, src.span(), dst.span())
    assert (copy.bytes_read, copy.bytes_written) == (n, n), copy
    crc = await session.run(K.CRC32C, src.span())
    assert (crc.bytes_read, crc.bytes_written) == (n, 0), crc
    digest = await session.run(K.SHA256, src.span(), dst.span())
    assert (digest.bytes_read, digest.bytes_written) == (n, 32), digest
    refused = await session.run(K.COPY, src.span(), Span(dst.addr, 1, dst.rkey))
    assert (refused.bytes_read, refused.bytes_written) == (0, 0), refused
    if isinstance(session.host, RawTcpHost):  # what the host served, counted by the host
        job = await session.slow_write(4)
        await asyncio.sleep(1.5)
        await session.send(wire.cancel(job))
        done = await session.completion_for(job)
        served = sum(
            f.length for f in session.host.frames if f.type == wire.Ft.READ and f.rkey != src.rkey
        )
        assert done.state == St.CANCELLED, done
        assert done.bytes_read == served > 0, (done, served)


async def host_decoding(ctx: Ctx) -> None:
    """DP-2.4-4 (the SDK): malformed COMPLETIONs are refused; unknown ones ignored."""
    bad = [
        sdk_capsule.Completion(7, sdk_capsule.State.FAILED, 3, message="x" * 20).encode()[:-1],
        wire.completion_bytes(7, message=b"abc")[:83] + b"\x00",
        wire.COMPLETION.pack(b"DC", 1, 3, 80, 7, 0, 3, 0, 200, 0, 0, 0, 0, 0, 0, 0, 0),
        wire.COMPLETION.pack(b"DC", 1, 3, 80, 7, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    ]
    for data in bad:
        try:
            sdk_capsule.decode(data)
        except sdk_capsule.CapsuleError:
            continue
        raise AssertionError(f"the SDK's decoder took {data.hex()}")
    async with host_client.Client(ctx.agent().address) as client:
        session = await client.open_session(transport=ctx.transport, rdma_device=ctx.device)
        async with session:
            src = await session.alloc(4096, readable=True)
            dst = await session.alloc(4096, writable=True)
            session._link.send(
                [wire.submit(1, K.COPY, version=9)]
            )  # answered with job 1: no job of ours
            await asyncio.sleep(0.5)
            assert session.protocol_errors == 1
            assert not session.failed
            await session.copy(src, dst)


# ---------------------------------------------------------------- 2.5


async def in_order(ctx: Ctx) -> None:
    """DP-2.5-1: a CANCEL right behind its SUBMIT, in one send."""
    session = await ctx.open()
    _, handle, src = await session.slow_volume(10)
    job = session.next_id()
    await session.send(
        wire.submit(job, K.VOLUME_WRITE, src.span(), handle=handle), wire.cancel(job)
    )
    done = await session.completion_for(job)
    assert (done.state, done.status) == (St.CANCELLED, 1), done


async def one_answer_each(ctx: Ctx) -> None:
    """DP-2.5-2."""
    session = await ctx.open(queue_depth=16)
    await session.quiet(0.3)  # nothing unprompted
    src, dst = await _buffers(session)
    s, d = src.span(), dst.span()
    capsules = [wire.submit(i, K.COPY, s, d) for i in range(1, 6)]  # admitted
    capsules += [wire.submit(i, K.COPY, s, Span(d.addr, 1, d.rkey)) for i in range(6, 9)]  # failed
    capsules += [wire.submit(i, K.COPY, s, d, version=3) for i in range(9, 11)]  # rejected
    capsules += [wire.cancel(500), wire.cancel(501), wire.completion_bytes(11)]  # one rejected
    await session.send(*capsules)
    seen: dict[int, int] = {}
    for _ in range(11):
        done = await session.completion(timeout=10)
        seen[done.job_id] = seen.get(done.job_id, 0) + 1
    await session.quiet(0.5)
    assert seen == dict.fromkeys(range(1, 12), 1), seen


async def too_long(ctx: Ctx) -> None:
    """DP-2.5-3."""
    session = await ctx.open()
    limit = max(wire.MAX_CAPSULE, 80 + session.reply.inline_max)  # section 2.8
    if isinstance(session.host, RawTcpHost):
        await session.host.send(wire.frame(wire.Ft.CAPSULE, length=limit + 1) + bytes(limit + 1))
        await asyncio.wait_for(session.host.eof.wait(), WAIT)
    else:
        assert isinstance(session.host, RawVerbsHost)
        await session.host.send_oversized(limit + 1)
    failed = await session.wait_state(5)
    assert failed.state == 5, failed


async def undecodable(ctx: Ctx) -> None:
    """DP-2.5-4."""
    session = await ctx.open()
    agent = ctx.agent()
    counted = agent.metrics().get("dpu_agent_capsules_rejected_total", 0.0)
    src, dst = await _buffers(session)
    good = wire.submit(31, K.COPY, src.span(), dst.span())
    cases = [
        (b"DC\x01\x01\x10\x00\x00\x00", 0),  # 8 bytes
        (b"XC" + good[2:], 0),  # magic
        (wire.submit(32, K.COPY, src.span(), dst.span(), version=2), 32),
        (good[:4] + (100).to_bytes(4, "little") + (33).to_bytes(8, "little") + good[16:], 33),
        (good[:3] + b"\x09" + good[4:8] + (34).to_bytes(8, "little") + good[16:], 34),
        (wire.HEADER.pack(b"DC", 1, 1, 96, 35) + good[16:] + bytes(16), 35),  # 96-byte SUBMIT
        (wire.submit(36, 12, src.span(), dst.span()), 36),  # kind 12
        (wire.submit(37, 0, src.span(), dst.span()), 37),  # kind 0
        (wire.HEADER.pack(b"DC", 1, 2, 24, 38) + bytes(8), 38),  # 24-byte CANCEL
        (wire.completion_bytes(39, message=b"abc")[:-1], 39),  # length says 83, 82 came
        (
            wire.COMPLETION.pack(b"DC", 1, 3, 80, 40, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
            40,
        ),  # state 9
    ]
    for capsule, job_id in cases:
        await _rejected(session, capsule, job_id)
    after = agent.metrics().get("dpu_agent_capsules_rejected_total", 0.0)
    assert after - counted == len(cases), (counted, after)


async def completion_from_host(ctx: Ctx) -> None:
    """DP-2.5-5."""
    session = await ctx.open()
    done = await _rejected(session, wire.completion_bytes(41), 41)
    assert done.message == "bad capsule: hosts do not send COMPLETION", done


async def reserved_and_reused_ids(ctx: Ctx) -> None:
    """DP-2.5-6."""
    session = await ctx.open()
    src, dst = await _buffers(session)
    await _rejected(session, wire.submit(2**63, K.COPY, src.span(), dst.span()), 2**63, bad=False)
    top = 2**64 - 1
    await _rejected(session, wire.submit(top, K.COPY, src.span(), dst.span()), top, bad=False)
    job = await session.slow_write()
    await session.running(job)
    await _rejected(
        session, wire.submit(job, K.COPY, src.span(), dst.span()), job, bad=False, open_id=True
    )
    assert (await session.job(job)).state == job_pb2.JOB_STATE_RUNNING, "the open job was touched"
    await session.send(wire.cancel(job))
    assert (await session.completion_for(job)).state == St.CANCELLED


async def admission_order(ctx: Ctx) -> None:
    """DP-2.5-7: SUBMITs that fail two checks get the first one's status."""
    session = await ctx.open(queue_depth=2)
    src, dst = await _buffers(session)
    no_read = await session.region(4096, WRITE)
    no_write = await session.region(4096, READ)
    s, d = src.span(), dst.span()
    unknown = Span(d.addr, 4096, d.rkey ^ 0x0F0F_0F0F)
    cases = [
        (K.COPY, no_read.span(), unknown, {}, 7),  # 6 before 7
        (K.COPY, no_read.span(), Span(d.addr, 100, d.rkey), {}, 7),  # 6 before 8
        (K.COMPRESS, s, no_write.span(), {"handle": 9}, 7),  # 7 before 9
        (K.VOLUME_WRITE, no_read.span(), wire.ZERO, {"handle": 4242}, 3),  # 4 before 6
        (K.COPY, no_read.span(), d, {"offset": 4096}, 3),  # 3 before 6
    ]
    for kind, a, b, fields, status in cases:
        done = await _failed(session, kind, a, b, **fields)
        assert done.status == status, (kind, fields, done)
        await _a_job(session, done.job_id, status)
    busy = [await session.slow_write(), await session.slow_write()]
    assert (await _failed(session, K.COPY, s, unknown)).status == 3  # 7 before 10
    assert (await _failed(session, K.COMPRESS, s, d, handle=9)).status == 3  # 9 before 10
    assert (await _failed(session, K.COPY, s, d)).status == 8
    seen = await shutdown_scenario(ctx)  # 2 before 5
    assert (seen.submit_bad_span.state, seen.submit_bad_span.status) == (St.FAILED, 14)
    await session.send(*(wire.cancel(job) for job in busy))


# ---------------------------------------------------------------- 2.6


async def queue_credits(ctx: Ctx) -> None:
    """DP-2.6-1."""
    session = await ctx.open(queue_depth=2)
    src, dst = await _buffers(session)
    busy = [await session.slow_write(), await session.slow_rpc()]
    over = await session.run(K.COPY, src.span(), dst.span())
    assert (over.state, over.status) == (St.FAILED, 8), over
    spec = job_pb2.JobSpec(
        copy=job_pb2.CopyJob(source=session.ref(src), destination=session.ref(dst))
    )
    assert await code_of(session.submit_rpc(spec)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    await session.send(wire.cancel(busy[0]))
    assert (await session.completion_for(busy[0])).state == St.CANCELLED
    assert (await session.run(K.COPY, src.span(), dst.span())).ok


async def slot_before_completion(ctx: Ctx) -> None:
    """DP-2.6-2."""
    session = await ctx.open(queue_depth=1)
    src, dst = await _buffers(session, 512)
    for _ in range(40):
        done = await session.run(K.COPY, src.span(), dst.span())
        assert done.ok, done


async def data_before_completion(ctx: Ctx) -> None:
    """DP-2.6-3: the destination is checked the moment the COMPLETION is read."""
    session = await ctx.open(queue_depth=16)
    n = 3 * CHUNK + 77
    data = os.urandom(n)
    src = await session.region(n, READ, fill=data)
    dsts = [await session.region(n, WRITE) for _ in range(8)]
    seen: dict[int, bytes] = {}
    ids = {session.next_id(): dst for dst in dsts}

    def look(capsule: bytes) -> None:
        job_id = int.from_bytes(capsule[8:16], "little")
        if job_id in ids:
            seen[job_id] = bytes(ids[job_id].view)

    session.host.on_capsule = look
    await session.send(
        *(wire.submit(job, K.COPY, src.span(), dst.span()) for job, dst in ids.items())
    )
    for job in ids:
        assert (await session.completion_for(job)).ok
    assert seen.keys() == ids.keys()
    assert all(value == data for value in seen.values()), "a COMPLETION came before its data"


async def deadlines(ctx: Ctx) -> None:
    """DP-2.6-4: between chunks; and (tcp) with a READ outstanding (issue 14, item 6)."""
    session = await ctx.open()
    sent = time.monotonic()
    job = await session.slow_write(deadline_ms=500)
    done = await session.completion_for(job, timeout=10)
    took = time.monotonic() - sent
    assert (done.state, done.status) == (St.FAILED, 4), done
    assert 0.45 <= took < PROMPT, took
    src, dst = await _buffers(session)
    assert (await session.run(K.COPY, src.span(), dst.span(), deadline_ms=0)).ok
    if isinstance(session.host, RawTcpHost):
        sent = time.monotonic()
        job, read, _ = await session.held_copy(deadline_ms=300)
        done = await session.completion_for(job, timeout=10)
        took = time.monotonic() - sent
        assert (done.state, done.status) == (St.FAILED, 4), done
        assert 0.25 <= took < PROMPT, f"DEADLINE_EXCEEDED after {took:.2f} s, a READ outstanding"
        await session.host.answer_read(read)


async def a_host_that_takes_no_completions(ctx: Ctx) -> None:
    """DP-2.6-6 (verbs): a host that posts no RECV and goes on sending SUBMITs.

    With CRC32C jobs, then with inline COPYs, which an agent may answer on a faster path
    than its other jobs: the bound holds for every COMPLETION, whichever path made it.
    """
    for kind in (Kind.CRC32C, Kind.COPY):
        await _no_completions_taken(ctx, kind)


async def _no_completions_taken(ctx: Ctx, kind: Kind) -> None:
    session = await ctx.open(queue_depth=1)
    host = session.host
    assert isinstance(host, RawVerbsHost)
    data = os.urandom(16)
    destination = (await session.region(16, WRITE)).span() if kind == Kind.COPY else wire.ZERO
    host.stop_reading()
    sent = 0
    state = await session.get()
    while state.state != session_pb2.SESSION_STATE_FAILED and sent < 8192:
        batch = [wire.submit_inline(session.next_id(), kind, data, destination) for _ in range(64)]
        await host.send_capsules(batch)
        sent += len(batch)
        await asyncio.sleep(0.01)  # the link posts what waited for room
        state = await session.get()
    state = await session.wait_state(session_pb2.SESSION_STATE_FAILED)
    assert state.state == session_pb2.SESSION_STATE_FAILED, f"{kind.name}: {sent} SUBMITs: {state}"
    assert state.error.code == 14, (kind.name, state)
    # On rxe the agent's SEND may also end by retries (its retransmit timer keeps
    # running through RNR waits), which ends the data plane all the same; on hardware
    # RNR is retried for ever and only the bound ends it. The bound's exact place is
    # tested on the pipeline (tests/unit/test_inline_runners.py).


async def late_answers_touch_nothing(ctx: Ctx) -> None:
    """DP-2.6-5 (tcp): a late READ answer for a cancelled job lands in no other job."""
    session = await ctx.open()
    host = session.host
    assert isinstance(host, RawTcpHost)
    job_a, read_a, dst_a = await session.held_copy()
    await session.send(wire.cancel(job_a))
    assert (await session.completion_for(job_a)).state == St.CANCELLED
    data = os.urandom(4096)
    src_b = await session.region(4096, READ, fill=data)
    dst_b = await session.region(4096, WRITE)
    job_b = await session.submit(K.COPY, src_b.span(), dst_b.span())
    read_b = await asyncio.wait_for(host.held.get(), WAIT)
    host.hold_reads = False
    garbage = b"\xee" * read_a.length
    await host.send(
        wire.frame(wire.Ft.READ_RESP, 0, read_b.req_id, length=4096) + data
        + wire.frame(wire.Ft.READ_RESP, 0, read_a.req_id, length=len(garbage)) + garbage
    )  # fmt: skip
    done = await session.completion_for(job_b)
    assert done.ok, done
    assert bytes(dst_b.view) == data, (
        "the late answer to a cancelled job's READ corrupted another job"
    )
    assert bytes(dst_a.view) == bytes(4096)


# ---------------------------------------------------------------- 2.7


async def output_bounded(ctx: Ctx) -> None:
    """DP-2.7-1."""
    session = await ctx.open()
    plain = (os.urandom(1000) + bytes(3000)) * 100  # 400 KB, compressible
    for codec, blob in (
        (wire.LZ4, lz4.frame.compress(plain)),
        (wire.ZSTD, zstandard.ZstdCompressor().compress(plain)),
    ):
        src = await session.region(len(blob), READ, fill=blob)
        dst = await session.region(100_000, WRITE)
        dst.view[:] = b"\xee" * 100_000
        done = await session.run(K.DECOMPRESS, src.span(), dst.span(), handle=codec)
        assert (done.state, done.status) == (St.FAILED, 3), done
        written = done.bytes_written
        assert written <= 100_000
        assert bytes(dst.view[:written]) == plain[:written]
        assert bytes(dst.view[written:]) == b"\xee" * (100_000 - written), (
            "written past bytes_written"
        )
    noise = os.urandom(3 * CHUNK)
    src = await session.region(len(noise), READ, fill=noise)
    dst = await session.region(CHUNK, WRITE)
    done = await session.run(K.COMPRESS, src.span(), dst.span(), handle=wire.ZSTD)
    assert (done.state, done.status) == (St.FAILED, 3), done
    assert done.bytes_written <= CHUNK, done


async def decrypt_tag(ctx: Ctx) -> None:
    """DP-2.7-2: the agent's status, and the SDK's refusal to hand the bytes over."""
    session = await ctx.open()
    key = os.urandom(16)
    handle = await session.key(key)
    plain = os.urandom(3 * CHUNK)
    nonce = os.urandom(12)
    box = bytearray(nonce + AESGCM(key).encrypt(nonce, plain, None))
    box[-1] ^= 1
    src = await session.region(len(box), READ, fill=bytes(box))
    dst = await session.region(len(plain), WRITE)
    done = await session.run(K.DECRYPT, src.span(), dst.span(), handle=handle)
    assert (done.state, done.status) == (St.FAILED, 15), done
    short = await session.run(K.DECRYPT, src.span(0, 27), dst.span(), handle=handle)
    assert (short.state, short.status) == (St.FAILED, 3), short
    async with host_client.Client(ctx.agent().address) as client:
        sdk = await client.open_session(transport=ctx.transport, rdma_device=ctx.device)
        async with sdk:
            key_handle = await sdk.register_key(key)
            source = await sdk.alloc(len(box), readable=True)
            source.view[:] = bytes(box)
            out = await sdk.alloc(len(plain), writable=True)
            try:
                await sdk.compute("decrypt", source, out, parameter=key_handle)
            except host_client.DataLossError:
                return
            raise AssertionError("the SDK returned a DECRYPT whose tag did not verify")


async def zstd_window(ctx: Ctx) -> None:
    """DP-2.7-3."""
    session = await ctx.open()
    blob = _zstd_frame(b"a" * 1000, window_log=25)
    src = await session.region(len(blob), READ, fill=blob)
    dst = await session.region(4096, WRITE)
    done = await session.run(K.DECOMPRESS, src.span(), dst.span(), handle=wire.ZSTD)
    assert (done.state, done.status) == (St.FAILED, 3), done
    blob = _zstd_frame(b"a" * 1000, window_log=24)
    src = await session.region(len(blob), READ, fill=blob)
    assert (await session.run(K.DECOMPRESS, src.span(), dst.span(), handle=wire.ZSTD)).ok


async def one_frame(ctx: Ctx) -> None:
    """DP-2.7-4: bytes after the frame fail the job, in the frame's chunk or a later one."""
    session = await ctx.open()
    plain = os.urandom(1000) * 8
    dst = await session.region(len(plain) + 4096, WRITE)
    for codec, frame in (
        (wire.LZ4, lz4.frame.compress(plain)),
        (wire.ZSTD, zstandard.ZstdCompressor().compress(plain)),
    ):
        src = await session.region(len(frame), READ, fill=frame)
        done = await session.run(K.DECOMPRESS, src.span(), dst.span(), handle=codec)
        assert done.ok, done
        assert done.result == len(plain), done
        for after in (b"TRAILING", frame, b"\0" * (CHUNK + 1)):
            blob = frame + after
            src = await session.region(len(blob), READ, fill=blob)
            done = await session.run(K.DECOMPRESS, src.span(), dst.span(), handle=codec)
            assert (done.state, done.status) == (St.FAILED, 3), (codec, len(after), done)
            assert bytes(dst.view[: done.bytes_written]) == plain[: done.bytes_written]


def _zstd_frame(data: bytes, window_log: int) -> bytes:
    """A frame that asks for a 2**window_log window (streamed: no size to shrink it to)."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return stream.compress(data) + stream.flush()


_ = Kind
