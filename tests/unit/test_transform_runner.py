"""The transform runner over small staging buffers: every chunk boundary, outputs that
cross buffers, destinations that are too small and decompression bombs.

The runner is driven here as the pipeline drives it (READs filled from a host buffer,
Work called at once, WRITEs collected); the transport and the agent are tested end to
end in tests/integration/test_compute_jobs.py.
"""

from __future__ import annotations

import os
import threading
import types

import lz4.frame
import pytest
import zstandard
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dpu_agent.dataplane import compute, runners
from dpu_agent.errors import DataLoss, InvalidArgument
from dpu_wire.jobkinds import JobKind

STEP = 4096
KEY = bytes(range(32))
DATA = (os.urandom(20_000) + b"compressible text " * 3000)[:50_001]


class _Region:
    def __init__(self, size: int) -> None:
        self.view = memoryview(bytearray(size))


def _buffer(size: int) -> types.SimpleNamespace:
    region = _Region(size)
    return types.SimpleNamespace(region=region, offset=0, size=size, view=region.view)


LAYOUTS = [(2, False), (runners.PIPELINED, False), (runners.PIPELINED, True)]
LAYOUT_IDS = ["sequential", "pipelined", "pipelined-reversed"]


def run(
    kind: JobKind,
    source: bytes,
    dst_len: int,
    parameter: int = 0,
    *,
    buffers: int = 2,
    reverse: bool = False,
) -> tuple[bytes, int]:
    """(the bytes WRITTEN to the destination in order, the largest output one Work gave).

    `buffers`: 2 (one in, one out) or `runners.PIPELINED` (two of each, the steps
    overlapped); the operations of a Together run in their order, or in reverse (they
    must not depend on it: in the agent they run at the same time).
    """
    job = types.SimpleNamespace(
        kind=kind,
        parameter=parameter,
        key=KEY,
        source=types.SimpleNamespace(length=len(source), addr=0, rkey=1),
        destination=types.SimpleNamespace(length=dst_len, addr=0, rkey=2),
        row=types.SimpleNamespace(field="destination"),
        bytes_read=0,
        bytes_written=0,
        result=None,
    )
    bufs = [_buffer(STEP) for _ in range(buffers)]
    dest = bytearray(dst_len)
    gen = runners.transform(job, bufs, None)  # type: ignore[arg-type]
    value: object = None
    largest = 0
    last_seen = False
    read = written = 0

    def do(op: object) -> object:
        nonlocal largest, last_seen, read, written
        if isinstance(op, runners.Read):
            op.buffer.view[: op.length] = source[op.addr : op.addr + op.length]
            read += op.length
        elif isinstance(op, runners.Write):
            assert not last_seen, "a WRITE after the final one"
            last_seen = op.last
            dest[op.addr : op.addr + op.length] = op.buffer.view[op.offset : op.offset + op.length]
            written += op.length
        elif isinstance(op, runners.Work):
            placed, rest = result = op.fn()
            largest = max(largest, placed + len(rest))
            return result
        return None

    while True:
        try:
            op = gen.send(value)
        except StopIteration:
            break
        if isinstance(op, runners.Together):
            assert sum(isinstance(o, runners.Work) for o in op.ops) <= 1
            order = list(enumerate(op.ops))
            values = {i: do(o) for i, o in (reversed(order) if reverse else order)}
            value = tuple(values[i] for i in range(len(op.ops)))
        else:
            value = do(op)
    assert job.result == job.bytes_written == written
    assert job.bytes_read == read == len(source)
    return bytes(dest[: job.result]), largest


