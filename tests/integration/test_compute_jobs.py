"""Compute jobs on host buffers through the agent (tcp), on both submission paths."""

import asyncio
import hashlib
import os
from pathlib import Path

import lz4.frame
import pytest
import pytest_asyncio
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import host_client
from dpu_wire.v1 import job_pb2
from tests.faults.common import rss_bytes, status_bytes
from tests.integration.conftest import start_agent

pytestmark = pytest.mark.asyncio

MiB = 1 << 20
DATA = (os.urandom(MiB // 2) + b"compressible text " * (MiB // 36))[:MiB]


@pytest_asyncio.fixture
async def session(agent):
    async with (
        host_client.Client(agent.address) as client,
        await client.open_session(transport="tcp") as opened,
    ):
        yield opened


async def buffers(session):
    src = await session.alloc(2 * MiB, readable=True)
    mid = await session.alloc(2 * MiB, readable=True, writable=True)
    out = await session.alloc(2 * MiB, writable=True)
    src.view[: len(DATA)] = DATA
    return src[0 : len(DATA)], mid, out


async def test_sha256_on_both_paths(session):
    src, mid, _ = await buffers(session)
    done = await session.compute("sha256", src, mid[0:32])
    assert done.bytes_read == len(DATA)
    assert done.bytes_written == 32
    assert mid.view[:32] == hashlib.sha256(DATA).digest()
    spec = job_pb2.JobSpec()
    spec.sha256.source.CopyFrom(src.region_ref())
    spec.sha256.destination.CopyFrom(mid[0:32].region_ref())
    rpc = (await (await session.submit_spec(spec))).raise_for_status()
    assert rpc.sha256 == hashlib.sha256(DATA).digest()


@pytest.mark.parametrize("fmt", ["lz4", "zstd"])
async def test_compress_then_decompress_round_trips(session, fmt):
    src, mid, out = await buffers(session)
    packed = await session.compute("compress", src, mid, parameter=fmt)
    size = packed.bytes_written
    assert 0 < size < len(DATA)
    frame = bytes(mid.view[:size])
    library = lz4.frame.decompress(frame) if fmt == "lz4" else zstandard.decompress(frame)
    assert library == DATA  # a standard frame any library reads
    unpacked = await session.compute("decompress", mid[0:size], out, parameter=fmt)
    assert unpacked.bytes_written == len(DATA)
    assert out.view[: len(DATA)] == DATA


async def test_encrypt_then_decrypt_and_tampering_is_data_loss(session):
    src, mid, out = await buffers(session)
    key = os.urandom(32)
    handle = await session.register_key(key)
    sealed = await session.compute("encrypt", src, mid, parameter=handle)
    size = sealed.bytes_written
    assert size == len(DATA) + 12 + 16
    blob = bytes(mid.view[:size])
    assert AESGCM(key).decrypt(blob[:12], blob[12:], None) == DATA  # standard layout
    opened = await session.compute("decrypt", mid[0:size], out, parameter=handle)
    assert opened.bytes_written == len(DATA)
    assert out.view[: len(DATA)] == DATA
    mid.view[100] ^= 0xFF
    with pytest.raises(host_client.DataLossError, match="authentication failed"):
        await session.compute("decrypt", mid[0:size], out, parameter=handle)


@pytest.mark.parametrize(
    ("kind", "parameter", "dst_len", "fragment"),
    [
        ("sha256", 0, 16, "must hold 32 bytes"),
        ("compress", 9, 2 * MiB, "unknown compression format 9"),
        ("encrypt", 77, 2 * MiB, "no key is registered"),
        ("encrypt", 0, 100, "does not fit the destination"),
        ("decompress", 2, 2 * MiB, "not a valid zstd frame"),
    ],
)
async def test_bad_compute_jobs_fail_clearly(session, kind, parameter, dst_len, fragment):
    src, _, out = await buffers(session)
    if kind == "encrypt" and parameter == 0:
        parameter = await session.register_key(os.urandom(16))
    with pytest.raises(host_client.InvalidArgumentError, match=fragment):
        await session.compute(kind, src, out[0:dst_len], parameter=parameter)


async def test_bad_key_sizes_are_refused_without_the_key_in_the_error(session):
    key = b"\x07" * 20
    with pytest.raises(host_client.InvalidArgumentError, match="16, 24 or 32 bytes") as info:
        await session.register_key(key)
    assert "\\x07" not in str(info.value)


def _reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


async def test_decompression_bombs_hold_bounded_agent_memory(agent, session):
    """Issue 14, item 2: four 8 KiB frames of 64 MiB each, at once, into 64 MiB
    destinations; the agent streams them a chunk at a time (its peak RSS grows by a few
    chunks, not by what the frames declare), and a bomb aimed at a small destination
    fails INVALID_ARGUMENT with what fit written."""
    size = 64 * MiB
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(size))
    assert len(bomb) < 8 << 10
    src = await session.alloc(len(bomb), readable=True)
    src.view[:] = bomb
    outs = [await session.alloc(size, writable=True) for _ in range(4)]
    for out in outs:
        out.view[:1] = b"\x01"  # a byte the job must overwrite
    pid = agent.proc.pid
    _reset_peak_rss(pid)
    before = rss_bytes(pid)
    done = await asyncio.gather(
        *(session.compute("decompress", src, out, parameter="zstd") for out in outs)
    )
    peak = status_bytes(pid, "VmHWM")
    assert [d.bytes_written for d in done] == [size] * 4
    assert all(out.view[:1] == b"\x00" and out.view[-1:] == b"\x00" for out in outs)
    grew_mib = (peak - before) / MiB
    print(f"agent peak RSS growth for four 64 MiB bombs: {grew_mib:.1f} MiB")  # noqa: T201
    assert grew_mib < 48, f"the agent's peak RSS grew {grew_mib:.0f} MiB for four bombs"
    with pytest.raises(host_client.InvalidArgumentError, match="does not fit the destination"):
        await session.compute("decompress", src, outs[0][0:MiB], parameter="zstd")


@pytest.fixture(scope="module")
def small_chunk_agent(tmp_path_factory):
    """An agent moving 64 KiB per operation: a 1 MiB job is 16 chunks, pipelined."""
    process = start_agent(
        tmp_path_factory.mktemp("chunks"), env={"DPU_AGENT_CHUNK_SIZE": str(64 << 10)}
    )
    yield process
    assert process.terminate() == 0, process.log_path.read_text()


async def test_jobs_of_many_chunks_overlap_their_steps_and_round_trip(small_chunk_agent):
    """Four at once, each taking four of the session's buffers in turn (two in, two out:
    the next READ and the last WRITE go on while the worker transforms a chunk)."""
    async with (
        host_client.Client(small_chunk_agent.address) as client,
        await client.open_session(transport="tcp") as session,
    ):
        key = await session.register_key(os.urandom(32))
        size = len(DATA)  # a little under 1 MiB: 16 chunks, the last one short
        src = await session.alloc(size, readable=True)
        src.view[:] = DATA
        kinds: list[tuple[str, int | str]] = [
            ("compress", "zstd"),
            ("compress", "lz4"),
            ("encrypt", key),
            ("encrypt", key),
        ]
        mids = [await session.alloc(2 * MiB, readable=True, writable=True) for _ in kinds]
        outs = [await session.alloc(2 * MiB, writable=True) for _ in kinds]
        packed = await asyncio.gather(
            *(
                session.compute(kind, src, mid, parameter=parameter)
                for (kind, parameter), mid in zip(kinds, mids, strict=True)
            )
        )
        undo = {"compress": "decompress", "encrypt": "decrypt"}
        opened = await asyncio.gather(
            *(
                session.compute(undo[kind], mid[0 : done.bytes_written], out, parameter=parameter)
                for (kind, parameter), mid, out, done in zip(kinds, mids, outs, packed, strict=True)
            )
        )
        for done, out in zip(opened, outs, strict=True):
            assert done.bytes_read > MiB // 4
            assert done.bytes_written == size
            assert out.view[:size] == DATA
        assert packed[2].bytes_written == size + 28
        assert packed[0].bytes_read == size
