"""Per-request context: the request id and RPC method (for logs).

The caller's principal is `dpu_agent.auth.principal`, next to what it holds.
"""

from __future__ import annotations

import contextvars

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""Request id of the RPC being served ("" outside an RPC)."""

rpc_method: contextvars.ContextVar[str] = contextvars.ContextVar("rpc_method", default="")
"""Full method name of the RPC being served, e.g. "/dpu.v1.AgentService/GetAgentInfo"."""
