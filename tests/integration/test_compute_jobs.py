"""Compute jobs on host buffers through the agent (tcp), on both submission paths."""

import hashlib
import os

import lz4.frame
import pytest
import pytest_asyncio
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

import host_client
from dpu_wire.v1 import job_pb2

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
