"""How each job kind runs: a generator per job that yields the operations it needs.

A runner is written as straight-line code (`for chunk: READ it; process it; WRITE it`)
and yields one operation at a time; the session's pipeline (`pipeline.Pipeline`) posts
it and resumes the generator with its result once it finished. No asyncio task, no
future per job: resuming a generator costs well under a microsecond.

The operations:

- `Read` / `Write`: an RDMA READ into / WRITE from a staging buffer. `Write(last=True)`
  is a job's final WRITE: a capsule job posts it unsignalled and its COMPLETION's SEND
  right behind it (RC ordering makes the data land first), a SubmitJob job waits for it.
- `Work`: a function for a compute worker thread (CPU-heavy: transforms, hashes and
  CRCs of large chunks), resumed with its result.
- `Io`: a storage call, run inline when it cannot block for long (a small read or
  write to the page cache), else on a storage worker thread.
- `BatchWrite`: a small write that need not be durable yet. The pipeline gathers the
  pass's BatchWrites and makes one `Storage.write_batch` call for them at the end of the
  pass (or before its next storage call, so a session's store calls keep their order):
  the store then allocates, reserves log room and takes its lock once for all of them.
- `Together`: several READs, WRITEs and a Work at once (a transform's next READ and
  last WRITE while the worker transforms a chunk), resumed when all have finished.
- `Sleep`: wait (a QoS throttle) without holding anything but the job's buffers.

A source that came inline in the SUBMIT (data-plane.md 2.8) is already in the job's
memory (`JobRecord.inline`). Kinds that only consume their source (CRC-32C, volume
writes: `BUFFERLESS_INLINE`) read it there, with no staging buffer and no copy; the
others READ it into their buffer like any source (the pipeline copies it, no
operation is posted), because what they WRITE back must be in registered memory.

Cancellation and deadlines are the pipeline's: it stops resuming a generator whose job
ended. An operation already posted always completes before its buffer is reused.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol, TypeAlias

from dpu_agent.dataplane import compute
from dpu_agent.errors import InvalidArgument, NotFound
from dpu_wire.jobkinds import SHA256_BYTES, JobKind

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Sequence

    from dpu_agent.dataplane.jobs import JobRecord
    from dpu_agent.dataplane.staging import Buffer
    from dpu_agent.errors import AgentError
    from dpu_agent.storage.qos import Reservation

INLINE_BYTES: Final = 64 << 10  # CRC, hash and storage calls up to this size run inline


class Read(NamedTuple):
    """RDMA READ `length` bytes at host (`addr`, `rkey`) into `buffer[offset:]`."""

    buffer: Buffer
    offset: int
    length: int
    addr: int
    rkey: int


class Write(NamedTuple):
    """RDMA WRITE `buffer[offset:offset+length]` to host (`addr`, `rkey`)."""

    buffer: Buffer
    offset: int
    length: int
    addr: int
    rkey: int
    last: bool = False


class Work(NamedTuple):
    """Call `fn()` on a compute worker."""

    fn: Callable[[], Any]


class Io(NamedTuple):
    """Call `fn()` (a storage call): inline, or on a storage worker when `blocking`."""

    fn: Callable[[], Any]
    blocking: bool


class BatchWrite(NamedTuple):
    """Write whole blocks (not durably) with the pass's other BatchWrites; resumed with None."""

    volume_id: str
    offset: int
    view: memoryview


class Together(NamedTuple):
    """Start these operations at once; resumed with their results once all have finished.

    READs, WRITEs that are not a job's last, and at most one Work; the results come in
    the operations' order (None for a READ or WRITE), or the first error is thrown.
    """

    ops: tuple[Read | Write | Work, ...]


class Sleep(NamedTuple):
    """Wait `seconds`."""

    seconds: float


Op = Read | Write | Work | Together | Io | BatchWrite | Sleep
Runner: TypeAlias = "Generator[Op, Any, None]"


