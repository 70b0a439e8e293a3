"""Per-request context carried through logs: the request id and the RPC method."""

from __future__ import annotations

import contextvars

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
"""Request id of the RPC being served ("" outside an RPC)."""

rpc_method: contextvars.ContextVar[str] = contextvars.ContextVar("rpc_method", default="")
"""Full method name of the RPC being served, e.g. "/dpu.v1.AgentService/GetAgentInfo"."""
