"""Jobs: what a job is and its one-way state machine.

A job moves QUEUED → RUNNING → (SUCCEEDED | FAILED | CANCELLED), or straight from
QUEUED to FAILED/CANCELLED. `JobRecord.finish` is the only way into a final state and
refuses a second time, which is what makes a completion exactly-once. How each kind
runs is in `runners`; how a job is admitted, in `admission`.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Final

from dpu_agent import status
from dpu_wire import capsule
from dpu_wire.capsule import State
from dpu_wire.jobkinds import KINDS, JobKind

if TYPE_CHECKING:
    from dpu_wire.capsule import Span
    from dpu_wire.jobkinds import Kind


class Origin(enum.Enum):
    """How the job arrived, and so where its completion goes."""

    CAPSULE = "capsule"  # SEND on the data plane: the completion is SENT back too
    GRPC = "grpc"  # SubmitJob: the completion goes to watchers only


class JobState(enum.IntEnum):
    """dpu.v1.JobState numbers."""

    QUEUED = 1
    RUNNING = 2
    SUCCEEDED = 3
    FAILED = 4
    CANCELLED = 5


_FINAL: Final = {
    State.SUCCEEDED: JobState.SUCCEEDED,
    State.FAILED: JobState.FAILED,
    State.CANCELLED: JobState.CANCELLED,
}
"""A final capsule state -> its job state (a lookup: the enum call costs more)."""


class JobRecord:
    """One job of a session: what was asked, how far it got, how it ended."""

    __slots__ = (
        "bytes_read",
        "bytes_written",
        "cancel_requested",
        "deadline",
        "destination",
        "digest",
        "done",
        "end_ns",
        "fua",
        "inline",
        "job_id",
        "key",
        "kind",
        "length",
        "message",
        "offset",
        "origin",
        "parameter",
        "request_id",
        "result",
        "row",
        "rpc_request_id",
        "source",
        "start_ns",
        "state",
        "status",
        "submit_ns",
        "volume_id",
    )

    def __init__(  # noqa: PLR0913, PLR0917 - a job's fields
        self,
        job_id: int,
        kind: JobKind,
        source: Span,
        destination: Span,
        origin: Origin,
        deadline: float,
        *,
        request_id: str = "",
        rpc_request_id: str = "",
        volume_id: str = "",
        offset: int = 0,
        length: int = 0,
        fua: bool = False,
        parameter: int = 0,
        key: bytes = b"",
        submit_ns: int = 0,
        inline: bytes = b"",
    ) -> None:
        self.job_id = job_id
        self.kind = kind
        self.row: Kind = KINDS[kind]
        self.source = source
        self.destination = destination
        self.origin = origin
        self.deadline = deadline  # time.monotonic() by which it must finish
        self.request_id = request_id  # SubmitJob's idempotency key ("" for capsules)
        # x-request-id of the RPC that made the job: its SubmitJob, or its session's
        # OpenSession for capsule jobs ("" when none); completion events carry it
        self.rpc_request_id = rpc_request_id
        self.volume_id = volume_id  # volume kinds: the volume ("" for the others)
        self.offset = offset  # volume kinds: byte offset in the volume
        self.length = length  # VOLUME_TRIM: bytes to trim
        self.fua = fua  # VOLUME_WRITE: durable before the completion
        self.parameter = parameter  # COMPRESS/DECOMPRESS: the codec; ENCRYPT/DECRYPT: key handle
        self.key = key  # ENCRYPT/DECRYPT; never shown
        self.inline = inline  # an INLINE SUBMIT's source bytes (b"": the source is READ)
        self.submit_ns = submit_ns or time.time_ns()
        self.state = JobState.QUEUED
        self.start_ns = 0
        self.end_ns = 0
        self.status = 0
        self.message = ""
        self.bytes_read = 0
        self.bytes_written = 0
        self.result = 0
        self.digest = b""  # SHA256: the result
        self.cancel_requested = False
        self.done = False  # whether the job reached a final state (set by `finish` only)

    def __repr__(self) -> str:
        return f"JobRecord({self.job_id}, {self.kind.name}, {self.state.name})"

    def start(self) -> None:
        """QUEUED → RUNNING."""
        self.state = JobState.RUNNING
        self.start_ns = time.time_ns()

    def finish(self, state: State, code: int = status.OK, message: str = "") -> bool:
        """Enter a final state once; False if it already was final."""
        if self.done:
            return False
        self.done = True
        self.state = _FINAL[state]
        self.status = code
        self.message = message
        self.end_ns = time.time_ns()
        self.inline = b""  # a retained job keeps no source bytes
        if state != State.SUCCEEDED:
            self.result = 0
        return True

    def finish_at(self, start_ns: int, end_ns: int) -> None:
        """QUEUED → SUCCEEDED with the times the link's fast path measured."""
        self.done = True
        self.state = JobState.SUCCEEDED
        self.start_ns = start_ns
        self.end_ns = end_ns

    def encode_completion(self) -> bytes:
        """The COMPLETION capsule of a finished job."""
        return capsule.pack_completion(
            self.job_id,
            self.state,
            self.status,
            self.bytes_read,
            self.bytes_written,
            self.result,
            self.submit_ns,
            self.start_ns,
            self.end_ns,
            self.message,
        )

    @property
    def completion(self) -> capsule.Completion | None:
        """The completion of a finished job (None before), as the capsule carries it."""
        if not self.done:
            return None
        return capsule.Completion(
            job_id=self.job_id,
            state=State(int(self.state)),
            status=self.status,
            bytes_read=self.bytes_read,
            bytes_written=self.bytes_written,
            result=self.result,
            submit_ns=self.submit_ns,
            start_ns=self.start_ns,
            end_ns=self.end_ns,
            message=self.message,
        )
