"""SessionService: open and close sessions, exchange endpoints, advertise regions.

A session belongs to the tenant that opened it, and with it its regions, keys,
attached volumes and jobs. Another tenant's session answers NOT_FOUND exactly as a
missing one does; admins see and manage every session. A session attaches only
volumes of its own tenant.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final, TypeVar

from dpu_agent import auth
from dpu_agent.dataplane.regions import MAX_REGIONS_PER_SESSION, AdvertisedRegion
from dpu_agent.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from dpu_agent.offload import in_thread
from dpu_agent.services import convert
from dpu_wire import names
from dpu_wire.v1 import session_pb2, session_pb2_grpc

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    import grpc

    from dpu_agent.dataplane.manager import SessionManager
    from dpu_agent.dataplane.session import Session
    from dpu_agent.storage import VolumeStore


MAX_LABEL_LENGTH: Final = 128
REGIONS_PER_SLICE: Final = 128  # AdvertiseRegions yields to the event loop this often
_T = TypeVar("_T")


def client_label(text: str) -> str:
    """The OpenSession label if it is short and printable; InvalidArgument otherwise.

    It is shown to people (logs, `dpuctl session list`), so no control characters or
    line breaks that could forge a log line or a terminal's output.
    """
    if len(text) > MAX_LABEL_LENGTH:
        raise InvalidArgument(
            f"client_label: {len(text)} characters long (at most {MAX_LABEL_LENGTH})"
        )
    if not text.isprintable():
        raise InvalidArgument(
            "client_label: only printable characters (no control characters or line breaks)"
        )
    return text


async def _sliced(items: Sequence[_T]) -> AsyncIterator[tuple[int, _T]]:
    """(index, item) of `items`, yielding to the event loop every `REGIONS_PER_SLICE`."""
    for index, item in enumerate(items):
        if index and not index % REGIONS_PER_SLICE:
            await asyncio.sleep(0)
        yield index, item


def owned_session(manager: SessionManager, name: str) -> Session:
    """The session `name`, if the caller may see it; NotFound as for a missing one otherwise."""
    session = manager.get(name)
    auth.check_owner(session.tenant, name)
    return session


class SessionService(session_pb2_grpc.SessionServiceServicer):
    """Thin gRPC layer over the SessionManager."""

    def __init__(self, manager: SessionManager, store: VolumeStore | None = None) -> None:
        self._manager = manager
        self._store = store

    async def _check_volume(self, session: Session, volume_id: str) -> None:
        """NotFound unless the volume exists and is the session tenant's (as if missing)."""
        if self._store is None:
            raise FailedPrecondition("this agent has no volume store")
        info = await in_thread(self._store.get, volume_id)
        if info.tenant != session.tenant:
            raise NotFound(f"volume {volume_id!r} does not exist")

    async def OpenSession(
        self, request: session_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> session_pb2.Session:
        """Open a session and connect its data plane."""
        session = await self._manager.open(
            tenant=auth.tenant(),
            transport=request.transport,
            queue_depth=request.queue_depth,
            label=client_label(request.client_label),
            host=convert.peer_address(request.host_endpoint),
            request_id=request.request_id,
            peer=context.peer() or "",
        )
        return convert.session(session, with_token=True)

    async def GetSession(
        self, request: session_pb2.GetSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> session_pb2.Session:
        """One session."""
        return convert.session(owned_session(self._manager, request.name))

    async def ListSessions(
        self, request: session_pb2.ListSessionsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> session_pb2.ListSessionsResponse:
        """A page of the caller's sessions (an admin's: every session)."""
        principal = auth.current_principal()
        page, token = self._manager.page(request, lambda s: principal.can_see(s.tenant))
        return session_pb2.ListSessionsResponse(
            sessions=[convert.session(s) for s in page], next_page_token=token
        )

    async def CloseSession(
        self, request: session_pb2.CloseSessionRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> session_pb2.CloseSessionResponse:
        """Close a session: its jobs are cancelled, its queue pair destroyed."""
        owned_session(self._manager, request.name)
        await self._manager.close(request.name)
        return session_pb2.CloseSessionResponse()

    async def AdvertiseRegions(
        self,
        request: session_pb2.AdvertiseRegionsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> session_pb2.AdvertiseRegionsResponse:
        """Add host regions to the session, all or none.

        The count is checked before any region is looked at (the interceptor already
        bounded it to 1024), each region costs microseconds, and the work yields to the
        event loop every `REGIONS_PER_SLICE` regions, so other calls are not held up.
        """
        session = owned_session(self._manager, request.session)
        room = session.regions.room
        if len(request.regions) > room:
            raise ResourceExhausted(
                f"a session may advertise at most {MAX_REGIONS_PER_SESSION} regions: "
                f"{session.name} has room for {room}, the request has {len(request.regions)}"
            )
        new: list[AdvertisedRegion] = []
        async for index, message in _sliced(request.regions):
            new.append(
                AdvertisedRegion(
                    region_id=convert.region_id(session, message.name, f"regions[{index}].name"),
                    addr=message.addr,
                    length=message.length,
                    rkey=message.rkey,
                    access=convert.access(message.access),
                )
            )
        added: list[AdvertisedRegion] = []
        try:
            for region in new:
                session.regions.add(region)
                added.append(region)
        except Exception:
            for region in added:
                session.regions.remove(region.region_id)
            raise
        return session_pb2.AdvertiseRegionsResponse(
            regions=[convert.region(session, r) async for _, r in _sliced(added)]
        )

    async def AttachVolume(
        self, request: session_pb2.AttachVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> session_pb2.VolumeAttachment:
        """Give a volume of the session's tenant a handle for this session's jobs."""
        session = owned_session(self._manager, request.session)
        (volume_id,) = names.parse_name(request.volume, "volumes")
        await self._check_volume(session, volume_id)
        handle = session.attach(volume_id)
        return session_pb2.VolumeAttachment(
            session=session.name, volume=request.volume, handle=handle
        )

    async def DetachVolume(
        self, request: session_pb2.DetachVolumeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> session_pb2.DetachVolumeResponse:
        """Remove a volume's handle from this session."""
        session = owned_session(self._manager, request.session)
        (volume_id,) = names.parse_name(request.volume, "volumes")
        session.detach(volume_id)
        return session_pb2.DetachVolumeResponse()

    async def RegisterKey(
        self, request: session_pb2.RegisterKeyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> session_pb2.KeyHandle:
        """Keep an AES key for this session's encrypt/decrypt jobs; answer its handle."""
        session = owned_session(self._manager, request.session)
        handle = session.register_key(bytes(request.key))
        return session_pb2.KeyHandle(session=session.name, handle=handle)

    async def WithdrawRegion(
        self,
        request: session_pb2.WithdrawRegionRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> session_pb2.WithdrawRegionResponse:
        """Forget a region; jobs naming it afterwards fail."""
        session_id, region_id = names.parse_name(request.name, "sessions", "regions")
        session = owned_session(self._manager, f"sessions/{session_id}")
        session.regions.remove(region_id)
        return session_pb2.WithdrawRegionResponse()
