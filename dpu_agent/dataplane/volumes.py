"""A session's view of the volume store: its tenant's volumes, for its volume jobs.

Attaching checked the volume's owner already; every I/O checks again, which catches a
volume deleted and made again by another tenant under the same id while a session
held its handle. The store is thread-safe: these run inline on the reactor thread
(small reads and writes to the page cache) or on its storage workers (syncs, large
I/O), as the runners choose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpu_agent.errors import NotFound
from dpu_agent.storage.backend import screened_batch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dpu_agent.errors import AgentError
    from dpu_agent.storage import VolumeStore
    from dpu_agent.storage.qos import Reservation


class TenantVolumes:
    """`runners.Storage` over a `VolumeStore`, limited to one tenant's volumes."""

    def __init__(self, store: VolumeStore, tenant: str) -> None:
        self._store = store
        self._tenant = tenant

    def _owned(self, volume_id: str) -> str:
        if self._store.get(volume_id).tenant != self._tenant:
            raise NotFound(f"volume {volume_id!r} does not exist")
        return volume_id

    def write(self, volume_id: str, offset: int, data: memoryview, *, fua: bool) -> None:
        """Store whole blocks (durable when `fua`)."""
        self._store.write(self._owned(volume_id), offset, data, fua=fua)

    def write_batch(self, writes: Sequence[tuple[str, int, memoryview]]) -> list[AgentError | None]:
        """Several non-durable writes in order: each one's error, or None."""
        return screened_batch(writes, self._owned, self._store.write_batch)

    def read_into(self, volume_id: str, offset: int, view: memoryview) -> None:
        """Load whole blocks into `view` (CRC checked)."""
        view[:] = self._store.read(self._owned(volume_id), offset, len(view))

    def flush(self, volume_id: str) -> None:
        """Make what was written durable."""
        self._store.flush(self._owned(volume_id))

    def trim(self, volume_id: str, offset: int, length: int) -> None:
        """Forget whole blocks."""
        self._store.trim(self._owned(volume_id), offset, length)

    def throttle(self, volume_id: str, op: str, nbytes: int) -> Reservation:
        """This I/O's QoS reservation: `wait` seconds before it (0: none), `give_back()`.

        Checked like the I/O itself: the tokens are taken before the I/O is tried, so a
        handle to a volume another tenant has made again under the same id must not
        spend that volume's budget.
        """
        return self._store.throttle(self._owned(volume_id), op, nbytes)
