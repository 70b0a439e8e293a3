"""Bounds on the streams anyone may hold open without credentials.

Health checks and server reflection answer without credentials (README "Security"),
and two of their calls stay open as long as the client likes: `grpc.health.v1.Health/
Watch` and `ServerReflectionInfo`. Each held stream costs the agent memory (about 15 KB
a Watch), so the number held at once is bounded, per client connection (the gRPC peer)
and in all; one more is answered RESOURCE_EXHAUSTED at once. The dpu.v1 streams need
credentials and have their own bounds (per session, DP-1.4-5).
"""

from __future__ import annotations

import collections
import contextlib
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import ResourceExhausted

if TYPE_CHECKING:
    from collections.abc import Iterator

MAX_STREAMS: Final = 256  # open at once, all connections together
MAX_STREAMS_PER_PEER: Final = 8  # open at once on one client connection


class StreamSlots:
    """Counts the open streams of each peer (single-threaded: the gRPC event loop)."""

    def __init__(self, total: int = MAX_STREAMS, per_peer: int = MAX_STREAMS_PER_PEER) -> None:
        self.total = total
        self.per_peer = per_peer
        self._held: collections.Counter[str] = collections.Counter()
        self._open = 0

    @property
    def open(self) -> int:
        """Streams held now."""
        return self._open

    @contextlib.contextmanager
    def hold(self, peer: str) -> Iterator[None]:
        """One slot for the stream's life; ResourceExhausted when none is free."""
        if self._held[peer] >= self.per_peer:
            raise ResourceExhausted(
                f"this connection holds {self.per_peer} open streams without credentials "
                "(health Watch, reflection), the most one may"
            )
        if self._open >= self.total:
            raise ResourceExhausted(
                f"{self.total} streams without credentials are open on the agent, the most it holds"
            )
        self._held[peer] += 1
        self._open += 1
        try:
            yield
        finally:
            self._open -= 1
            self._held[peer] -= 1
            if not self._held[peer]:
                del self._held[peer]