class Storage(Protocol):
    """What volume runners need from the session: the store, scoped to its tenant."""

    def write(self, volume_id: str, offset: int, data: memoryview, *, fua: bool) -> None:
        """Store whole blocks (durable when `fua`)."""

    def write_batch(self, writes: Sequence[tuple[str, int, memoryview]]) -> list[AgentError | None]:
        """Several non-durable writes in order (`VolumeStore.write_batch`): each one's error."""

    def read_into(self, volume_id: str, offset: int, view: memoryview) -> None:
        """Load whole blocks into `view` (CRC checked)."""

    def flush(self, volume_id: str) -> None:
        """Make what was written durable."""

    def trim(self, volume_id: str, offset: int, length: int) -> None:
        """Forget whole blocks."""

    def throttle(self, volume_id: str, op: str, nbytes: int) -> Reservation:
        """This I/O's QoS reservation: `wait` seconds before it, `give_back()` if not done."""


BUFFERLESS_INLINE: Final = frozenset({JobKind.CRC32C, JobKind.VOLUME_WRITE})
"""Kinds whose runner uses an inline source where it is, taking no staging buffer."""


PIPELINED: Final = 4
"""Buffers of a transform whose source is longer than one: two for input, two for output."""


def pipelined(job: JobRecord, buffer_size: int) -> bool:
    """Whether the job's runner overlaps its steps, given `PIPELINED` buffers of this size."""
    return job.row.compute and job.kind != JobKind.SHA256 and job.source.length > buffer_size


def buffers_needed(job: JobRecord) -> tuple[int, int]:
    """(largest single transfer, number of buffers) the job's runner asks for."""
    kind = job.kind
    if kind in (JobKind.VOLUME_FLUSH, JobKind.VOLUME_TRIM):
        return 0, 0
    if job.inline and kind in BUFFERLESS_INLINE:
        return 0, 0
    largest = max(job.source.length, job.destination.length)
    if job.row.compute and kind != JobKind.SHA256:
        return largest, 2  # input and output
    return largest, 1


STORAGE_KINDS: Final = frozenset(
    {JobKind.VOLUME_WRITE, JobKind.VOLUME_READ, JobKind.VOLUME_FLUSH, JobKind.VOLUME_TRIM}
)
"""Kinds whose runner calls the volume store (`Io`, `BatchWrite`).

A runner has one storage call in flight at a time, and the pipeline gives each such job
one of its session's `queue_depth` storage slots before it starts: the slot comes back
once the job ended and its call returned, so a session never has more than
`queue_depth` calls queued or running, also when its jobs end before their calls do.
"""


def _chunks(total: int, step: int) -> list[tuple[int, int]]:
    return [(offset, min(step, total - offset)) for offset in range(0, total, step)]


def _source_chunks(job: JobRecord, buffers: list[Buffer]) -> list[tuple[int, int]]:
    """The source's chunks: a buffer each, or one for an inline source used in place."""
    total = job.source.length
    return _chunks(total, buffers[0].size if buffers else total)


def _source(
    job: JobRecord, buffers: list[Buffer], offset: int, size: int
) -> Generator[Op, Any, memoryview]:
    """The source's bytes at `offset`: READ into the job's buffer, or inline ones in place.

    A job without a buffer is an inline one of `BUFFERLESS_INLINE`.
    """
    if not buffers:
        return memoryview(job.inline)[offset : offset + size]
    buffer, src = buffers[0], job.source
    yield Read(buffer, 0, size, src.addr + offset, src.rkey)
    return buffer.view[:size]


def copy(job: JobRecord, buffers: list[Buffer], _store: Storage | None) -> Runner:
    """READ the source chunk by chunk, WRITE each chunk to the destination."""
    buffer = buffers[0]
    src, dst = job.source, job.destination
    total = src.length
    for offset, size in _chunks(total, buffer.size):
        yield Read(buffer, 0, size, src.addr + offset, src.rkey)
        job.bytes_read += size
        yield Write(buffer, 0, size, dst.addr + offset, dst.rkey, offset + size == total)
        job.bytes_written += size


