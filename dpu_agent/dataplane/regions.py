"""Memory regions a host advertised for its session, and checks of spans against them.

Every span a job names is checked here before any RDMA operation is posted: on a
real NIC an access with a bad rkey or out of bounds moves the queue pair to the
error state and kills the whole session, so a bad job must fail alone, first.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from dpu_wire.capsule import U32_MAX, U64_MAX, Span

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_wire.transport.base import Access, FastRegion

MAX_REGIONS_PER_SESSION: Final = 1024


@dataclasses.dataclass(frozen=True)
class AdvertisedRegion:
    """A host region the agent may access."""

    region_id: str
    addr: int
    length: int
    rkey: int
    access: Access


class RegionTable:
    """The regions of one session, by id and by rkey."""

    def __init__(self, limit: int = MAX_REGIONS_PER_SESSION) -> None:
        self._by_id: dict[str, AdvertisedRegion] = {}
        self._by_rkey: dict[int, AdvertisedRegion] = {}
        self._limit = limit
        self.version = 0  # counts changes: the link's fast path re-reads on a new one
        # Called at once after a region is withdrawn (remove, clear), on the caller's
        # thread: a fast path must forget it before the host hears it is gone.
        self.on_withdraw: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def room(self) -> int:
        """How many more regions the session may advertise."""
        return self._limit - len(self._by_id)

    def add(self, region: AdvertisedRegion) -> None:
        """Add a region; its id and rkey must be new to the session."""
        if region.region_id in self._by_id:
            raise AlreadyExists(f"region {region.region_id!r} is already advertised")
        if region.rkey in self._by_rkey:
            raise AlreadyExists(f"rkey {region.rkey:#x} is already advertised")
        if len(self._by_id) >= self._limit:
            raise ResourceExhausted(f"a session may advertise at most {self._limit} regions")
        if region.length <= 0 or region.length > U32_MAX * 1024:
            raise InvalidArgument(f"region {region.region_id!r}: length {region.length} is invalid")
        if region.addr + region.length > U64_MAX + 1:
            raise InvalidArgument(f"region {region.region_id!r}: address range overflows 64 bits")
        if not region.access:
            raise InvalidArgument(f"region {region.region_id!r}: grants no access")
        self._by_id[region.region_id] = region
        self._by_rkey[region.rkey] = region
        self.version += 1

    def clear(self) -> None:
        """Forget every region."""
        self._by_id.clear()
        self._by_rkey.clear()
        self.version += 1
        if self.on_withdraw is not None:
            self.on_withdraw()

    def remove(self, region_id: str) -> AdvertisedRegion:
        """Withdraw a region by id."""
        region = self._by_id.pop(region_id, None)
        if region is None:
            raise NotFound(f"region {region_id!r} is not advertised")
        del self._by_rkey[region.rkey]
        self.version += 1
        if self.on_withdraw is not None:
            self.on_withdraw()
        return region

    def get(self, region_id: str) -> AdvertisedRegion:
        """The region with this id."""
        region = self._by_id.get(region_id)
        if region is None:
            raise NotFound(f"region {region_id!r} is not advertised in this session")
        return region

    def all(self) -> list[AdvertisedRegion]:
        """Every region, in advertisement order."""
        return list(self._by_id.values())

    def fast_list(self) -> list[FastRegion]:
        """(addr, length, rkey, access) of every region, for a link's fast path."""
        return [(r.addr, r.length, r.rkey, r.access.value) for r in self._by_id.values()]

    def check_span(self, span: Span, need: Access, what: str) -> AdvertisedRegion:
        """The region `span` lies in, if it grants `need`; else a domain error saying why."""
        if span.length == 0:
            raise InvalidArgument(f"{what}: length is 0")
        region = self._by_rkey.get(span.rkey)
        if region is None:
            raise InvalidArgument(f"{what}: no region with rkey {span.rkey:#x} in this session")
        if span.end > U64_MAX + 1:
            raise InvalidArgument(f"{what}: address + length overflows 64 bits")
        if span.addr < region.addr or span.end > region.addr + region.length:
            raise InvalidArgument(
                f"{what}: [{span.addr:#x}, +{span.length}) is outside region "
                f"{region.region_id!r} [{region.addr:#x}, +{region.length})"
            )
        if not region.access.value & need.value:
            raise PermissionDenied(
                f"{what}: region {region.region_id!r} does not grant {need.name}"
            )
        return region

    def span_of(self, region_id: str, offset: int, length: int, what: str) -> Span:
        """The span for (region id, offset, length); length 0 means to the region's end."""
        region = self.get(region_id)
        if offset > region.length:
            raise InvalidArgument(f"{what}: offset {offset} is past the end of {region_id!r}")
        length = length or region.length - offset
        if offset + length > region.length:
            raise InvalidArgument(
                f"{what}: offset {offset} + length {length} exceeds region {region_id!r} "
                f"({region.length} bytes)"
            )
        if length > U32_MAX:
            raise InvalidArgument(f"{what}: length {length} exceeds {U32_MAX}")
        return Span(region.addr + offset, length, region.rkey)
