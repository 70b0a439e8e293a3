"""The one admission path: a job request, from a SUBMIT capsule or from SubmitJob.

Both adapters build a `JobRequest` with the SUBMIT capsule's fields (SubmitJob's
converter resolves a volume name to its attachment handle first) and call `admit`,
which checks it in the order docs/data-plane.md section 2.5 gives and makes the job
record. The checks are driven by the job-kind table (`dpu_wire.jobkinds`), so a kind's
rules live in its row.

A span is checked against the session's advertised regions before any RDMA operation
touches it: on a real NIC an access with a bad rkey or out of bounds moves the queue
pair to the error state and kills the whole session, so a bad job must fail alone,
first.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple, Protocol

from dpu_agent.dataplane.jobs import JobRecord
from dpu_agent.errors import InvalidArgument
from dpu_wire.capsule import ZERO_SPAN, Span
from dpu_wire.jobkinds import CODECS, FLAG_FUA, FLAG_INLINE, KINDS, Handle
from dpu_wire.transport.base import Access

if TYPE_CHECKING:
    from dpu_agent.dataplane.jobs import Origin
    from dpu_agent.dataplane.regions import RegionTable
    from dpu_wire.jobkinds import Kind


class JobRequest(NamedTuple):
    """A job as the host asked for it: the SUBMIT capsule's fields."""

    job_id: int
    kind: int
    source: Span
    destination: Span
    deadline: float  # seconds from arrival; 0 = the agent's default
    offset: int = 0
    handle: int = 0
    length: int = 0
    flags: int = 0
    inline: bytes = b""  # FLAG_INLINE: the source's bytes, carried by the SUBMIT


class AdmissionContext(Protocol):
    """What admission reads from the session (all of it on the reactor thread)."""

    @property
    def regions(self) -> RegionTable:
        """The session's advertised regions."""

    @property
    def default_deadline(self) -> float:
        """Seconds a job gets when it names no deadline."""

    @property
    def inline_max(self) -> int:
        """The largest source a SUBMIT of this session may carry inline (0: none)."""

    def check_accepting(self) -> None:
        """FailedPrecondition unless ACTIVE; Unavailable while the agent drains."""

    def volume_of(self, handle: int) -> str | None:
        """The volume attached under `handle`, or None."""

    def key_of(self, handle: int) -> bytes | None:
        """The AES key registered under `handle`, or None."""


def admit(  # noqa: PLR0913 - the request and where it came from
    ctx: AdmissionContext,
    request: JobRequest,
    origin: Origin,
    *,
    request_id: str = "",
    rpc_request_id: str = "",
    submit_ns: int = 0,
) -> JobRecord:
    """The job record of a request that passes every check; a domain error otherwise.

    The queue-slot check is the caller's (it differs: a capsule beyond the credits is
    refused, a SubmitJob may wait for a slot).
    """
    ctx.check_accepting()
    row = KINDS.get(request.kind)  # type: ignore[call-overload]  # an int is a JobKind key
    if row is None:
        raise InvalidArgument(f"unknown job kind {request.kind}")
    kind = row.kind
    _check_unused(row, request)
    volume_id = _volume(ctx, row, request)
    _check_spans(ctx, row, request)
    key = _handle(ctx, row, request)
    deadline = request.deadline or ctx.default_deadline
    return JobRecord(
        request.job_id,
        kind,
        request.source,
        request.destination,
        origin,
        time.monotonic() + deadline,
        request_id=request_id,
        rpc_request_id=rpc_request_id,
        volume_id=volume_id,
        offset=request.offset,
        length=request.length,
        fua=bool(request.flags & FLAG_FUA),
        parameter=request.handle,
        key=key,
        submit_ns=submit_ns,
        inline=request.inline,
    )


def _check_unused(row: Kind, request: JobRequest) -> None:
    """A field the kind does not use must be 0 (spans are checked with the spans)."""
    if row.handle is Handle.NONE and request.handle:
        raise InvalidArgument(f"{row.field}: the handle field must be 0 for this kind")
    if not row.offset and request.offset:
        raise InvalidArgument(f"{row.field}: the offset field must be 0 for this kind")
    if not row.length and request.length:
        raise InvalidArgument(f"{row.field}: the length field must be 0 for this kind")


def _volume(ctx: AdmissionContext, row: Kind, request: JobRequest) -> str:
    if row.handle is not Handle.VOLUME:
        return ""
    found = ctx.volume_of(request.handle)
    if found is None:
        raise InvalidArgument(f"no volume is attached to this session with handle {request.handle}")
    return found


def _check_spans(ctx: AdmissionContext, row: Kind, request: JobRequest) -> None:
    what = row.field
    regions = ctx.regions
    if request.flags & FLAG_INLINE:  # only kinds with a source take it (the codec checked)
        _check_inline(ctx.inline_max, request)
    elif row.source:
        regions.check_span(request.source, Access.REMOTE_READ, "source")
    elif request.source != ZERO_SPAN:
        raise InvalidArgument(f"{what}: takes no source")
    if row.destination:
        regions.check_span(request.destination, Access.REMOTE_WRITE, "destination")
    elif request.destination != ZERO_SPAN:
        raise InvalidArgument(f"{what}: takes no destination")
    if row.same_length and request.destination.length != request.source.length:
        raise InvalidArgument(
            f"{what}: destination length {request.destination.length} differs from source "
            f"length {request.source.length}"
        )
    if row.destination and request.destination.length < row.min_destination:
        raise InvalidArgument(f"{what}: the destination must hold {row.min_destination} bytes")


def _check_inline(inline_max: int, request: JobRequest) -> None:
    """An INLINE source: addr and rkey 0, 1..inline_max bytes (data-plane.md 2.8)."""
    source = request.source
    if source.addr or source.rkey:
        raise InvalidArgument("source: an inline source has addr and rkey 0")
    if not inline_max:
        raise InvalidArgument("source: this session takes no inline data (inline_max 0)")
    if not 1 <= source.length <= inline_max:
        raise InvalidArgument(
            f"source: an inline source is 1..{inline_max} bytes, not {source.length}"
        )
    if len(request.inline) != source.length:  # the codec checked it for capsules
        raise InvalidArgument("source: the inline bytes do not match source.length")


def _handle(ctx: AdmissionContext, row: Kind, request: JobRequest) -> bytes:
    """Check a codec or key handle; the key it names (b"" for other kinds)."""
    if row.handle is Handle.CODEC and request.handle not in CODECS:
        raise InvalidArgument(f"unknown compression format {request.handle} (1 lz4, 2 zstd)")
    if row.handle is not Handle.KEY:
        return b""
    key = ctx.key_of(request.handle)
    if key is None:
        raise InvalidArgument(f"{row.field}: no key is registered under that handle")
    return key