def crc32c(job: JobRecord, buffers: list[Buffer], _store: Storage | None) -> Runner:
    """CRC-32C of the source; the result in the low 32 bits."""
    crc = 0
    for offset, size in _source_chunks(job, buffers):
        view = yield from _source(job, buffers, offset, size)
        job.bytes_read += size
        if size <= INLINE_BYTES:
            crc = compute.crc32c(view, crc)
        else:
            crc = yield Work(_bind(compute.crc32c, view, crc))
    job.result = crc


def sha256(job: JobRecord, buffers: list[Buffer], _store: Storage | None) -> Runner:
    """SHA-256 of the source, WRITTEN (32 bytes) to the start of the destination."""
    buffer = buffers[0]
    src, dst = job.source, job.destination
    digest = compute.sha256()
    for offset, size in _chunks(src.length, buffer.size):
        yield Read(buffer, 0, size, src.addr + offset, src.rkey)
        job.bytes_read += size
        view = buffer.view[:size]
        if size <= INLINE_BYTES:
            digest.update(view)
        else:
            yield Work(_bind(digest.update, view))
    job.digest = digest.digest()
    buffer.view[:SHA256_BYTES] = job.digest
    yield Write(buffer, 0, SHA256_BYTES, dst.addr, dst.rkey, last=True)
    job.bytes_written = SHA256_BYTES
    job.result = SHA256_BYTES


class _Output:
    """A transform's output buffers: the worker fills one while the other is WRITTEN.

    With one buffer, a full buffer is WRITTEN at once and the runner waits for it. With
    two, a full buffer's WRITE (`pending`) goes out with the next step's operations
    while the worker fills the other one.
    """

    def __init__(self, job: JobRecord, outbufs: list[Buffer]) -> None:
        self.job = job
        self.bufs = outbufs
        self.step = outbufs[0].size
        self.filling = 0  # the buffer being filled
        self.held = 0  # its bytes
        self.produced = 0  # output bytes so far: written, pending and held
        self.pending: Write | None = None  # a full buffer's WRITE, not posted yet

    def check(self, more: int) -> None:
        """Fail the job before `more` output bytes past the destination are written."""
        dst = self.job.destination
        if self.produced + more > dst.length:
            raise InvalidArgument(
                f"{self.job.row.field}: the output does not fit the destination "
                f"({dst.length} bytes)"
            )

    def _write(self, *, last: bool = False) -> Write:
        """The WRITE of the buffer being filled; the next one is filled from now on."""
        dst = self.job.destination
        at = dst.addr + self.produced - self.held
        write = Write(self.bufs[self.filling], 0, self.held, at, dst.rkey, last)
        self.held = 0
        self.filling = (self.filling + 1) % len(self.bufs)
        return write

    def _placed(self, count: int) -> Runner:
        """`count` bytes were placed in the buffer being filled; WRITE it once full."""
        self.held += count
        self.produced += count
        if self.held < self.step:
            return
        yield from self.flush()  # the other buffer, full too: its WRITE goes first
        self.pending = self._write()
        if len(self.bufs) == 1:
            yield from self.flush()

    def flush(self) -> Runner:
        """WRITE the pending full buffer now."""
        if self.pending is not None:
            write, self.pending = self.pending, None
            yield write
            self.job.bytes_written += write.length

    def put(self, data: bytes | memoryview) -> Runner:
        """Copy `data` in (a frame's first or last bytes, what a worker could not place)."""
        self.check(len(data))
        view = memoryview(data)
        while view:
            take = min(self.step - self.held, len(view))
            self.bufs[self.filling].view[self.held : self.held + take] = view[:take]
            view = view[take:]
            yield from self._placed(take)

    def feed(
        self, kernel: compute.Transform, data: memoryview | bytes, read: Read | None, *, last: bool
    ) -> Runner:
        """Feed `data` on a worker, which places the output in the buffer being filled.

        `read` (the next chunk) and the pending WRITE go on at the same time.
        """
        room = self.bufs[self.filling].view[self.held : self.step]
        work = Work(functools.partial(kernel.feed_into, data, room, self.step, last=last))
        write, self.pending = self.pending, None
        others = tuple(op for op in (read, write) if op is not None)
        written = 0 if write is None else write.length
        try:
            if others:
                placed, rest = (yield Together((work, *others)))[0]
            else:
                placed, rest = yield work
        except Exception:
            self.job.bytes_written += written  # the WRITE finished, whatever the Work gave
            raise
        self.job.bytes_written += written
        self.check(placed + len(rest))
        yield from self._placed(placed)
        yield from self.put(rest)

    def finish(self) -> Runner:
        """WRITE what is left, the job's last WRITE last."""
        yield from self.flush()
        if self.held:
            write = self._write(last=True)
            yield write
            self.job.bytes_written += write.length


