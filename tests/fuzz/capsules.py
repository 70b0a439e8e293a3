"""Capsules for the data-plane fuzz: strategies, the answer each must get, and sending.

The protocol (dpu_wire/capsule.py, docs/data-plane.md) as the fuzz checks it:

- a capsule of at most MAX_CAPSULE (256) bytes gets exactly one COMPLETION, except a
  well-formed CANCEL, which gets none (the job it names completes as usual);
- the answer carries the header's job id, or 0 when the header is unreadable
  (shorter than 16 bytes or a bad magic);
- a capsule longer than MAX_CAPSULE ends the session (the receive buffers are 256
  bytes; on RDMA a longer SEND is a fatal queue-pair error, and the tcp transport
  does the same), and the agent says why in its log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from typing import TYPE_CHECKING, Final

from hypothesis import strategies as st

from dpu_wire import capsule
from dpu_wire.capsule import HEADER, MAGIC, SUBMIT_BODY, JobKind, Opcode
from tests.fuzz.proto_strategies import weighted

if TYPE_CHECKING:
    import host_client

HANG_S: Final = 10.0
U16: Final = 0xFFFF
BAD_CODES: Final = frozenset({"INTERNAL", "UNKNOWN"})
STRUCTURED: Final = "capsules/structured"
DAMAGED: Final = "capsules/damaged"
TARGETS: Final = (STRUCTURED, DAMAGED)


@dataclasses.dataclass(frozen=True)
class Target:
    """Real things a SUBMIT may name: host buffers, volume handles, key handles."""

    readable: tuple[capsule.Span, ...]
    writable: tuple[capsule.Span, ...]
    volumes: tuple[int, ...]  # handles of attached volumes (4096-byte blocks)
    keys: tuple[int, ...]

    @property
    def spans(self) -> tuple[capsule.Span, ...]:
        """Every buffer."""
        return self.readable + self.writable

    @property
    def handles(self) -> tuple[int, ...]:
        """Handles a SUBMIT may carry, and two that name nothing."""
        return (0, *self.volumes, *self.keys, 1, 2, 99)


def expected_answer(data: bytes) -> int | None:
    """The job id of the one COMPLETION the agent must send back, or None for none."""
    if len(data) < HEADER.size or data[:2] != MAGIC:
        return 0
    _magic, version, opcode, length, job_id = HEADER.unpack_from(data)
    well_formed = version == capsule.VERSION and length == len(data)
    if well_formed and opcode == Opcode.CANCEL and len(data) == capsule.CANCEL_SIZE:
        return None
    return int(job_id)


def _u(bits: int) -> st.SearchStrategy[int]:
    top = (1 << bits) - 1
    return st.one_of(st.sampled_from([0, 1, top - 1, top]), st.integers(0, top))


def _spans(target: Target) -> st.SearchStrategy[tuple[int, int, int]]:
    def inside(
        span: capsule.Span, offset: int, length: int, rkey_flip: int
    ) -> tuple[int, int, int]:
        return span.addr + offset, length, span.rkey ^ rkey_flip

    offsets = weighted((st.integers(0, 16).map(lambda n: n * 4096), 3), (st.integers(0, 70_000), 1))
    lengths = weighted(
        (st.sampled_from([1, 16, 32, 512, 4096, 8192, 65536]), 3),
        (st.integers(0, 70_000), 1),
        (_u(32), 1),
    )
    flips = weighted((st.just(0), 6), (_u(32), 1))
    real = st.builds(inside, st.sampled_from(target.spans), offsets, lengths, flips)
    anything = st.tuples(_u(64), _u(32), _u(32))
    return weighted((real, 4), (st.just((0, 0, 0)), 1), (anything, 1))


def job_ids() -> st.SearchStrategy[int]:
    """Mostly small host ids; the agent's id space and the extremes now and then."""
    return weighted(
        (st.integers(1, 1 << 20), 4),
        (st.sampled_from([0, capsule.AGENT_JOB_ID_BASE - 1, capsule.AGENT_JOB_ID_BASE]), 1),
        (_u(64), 1),
    )


