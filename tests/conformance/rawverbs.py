"""The verbs host side for the conformance suite (in the soft-RoCE test VM).

The RC queue pair is the transport's own `VerbsHostLink` (a queue pair and its MRs, as
section 1.2 sets them up: that part is the NIC's work, not the protocol's). What
crosses it is the suite's: capsules packed and parsed by `tests.conformance.wire`,
regions registered with exactly the access they grant.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from dpu_wire.transport.base import Access, VerbsAddress
from dpu_wire.v1 import session_pb2
from tests.conformance import wire

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_wire.transport.base import Region as LinkRegion
    from dpu_wire.transport.base import TransportError

READ = 1
WRITE = 2


class Region:
    """A registered MR: `addr` and `rkey` as the NIC gave them."""

    def __init__(self, region: LinkRegion, access: int) -> None:
        self.inner = region
        self.addr = region.addr
        self.rkey = region.rkey
        self.access = access

    @property
    def length(self) -> int:
        return self.inner.length

    @property
    def view(self) -> memoryview:
        return self.inner.view

    def span(self, offset: int = 0, length: int | None = None) -> wire.Span:
        return wire.Span(
            self.addr + offset, self.length - offset if length is None else length, self.rkey
        )


class RawVerbsHost:
    """One session's host side on an RC queue pair."""

    transport = "verbs"

    def __init__(self, device: str, queue_depth: int) -> None:
        from dpu_wire.transport.verbs import VerbsHostLink  # noqa: PLC0415 - pyverbs, in the VM

        self.link = VerbsHostLink(device=device, queue_depth=queue_depth, spin=0.01)
        self.capsules: asyncio.Queue[bytes] = asyncio.Queue()
        self.on_capsule: Callable[[bytes], None] | None = None
        self.eof = asyncio.Event()  # the data plane failed
        self.error: TransportError | None = None
        self.violations: list[str] = []
        self.regions: dict[int, Region] = {}

    def endpoint(self) -> session_pb2.Endpoint:
        a = self.link.address
        return session_pb2.Endpoint(
            verbs=session_pb2.VerbsEndpoint(
                gid=a.gid, qp_num=a.qp_num, psn=a.psn, mtu=a.mtu, lid=a.lid
            )
        )

    def listen(self) -> None:
        """Nothing to do: the QP waits in INIT with its RECVs posted."""

    async def connected(self, agent: session_pb2.Endpoint, inline_max: int = 0) -> None:
        v = agent.verbs
        await self.link.connect(VerbsAddress(bytes(v.gid), v.qp_num, v.psn, v.mtu, v.lid))
        if inline_max:  # send slots for INLINE SUBMITs as long as the agent takes
            self.link.accept_inline(inline_max)
        self.link.start(self._capsule, self._failed, lambda: True)

    def _capsule(self, data: memoryview) -> None:
        payload = bytes(data)
        if self.on_capsule is not None:
            self.on_capsule(payload)
        self.capsules.put_nowait(payload)

    def _failed(self, error: TransportError) -> None:
        self.error = error
        self.eof.set()

    def region(self, length: int, access: int) -> Region:
        flags = (Access.REMOTE_READ if access & READ else Access.NONE) | (
            Access.REMOTE_WRITE if access & WRITE else Access.NONE
        )
        made = Region(self.link.register(length, flags), access)
        self.regions[made.rkey] = made
        return made

    def withdraw(self, region: Region) -> None:
        if self.regions.pop(region.rkey, None) is not None:
            self.link.deregister(region.inner)

    async def send_capsules(self, capsules: list[bytes]) -> None:
        self.link.send(capsules)

    def stop_reading(self) -> None:
        """Post no RECV again: the capsules still arrive, then the agent's SENDs meet no
        RECV and RC retries them for ever (RNR), as with a host that took its RECVs back.
        """
        qp = self.link._qp

        def taken_not_reposted(_sink: object, _slot: int, _status: int, _length: int) -> bool:
            return True

        qp._received = taken_not_reposted  # type: ignore[method-assign,assignment]

    async def send_oversized(self, size: int) -> None:
        """One SEND of `size` bytes, past every RECV buffer of the agent (DP-2.5-3)."""
        qp = self.link._qp  # the transport refuses to do this on purpose
        ring = qp._send_ring
        assert size <= ring.length
        ring.view[:size] = wire.submit(1, wire.Kind.COPY) + bytes(size - 80)
        sge = qp._send_sge
        sge.addr, sge.length = ring.addr, size
        qp._post(qp._send_wr, None, None, "SEND")

    async def close(self) -> None:
        await self.link.close()
