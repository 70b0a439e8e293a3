"""Per-request context: the request id and RPC method (for logs) and the caller's principal."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpu_agent.auth import Principal

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""Request id of the RPC being served ("" outside an RPC)."""

rpc_method: contextvars.ContextVar[str] = contextvars.ContextVar("rpc_method", default="")
"""Full method name of the RPC being served, e.g. "/dpu.v1.AgentService/GetAgentInfo"."""

principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "principal", default=None
)
"""Who makes the RPC being served: set by the interceptor (`dpu_agent.auth` reads it)."""
