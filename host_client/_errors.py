"""Errors the SDK raises. Every failed call raises a `DpuError` subclass.

DpuError                       code, message, request_id
├── InvalidArgumentError       INVALID_ARGUMENT, OUT_OF_RANGE
├── NotFoundError              NOT_FOUND
├── AlreadyExistsError         ALREADY_EXISTS
├── FailedPreconditionError    FAILED_PRECONDITION, ABORTED
├── ResourceExhaustedError     RESOURCE_EXHAUSTED
├── PermissionDeniedError      PERMISSION_DENIED, UNAUTHENTICATED
├── UnavailableError           UNAVAILABLE (agent unreachable or shutting down)
├── DeadlineExceededError      DEADLINE_EXCEEDED
├── CancelledError             CANCELLED
├── UnimplementedError         UNIMPLEMENTED (this agent does not serve the call)
├── DataLossError              DATA_LOSS (stored data failed its integrity check)
└── InternalError              INTERNAL, UNKNOWN
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, cast

import grpc

from dpu_wire import REQUEST_ID_METADATA_KEY

if TYPE_CHECKING:
    from collections.abc import Iterable


class DpuError(Exception):
    """A call to the agent failed.

    Attributes:
        code: the gRPC status code name, e.g. "NOT_FOUND".
        message: the agent's explanation.
        request_id: the id the call carried (also in the agent's logs).
    """

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(
            f"{code}: {message}" + (f" (request id {request_id})" if request_id else "")
        )
        self.code = code
        self.message = message
        self.request_id = request_id


class InvalidArgumentError(DpuError):
    """The request was malformed or contradictory."""


class NotFoundError(DpuError):
    """A named resource does not exist."""


class AlreadyExistsError(DpuError):
    """A resource with that name exists."""


class FailedPreconditionError(DpuError):
    """The agent is not in a state that allows the call."""


class ResourceExhaustedError(DpuError):
    """A queue, quota or capacity is full."""


class PermissionDeniedError(DpuError):
    """The caller may not do this."""


class UnavailableError(DpuError):
    """The agent could not be reached, or is shutting down; retrying may help."""


class DeadlineExceededError(DpuError):
    """The call did not finish in the time allowed."""


class CancelledError(DpuError):
    """The call was cancelled."""


class UnimplementedError(DpuError):
    """The agent does not serve this call."""


class DataLossError(DpuError):
    """Stored data failed its integrity check (e.g. a CRC32C mismatch); nothing was returned."""


class InternalError(DpuError):
    """The agent failed internally; its logs carry the request id."""


_ERROR_FOR: Final[dict[grpc.StatusCode, type[DpuError]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ABORTED: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDeniedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
}


def from_rpc_error(exc: grpc.aio.AioRpcError, request_id: str = "") -> DpuError:
    """Translate a failed gRPC call into the matching `DpuError`."""
    trailers = cast("Iterable[tuple[str, str | bytes]]", exc.trailing_metadata() or ())
    for key, value in trailers:
        if key == REQUEST_ID_METADATA_KEY and isinstance(value, str):
            request_id = value
    code = exc.code()
    cls = _ERROR_FOR.get(code, InternalError)
    return cls(code.name, exc.details() or "", request_id)