def transform(job: JobRecord, buffers: list[Buffer], _store: Storage | None) -> Runner:
    """COMPRESS, DECOMPRESS, ENCRYPT, DECRYPT: stream the source through a transform.

    The output is WRITTEN to the destination as it fills a staging buffer; output past
    the destination's length fails the job (INVALID_ARGUMENT) with what fit written.
    The worker places each chunk's output in that buffer itself (`Transform.feed_into`),
    so the reactor copies only what overflows it. With four buffers (a source of more
    than one chunk, `PIPELINED`), two for input and two for output, the READ of the next
    chunk and the WRITE of the last full output go on while the worker transforms a
    chunk: a long job takes about the time of the slowest of the three, not their sum.
    """
    half = len(buffers) // 2
    inbufs, outbufs = buffers[:half], buffers[half:]
    src = job.source
    kernel = compute.transform(job.kind, job.parameter, job.key, src.length)
    out = _Output(job, outbufs)
    yield from out.put(kernel.start())
    chunks = _chunks(src.length, inbufs[0].size)
    ahead = len(inbufs) > 1
    for k, (offset, size) in enumerate(chunks):
        inbuf = inbufs[k % len(inbufs)]
        if k == 0 or not ahead:
            yield Read(inbuf, 0, size, src.addr + offset, src.rkey)
            job.bytes_read += size
        read = None
        if ahead and k + 1 < len(chunks):  # the other input buffer: the worker reads this one
            at, length = chunks[k + 1]
            read = Read(inbufs[(k + 1) % 2], 0, length, src.addr + at, src.rkey)
        last = offset + size == src.length
        yield from out.feed(kernel, inbuf.view[:size], read, last=last)
        if read is not None:
            job.bytes_read += read.length
        while kernel.more():
            yield from out.feed(kernel, b"", None, last=last)
    yield from out.put(kernel.finish())  # a few bytes and a check: no worker round trip
    yield from out.finish()
    job.result = out.produced


def volume_write(job: JobRecord, buffers: list[Buffer], store: Storage | None) -> Runner:
    """READ the source chunk by chunk into the volume at `offset`; FUA: then durable."""
    storage = _require(store)
    src = job.source
    for offset, size in _source_chunks(job, buffers):
        yield from _throttle(storage, job, "write", size)
        view = yield from _source(job, buffers, offset, size)
        job.bytes_read += size
        last_fua = job.fua and offset + size == src.length
        if last_fua or size > INLINE_BYTES:
            yield Io(
                _bind_write(storage, job.volume_id, job.offset + offset, view, fua=last_fua),
                blocking=True,
            )
        else:
            yield BatchWrite(job.volume_id, job.offset + offset, view)


def volume_read(job: JobRecord, buffers: list[Buffer], store: Storage | None) -> Runner:
    """Load the volume at `offset` chunk by chunk (CRC checked) and WRITE it to the host."""
    buffer = buffers[0]
    storage = _require(store)
    dst = job.destination
    total = dst.length
    for offset, size in _chunks(total, buffer.size):
        yield from _throttle(storage, job, "read", size)
        view = buffer.view[:size]
        yield Io(_bind_read(storage, job.volume_id, job.offset + offset, view), size > INLINE_BYTES)
        yield Write(buffer, 0, size, dst.addr + offset, dst.rkey, offset + size == total)
        job.bytes_written += size


