"""Domain errors of the agent.

Service code raises these; it never deals in gRPC status codes. The one place that
turns them into status codes is `dpu_agent.status`.

    AgentError
    ├── InvalidArgument      the request is malformed or contradictory
    ├── NotFound             a named resource does not exist
    ├── AlreadyExists        a resource with that name exists
    ├── FailedPrecondition   the system is not in a state that allows the call
    ├── ResourceExhausted    a queue, quota or capacity is full
    ├── PermissionDenied     the caller may not do this
    ├── Unauthenticated      the caller did not prove who it is
    ├── Unavailable          a dependency is (temporarily) unreachable; retry
    ├── DeadlineExceeded     the work did not finish in the time allowed
    ├── Cancelled            the work was cancelled
    ├── DataLoss             stored data is damaged (e.g. a CRC32C mismatch)
    └── NotImplementedYet    the API exists but this agent version does not serve it

Messages are shown to the caller: they must never contain secrets.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class of errors the agent reports to its caller."""


class InvalidArgument(AgentError):
    """The request is malformed or contradictory."""


class NotFound(AgentError):
    """A named resource does not exist."""


class AlreadyExists(AgentError):
    """A resource with that name already exists."""


class FailedPrecondition(AgentError):
    """The system is not in a state that allows the call."""


class ResourceExhausted(AgentError):
    """A queue, quota or capacity is full."""


class PermissionDenied(AgentError):
    """The caller may not do this."""


class Unauthenticated(AgentError):
    """The call carries no valid credentials (no bearer token, or an unknown one)."""


class Unavailable(AgentError):
    """A dependency is temporarily unreachable; the call may be retried."""


class DeadlineExceeded(AgentError):
    """The work did not finish in the time allowed."""


class Cancelled(AgentError):
    """The work was cancelled."""


class DataLoss(AgentError):
    """Stored data failed an integrity check or cannot be decoded; nothing is returned."""


class NotImplementedYet(AgentError):
    """The API defines the call but this agent version does not serve it."""
