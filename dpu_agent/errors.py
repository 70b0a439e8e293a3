"""Domain errors of the agent.

Service code raises these; it never deals in gRPC status codes. The one place that
turns them into status codes is `dpu_agent.status`. Each class's docstring says what
its code means to a caller: scripts/gen_api_docs.py puts them in the status-code
table of docs/api.md, so write them for API users.

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
    """The request is malformed or contradictory.

    A malformed resource name, a value out of the range its field's comment gives, a
    page token of another request; the message names the field. The same request
    fails again: fix it first.
    """


class NotFound(AgentError):
    """A named resource does not exist.

    Another tenant's resource answers exactly as a missing one does.
    """


class AlreadyExists(AgentError):
    """A resource with that name already exists.

    The ids a caller chooses (volumes, snapshots, flow rules, functions) are one
    namespace per agent, so the holder may be another tenant.
    """


class FailedPrecondition(AgentError):
    """The system is not in a state that allows the call.

    A session that is not ACTIVE, a volume not attached to the session, a shrink that
    would drop written data, a transport or store this agent does not have: change
    the state first; retrying as is fails again.
    """


class ResourceExhausted(AgentError):
    """A queue, quota or capacity is full.

    A session's queue slots (SubmitJob without wait_for_slot), a tenant's quota (the
    message names it), the store's space, a request over its size or item bounds, a
    completion stream that fell behind. Retry later, or free something.
    """


class PermissionDenied(AgentError):
    """The caller may not do this.

    The caller is known but lacks the admin role the call needs, or a job's region
    does not grant the access the job needs.
    """


class Unauthenticated(AgentError):
    """The call carries no valid credentials.

    With `[auth] tokens_file` (plaintext loopback): no `authorization: Bearer`
    metadata, or a token the agent does not know. With mTLS: a client certificate
    without exactly one subject CN that is a valid tenant id. A plaintext call from
    an address other than loopback. Every dpu.v1 call needs credentials (GetAgentInfo
    too); health checks (`grpc.health.v1.Health`) and server reflection are answered
    without. Over mTLS a call with no client certificate, or one not signed by the
    agent's client CA, does not get this far: the TLS handshake fails and the client
    sees UNAVAILABLE.
    """


class Unavailable(AgentError):
    """A dependency is temporarily unreachable; the call may be retried.

    The agent is draining for shutdown, a session's data plane or the storage
    failed, a system tool or interface did not answer. (gRPC itself answers
    UNAVAILABLE when it cannot reach the agent or the TLS handshake fails.)
    """


class DeadlineExceeded(AgentError):
    """The work did not finish in the time allowed.

    A job past its deadline (its completion's status). gRPC answers it too when a
    call's own deadline passes.
    """


class Cancelled(AgentError):
    """The work was cancelled.

    A job cancelled by CancelJob, a CANCEL capsule or its session's close (its
    completion's status).
    """


class DataLoss(AgentError):
    """Stored data failed an integrity check or cannot be decoded; nothing is returned.

    A volume block whose CRC32C does not match, an AES-GCM tag that does not verify.
    """


class NotImplementedYet(AgentError):
    """The API defines the call but this agent version does not serve it.

    The message says why (a backend this agent was not configured with, for one).
    gRPC answers UNIMPLEMENTED too for a method the API does not define.
    """