@pytest.mark.parametrize(("buffers", "reverse"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("size", [0, 1, STEP - 1, STEP, STEP + 1, 3 * STEP, len(DATA)])
@pytest.mark.parametrize("codec", [1, 2])
def test_compress_and_decompress_round_trip_at_every_boundary(size, codec, buffers, reverse):
    data = DATA[:size]
    layout = {"buffers": buffers, "reverse": reverse}
    packed, _ = run(JobKind.COMPRESS, data, 2 * len(data) + 1024, codec, **layout)
    library = lz4.frame.decompress if codec == 1 else zstandard.ZstdDecompressor().decompress
    assert library(packed) == data
    unpacked, largest = run(JobKind.DECOMPRESS, packed, max(size, 1), codec, **layout)
    assert unpacked == data
    assert largest <= STEP  # a decoder gives at most one buffer per call


@pytest.mark.parametrize(("buffers", "reverse"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("size", [0, 1, STEP - 28, STEP - 12, STEP, STEP + 1, len(DATA)])
def test_encrypt_and_decrypt_round_trip_at_every_boundary(size, buffers, reverse):
    data = DATA[:size]
    layout = {"buffers": buffers, "reverse": reverse}
    sealed, _ = run(JobKind.ENCRYPT, data, size + 28, **layout)
    assert len(sealed) == size + 28
    assert AESGCM(KEY).decrypt(sealed[:12], sealed[12:], None) == data
    opened, _ = run(JobKind.DECRYPT, sealed, max(size, 1), **layout)
    assert opened == data


def test_a_tampered_ciphertext_is_data_loss():
    sealed = bytearray(run(JobKind.ENCRYPT, DATA, len(DATA) + 28)[0])
    sealed[STEP + 5] ^= 1
    with pytest.raises(DataLoss, match="authentication failed"):
        run(JobKind.DECRYPT, bytes(sealed), len(DATA))


@pytest.mark.parametrize("buffers", [2, runners.PIPELINED])
@pytest.mark.parametrize("kind", [JobKind.ENCRYPT, JobKind.COMPRESS])
def test_output_past_the_destination_fails_the_job(kind, buffers):
    parameter = 2 if kind == JobKind.COMPRESS else 0
    with pytest.raises(InvalidArgument, match="does not fit the destination"):
        run(kind, os.urandom(3 * STEP), 2 * STEP, parameter, buffers=buffers)


@pytest.mark.parametrize("buffers", [2, runners.PIPELINED])
def test_a_decompression_bomb_stops_at_the_destination_a_buffer_at_a_time(buffers):
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))  # 64 MiB of zeros
    assert len(bomb) < 8 << 10
    with pytest.raises(InvalidArgument, match="does not fit the destination"):
        run(JobKind.DECOMPRESS, bomb, 10 * STEP, 2, buffers=buffers)


@pytest.mark.parametrize("codec", [1, 2])
@pytest.mark.parametrize("gap", [0, 1, STEP - 1, STEP, 2 * STEP])
def test_bytes_after_the_frame_fail_wherever_the_chunks_split(codec, gap):
    """DP-2.7-4: one frame; the bytes after it reach `gap` bytes past the next chunk boundary."""
    packed, _ = run(JobKind.COMPRESS, DATA, 2 * len(DATA), codec)
    end = -(-len(packed) // STEP) * STEP  # the chunk boundary at or after the frame
    pad = max(end - len(packed), 0) + gap + 1  # a byte past the boundary, `gap` later
    for after in (os.urandom(pad), packed):
        with pytest.raises(InvalidArgument, match="bytes after its"):
            run(JobKind.DECOMPRESS, packed + after, 2 * len(DATA), codec)


def test_one_shot_zstd_jobs_reuse_their_worker_threads_compressor():
    """A context made per job cost the agent page faults and a memset per 1 MiB job."""
    made = []
    real = zstandard.ZstdCompressor

    def counting(level: int) -> zstandard.ZstdCompressor:
        made.append(threading.current_thread().name)
        return real(level=level)

    def one_job(data: bytes) -> bytes:
        packed, _ = run(JobKind.COMPRESS, data, 2 * STEP, 2)
        return packed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zstandard, "ZstdCompressor", counting)
        mp.setattr(compute, "_local", threading.local(), raising=False)  # none made before
        outputs = [one_job(DATA[i : i + STEP // 2]) for i in range(5)]
        worker = threading.Thread(target=one_job, args=(DATA[: STEP // 2],), name="w2")
        worker.start()
        worker.join()
    assert made == [threading.current_thread().name, "w2"]  # one per thread, not per job
    for i, packed in enumerate(outputs):  # and the same frames a fresh one writes
        assert packed == real(level=compute.ZSTD_LEVEL).compress(DATA[i : i + STEP // 2])


@pytest.mark.parametrize("room", [0, 1, 16, 25, 40])
def test_encryption_places_its_output_in_the_buffer_it_is_given(room):
    """The worker encrypts into the job's staging buffer (update_into): no copy on the reactor."""
    kernel = compute.transform(JobKind.ENCRYPT, 0, KEY, 25)
    nonce = kernel.start()
    out = memoryview(bytearray(room))
    placed, rest = kernel.feed_into(DATA[:25], out, STEP, last=True)
    assert placed == min(room, 25)
    assert len(rest) == 25 - placed  # the rest only once the buffer is full
    sealed = bytes(out[:placed]) + bytes(rest) + kernel.finish()
    assert AESGCM(KEY).decrypt(nonce, sealed, None) == DATA[:25]


def test_a_transform_without_its_own_feed_into_places_what_fits():
    kernel = compute.transform(JobKind.COMPRESS, 2, KEY, len(DATA))
    out = memoryview(bytearray(100))
    placed, rest = kernel.feed_into(DATA, out, STEP, last=True)
    assert placed == 100
    packed = bytes(out) + bytes(rest) + kernel.finish()
    assert zstandard.ZstdDecompressor().decompress(packed) == DATA


def test_a_pipelined_job_reads_ahead_and_writes_behind_while_the_worker_runs():
    """With four buffers, each chunk's Work goes out with the next chunk's READ and the
    last full buffer's WRITE: a long job is bound by its slowest step, not their sum."""
    job = types.SimpleNamespace(
        kind=JobKind.ENCRYPT, parameter=0, key=KEY,
        source=types.SimpleNamespace(length=4 * STEP, addr=0, rkey=1),
        destination=types.SimpleNamespace(length=5 * STEP, addr=0, rkey=2),
        row=types.SimpleNamespace(field="destination"), bytes_read=0, bytes_written=0,
        result=None,
    )  # fmt: skip
    bufs = [_buffer(STEP) for _ in range(runners.PIPELINED)]
    gen = runners.transform(job, bufs, None)  # type: ignore[arg-type]
    shapes = []
    value = None
    while True:
        try:
            op = gen.send(value)
        except StopIteration:
            break
        ops = op.ops if isinstance(op, runners.Together) else (op,)
        shapes.append("+".join(type(o).__name__ for o in ops))
        results = [o.fn() if isinstance(o, runners.Work) else None for o in ops]
        value = tuple(results) if isinstance(op, runners.Together) else results[0]
    assert shapes == [
        "Read",  # the first chunk
        "Work+Read",  # chunk 1 transformed, chunk 2 read
        "Work+Read+Write",  # and the first full output buffer written
        "Work+Read+Write",
        "Work+Write",  # the last chunk
        "Write",  # the full buffer left
        "Write",  # the rest: nonce overflow and tag (the job's last)
    ]