def submits(target: Target) -> st.SearchStrategy[bytes]:
    """Structurally valid SUBMIT capsules (80 bytes) with random, mostly near-valid fields."""
    spans = _spans(target)

    def pack(job_id: int, kind: int, flags: int, deadline_ms: int, *rest: object) -> bytes:
        source, destination, offset, handle, reserved, length = rest
        return _pack_submit(
            job_id,
            kind,
            source,  # type: ignore[arg-type]
            destination,  # type: ignore[arg-type]
            flags=flags,
            deadline_ms=deadline_ms,
            offset=offset,  # type: ignore[arg-type]
            handle=handle,  # type: ignore[arg-type]
            reserved=reserved,  # type: ignore[arg-type]
            length=length,  # type: ignore[arg-type]
        )

    return st.builds(
        pack,
        job_ids(),
        weighted((st.sampled_from([int(k) for k in JobKind]), 6), (_u(16), 1)),
        weighted((st.just(0), 4), (st.just(capsule.FLAG_FUA), 1), (_u(16), 1)),
        weighted((st.just(0), 4), (st.integers(1, 20), 1), (_u(32), 1)),
        spans,
        spans,
        weighted((st.integers(0, 256).map(lambda n: n * 512), 3), (_u(64), 1)),
        weighted((st.sampled_from(target.handles), 4), (_u(32), 1)),
        weighted((st.just(0), 8), (_u(32), 1)),
        weighted((st.just(0), 2), (st.integers(0, 64).map(lambda n: n * 512), 2), (_u(64), 1)),
    )


def _pack_submit(
    job_id: int,
    kind: int,
    source: tuple[int, int, int] = (0, 0, 0),
    destination: tuple[int, int, int] = (0, 0, 0),
    *,
    flags: int = 0,
    deadline_ms: int = 0,
    offset: int = 0,
    handle: int = 0,
    reserved: int = 0,
    length: int = 0,
) -> bytes:
    header = HEADER.pack(MAGIC, capsule.VERSION, Opcode.SUBMIT, capsule.SUBMIT_SIZE, job_id)
    body = SUBMIT_BODY.pack(
        kind, flags, deadline_ms, *source, *destination, offset, handle, reserved, length
    )
    return header + body


def valid_submits(target: Target) -> st.SearchStrategy[bytes]:
    """SUBMIT capsules whose fields fit their kind: most of them are jobs that run."""

    @st.composite
    def draw(draw_: st.DrawFn) -> bytes:
        kind = draw_(st.sampled_from(list(JobKind)))
        size = draw_(st.integers(1, 16)) * 4096
        src = draw_(st.sampled_from(target.readable))
        dst = draw_(st.sampled_from(target.writable))
        source = (src.addr, size, src.rkey)
        destination = (dst.addr, size, dst.rkey)
        volume = {"handle": draw_(st.sampled_from(target.volumes))}
        at = {**volume, "offset": draw_(st.integers(0, 240)) * 4096}
        fua = draw_(st.sampled_from([0, capsule.FLAG_FUA]))
        fmt = draw_(st.sampled_from([1, 2]))
        key = draw_(st.sampled_from(target.keys))
        sealed = (dst.addr, size + 28, dst.rkey)  # AES-GCM adds a nonce and a tag
        fields: dict[JobKind, tuple[tuple[object, ...], dict[str, int]]] = {
            JobKind.COPY: ((source, destination), {}),
            JobKind.CRC32C: ((source,), {}),
            JobKind.VOLUME_WRITE: ((source,), {**at, "flags": fua}),
            JobKind.VOLUME_READ: (((0, 0, 0), destination), at),
            JobKind.VOLUME_FLUSH: ((), volume),
            JobKind.VOLUME_TRIM: ((), {**at, "length": size}),
            JobKind.SHA256: ((source, destination), {}),
            JobKind.COMPRESS: ((source, destination), {"handle": fmt}),
            JobKind.DECOMPRESS: ((source, destination), {"handle": fmt}),
            JobKind.ENCRYPT: ((source, sealed), {"handle": key}),
            JobKind.DECRYPT: ((source, sealed), {"handle": key}),
        }
        spans, rest = fields[kind]
        job_id = draw_(st.integers(1, 1 << 20))
        return _pack_submit(job_id, kind, *spans, **rest)  # type: ignore[arg-type]

    return draw()


def cancels() -> st.SearchStrategy[bytes]:
    """Well-formed CANCEL capsules (16 bytes) for any job id."""
    return st.builds(
        lambda job_id: HEADER.pack(
            MAGIC, capsule.VERSION, Opcode.CANCEL, capsule.CANCEL_SIZE, job_id
        ),
        job_ids(),
    )


