"""A thin blocking wrapper over the async `Client`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Literal, Self, TypeVar

from host_client._client import Client

if TYPE_CHECKING:
    from collections.abc import Coroutine
    from types import TracebackType

    from dpu_wire.v1 import agent_pb2
    from host_client._tls import TlsConfig

_T = TypeVar("_T")


class SyncClient:
    """Blocking client: the same calls as `Client`, for scripts and REPLs.

        with SyncClient("127.0.0.1:50051") as client:
            print(client.agent_info().version)

    It runs the async client on a private event loop, so it must not be used
    from inside a running event loop (use `Client` there).
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = 10.0,
        tls: TlsConfig | Literal[False] | None = None,
        token: str | None = None,
    ) -> None:
        """Create a client for the agent at `target`; see `Client` (tls, token too)."""
        self._client = Client(target, timeout=timeout, tls=tls, token=token)
        self._runner: asyncio.Runner | None = None

    @property
    def target(self) -> str:
        """The agent address."""
        return self._client.target

    def __enter__(self) -> Self:
        if self._runner is not None:
            raise RuntimeError("SyncClient is already open (it is not re-entrant)")
        self._runner = asyncio.Runner()
        self._runner.run(self._client.__aenter__())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            try:
                runner.run(self._client.__aexit__(exc_type, exc, tb))
            finally:
                runner.close()

    def _run(self, coro: Coroutine[object, object, _T]) -> _T:
        if self._runner is None:
            coro.close()
            raise RuntimeError("SyncClient is not open: use `with SyncClient(...)`")
        return self._runner.run(coro)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """See `Client.wait_ready`."""
        self._run(self._client.wait_ready(timeout))

    def agent_info(self) -> agent_pb2.AgentInfo:
        """See `Client.agent_info`."""
        return self._run(self._client.agent_info())

    def health(self, service: str = "") -> str:
        """See `Client.health`."""
        return self._run(self._client.health(service))
