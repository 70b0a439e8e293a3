"""Host-side SDK of the DPU offload agent: async `Client`, blocking `SyncClient`.

import asyncio
from host_client import Client

async def main() -> None:
    async with Client("127.0.0.1:50051") as client:
        info = await client.agent_info()
        print(info.name, info.version)

asyncio.run(main())
"""

import os as _os
from importlib import metadata as _metadata

# gRPC core prints its own INFO lines to stderr (e.g. a raw "Handshake failed" line next
# to the SDK's own error that says what to change); keep its errors only, unless the
# user asked for more.
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from host_client._client import DEFAULT_TARGET, Client, default_target
from host_client._completion import Completion
from host_client._errors import (
    AlreadyExistsError,
    CancelledError,
    DataLossError,
    DeadlineExceededError,
    DpuError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
)
from host_client._events import (
    AgentStatus,
    CompletionEvent,
    EventSubscriber,
    Subscription,
    Telemetry,
)
from host_client._request_ids import request_id
from host_client._rpc import Stubs
from host_client._session import Buffer, BufferRef, Job, JobRequest, Session
from host_client._sync import SyncClient
from host_client._tls import TlsConfig

try:
    __version__ = _metadata.version("dpu-offload")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0.0.0+unknown"

__all__ = [
    "DEFAULT_TARGET",
    "AgentStatus",
    "AlreadyExistsError",
    "Buffer",
    "BufferRef",
    "CancelledError",
    "Client",
    "Completion",
    "CompletionEvent",
    "DataLossError",
    "DeadlineExceededError",
    "DpuError",
    "EventSubscriber",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "Job",
    "JobRequest",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "Session",
    "Stubs",
    "Subscription",
    "SyncClient",
    "Telemetry",
    "TlsConfig",
    "UnavailableError",
    "UnimplementedError",
    "__version__",
    "default_target",
    "request_id",
]