def completions() -> st.SearchStrategy[bytes]:
    """COMPLETION capsules, which hosts must not send."""
    return st.builds(
        lambda job_id, state, status, message: capsule.Completion(
            job_id, capsule.State(state), status, message=message
        ).encode(),
        job_ids(),
        st.sampled_from([int(s) for s in capsule.State]),
        st.integers(0, U16),
        st.text(max_size=20),
    )


def _reheader(data: bytes, version: int, opcode: int, length_delta: int) -> bytes:
    length = max(0, min(0xFFFF_FFFF, len(data) + length_delta))
    return data[:2] + struct.pack("<BBI", version, opcode, length) + data[8:]


def structured(target: Target) -> st.SearchStrategy[bytes]:
    """Well-formed capsules of every opcode, and ones with one header field wrong."""
    good = weighted(
        (valid_submits(target), 4), (submits(target), 4), (cancels(), 2), (completions(), 1)
    )
    bad_header = st.builds(
        _reheader,
        good,
        weighted((st.just(capsule.VERSION), 3), (_u(8), 1)),
        weighted((st.sampled_from([int(o) for o in Opcode]), 3), (_u(8), 1)),
        weighted((st.just(0), 3), (st.integers(-80, 200), 1)),
    )
    return weighted((good, 4), (bad_header, 1))


def damaged(target: Target) -> st.SearchStrategy[bytes]:
    """Random bytes, and valid capsules flipped, cut short or extended (at most 256 bytes)."""
    good = weighted((valid_submits(target), 2), (submits(target), 2), (cancels(), 1))
    flipped = st.builds(
        lambda data, at, mask: (
            data[: at % len(data)]
            + bytes([data[at % len(data)] ^ mask])
            + data[at % len(data) + 1 :]
        ),
        good,
        st.integers(0, 255),
        st.integers(1, 255),
    )
    cut = st.builds(lambda data, n: data[:n], good, st.integers(0, 79))
    extended = st.builds(
        lambda data, tail: (data + tail)[: capsule.MAX_CAPSULE],
        good,
        st.binary(min_size=1, max_size=200),
    )
    return weighted(
        (st.binary(max_size=capsule.MAX_CAPSULE), 3),
        (flipped, 2),
        (cut, 1),
        (extended, 1),
        (st.builds(lambda body: MAGIC + body, st.binary(max_size=capsule.MAX_CAPSULE - 2)), 1),
    )


def rounds(batch: list[bytes]) -> list[list[bytes]]:
    """Split a batch into rounds whose answers can be told apart (distinct answer ids)."""
    answer_ids: list[set[int]] = []
    out: list[list[bytes]] = []
    for data in batch:
        answer = expected_answer(data)
        index = next(
            (i for i, ids in enumerate(answer_ids) if answer is None or answer not in ids),
            len(out),
        )
        if index == len(out):
            answer_ids.append(set())
            out.append([])
        if answer is not None:
            answer_ids[index].add(answer)
        out[index].append(data)
    return out


async def exchange(
    session: host_client.Session, batch: list[bytes]
) -> list[host_client.Completion | None]:
    """Send raw capsules on the session's data plane; wait for the answer each must get."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[host_client.Completion] | None] = []
    for data in batch:
        answer = expected_answer(data)
        future = None
        if answer is not None:
            future = loop.create_future()
            await session._credits.take()
            session._pending[answer] = (future, False)
        futures.append(future)
        session._link.send([data])
    async with asyncio.timeout(HANG_S):
        return [None if f is None else await f for f in futures]


def verdict(data: bytes, done: host_client.Completion | None) -> str | None:
    """Why an answer breaks the protocol, or None."""
    if done is None:
        return None
    if done.job_id != expected_answer(data):
        return f"answer for job {done.job_id}, expected {expected_answer(data)}"
    if done.code in BAD_CODES:
        return f"{done.code}: {done.message}"
    if done.state not in {"SUCCEEDED", "FAILED", "CANCELLED"}:
        return f"final state {done.state}"
    if (done.state == "SUCCEEDED") != (done.code == "OK"):
        return f"state {done.state} with status {done.code}"
    return None