def volume_flush(job: JobRecord, _buffers: list[Buffer], store: Storage | None) -> Runner:
    """Everything written to the volume is on stable storage."""
    yield Io(_bind(_require(store).flush, job.volume_id), blocking=True)


def volume_trim(job: JobRecord, _buffers: list[Buffer], store: Storage | None) -> Runner:
    """The range reads as zeros afterwards; one write operation for QoS (no bytes)."""
    storage = _require(store)
    yield from _throttle(storage, job, "write", 0)
    yield Io(_bind(storage.trim, job.volume_id, job.offset, job.length), blocking=True)


RUNNERS: Final[dict[JobKind, Callable[[JobRecord, list[Buffer], Storage | None], Runner]]] = {
    JobKind.COPY: copy,
    JobKind.CRC32C: crc32c,
    JobKind.VOLUME_WRITE: volume_write,
    JobKind.VOLUME_READ: volume_read,
    JobKind.VOLUME_FLUSH: volume_flush,
    JobKind.VOLUME_TRIM: volume_trim,
    JobKind.SHA256: sha256,
    JobKind.COMPRESS: transform,
    JobKind.DECOMPRESS: transform,
    JobKind.ENCRYPT: transform,
    JobKind.DECRYPT: transform,
}
assert set(RUNNERS) == set(JobKind)  # noqa: S101 - every kind runs, checked at import


def crc32c_now(job: JobRecord) -> None:
    """`crc32c` for an inline source of at most `INLINE_BYTES`, in one call."""
    job.bytes_read = len(job.inline)
    job.result = compute.crc32c(job.inline)


IMMEDIATE: Final[dict[JobKind, Callable[[JobRecord], None]]] = {JobKind.CRC32C: crc32c_now}
"""Kinds whose job needs no operation when its source came inline (at most
`INLINE_BYTES`), and the one call that runs it."""


def immediate(job: JobRecord) -> Callable[[JobRecord], None] | None:
    """The call that runs `job` at once (`IMMEDIATE`), or None: it takes a runner.

    The pipeline calls it instead of stepping a runner: the same work without a run, a
    generator and its bookkeeping (about a fifth of the reactor's CPU per small CRC job
    on tcp).
    """
    if not job.inline or len(job.inline) > INLINE_BYTES:
        return None
    return IMMEDIATE.get(job.kind)


def queued_write(job: JobRecord) -> BatchWrite | None:
    """The one BatchWrite that is all of `job`, or None: it takes a runner.

    A VOLUME_WRITE whose source came inline (at most `INLINE_BYTES`) and that need not
    be durable is `volume_write`'s one chunk: its QoS wait, then one BatchWrite. The
    pipeline queues it for the pass's `write_batch` itself and ends the job with the
    result, without a run or a generator (a third of the reactor's CPU per 4 KiB write
    at QD1 over tcp went to the run).
    """
    if job.kind is not JobKind.VOLUME_WRITE or job.fua or not job.inline:
        return None
    if len(job.inline) > INLINE_BYTES:
        return None
    return BatchWrite(job.volume_id, job.offset, memoryview(job.inline))


def _throttle(storage: Storage, job: JobRecord, op: str, size: int) -> Runner:
    reservation = storage.throttle(job.volume_id, op, size)
    if reservation.wait > 0:
        try:
            yield Sleep(reservation.wait)
        except GeneratorExit:  # the job ended while it waited (`_end_run` closes the runner)
            reservation.give_back()  # its I/O is never done: later jobs must not wait for it
            raise


def _require(store: Storage | None) -> Storage:
    if store is None:
        raise NotFound("this agent has no volume store")
    return store


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:  # noqa: ANN401 - forwarded
    return lambda: fn(*args)


def _bind_write(
    storage: Storage, volume_id: str, offset: int, view: memoryview, *, fua: bool
) -> Callable[[], None]:
    return lambda: storage.write(volume_id, offset, view, fua=fua)


def _bind_read(
    storage: Storage, volume_id: str, offset: int, view: memoryview
) -> Callable[[], None]:
    return lambda: storage.read_into(volume_id, offset, view)
