"""The one place domain errors become status codes: for gRPC calls and for completions.

`dpu_agent.interceptor` uses `status_for` to abort RPCs; the data plane uses
`code_for` to fill the status of a completion capsule (the same numbers).
scripts/gen_api_docs.py writes the status-code table of docs/api.md from `STATUS_FOR`,
`OTHER_CODES` and the domain errors' docstrings.
"""

from __future__ import annotations

from typing import Final

import grpc

from dpu_agent import errors

STATUS_FOR: Final[dict[type[errors.AgentError], grpc.StatusCode]] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.DataLoss: grpc.StatusCode.DATA_LOSS,
    errors.NotImplementedYet: grpc.StatusCode.UNIMPLEMENTED,
}


FOR_OTHER_ERRORS: Final = grpc.StatusCode.INTERNAL
"""The code of any exception that is not a domain error."""

# Codes the API answers that no domain error maps to, and what they mean.
OTHER_CODES: Final[dict[grpc.StatusCode, str]] = {
    grpc.StatusCode.INTERNAL: (
        "Any other error: a bug in the agent. The message is only "
        "`internal error (request id ...)`; the agent's log has the details under that "
        "request id."
    ),
}


def status_for(exc: errors.AgentError) -> grpc.StatusCode:
    """GRPC status code for a domain error (the nearest mapped base class wins)."""
    for cls in type(exc).__mro__:
        code = STATUS_FOR.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN


def code_for(exc: BaseException) -> int:
    """The numeric status code for any error: domain errors mapped, others INTERNAL."""
    if isinstance(exc, errors.AgentError):
        return int(status_for(exc).value[0])
    return int(FOR_OTHER_ERRORS.value[0])


OK: Final = 0
CANCELLED: Final = int(grpc.StatusCode.CANCELLED.value[0])
INVALID_ARGUMENT: Final = int(grpc.StatusCode.INVALID_ARGUMENT.value[0])
RESOURCE_EXHAUSTED: Final = int(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
UNAVAILABLE: Final = int(grpc.StatusCode.UNAVAILABLE.value[0])
DEADLINE_EXCEEDED: Final = int(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
INTERNAL: Final = int(grpc.StatusCode.INTERNAL.value[0])
