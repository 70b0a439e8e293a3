"""The `memory` backend: volumes in RAM, gone with the process. For tests and the demo.

Same semantics as the file backend (it shares `BlockVolumeStore`): data services,
checks, errors and statistics are identical; only durability differs. Blocks are
kept sparsely (a dict of written slots), and volume keys are sealed under a master
key that exists only in this process.
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import secrets
import threading
from typing import TYPE_CHECKING

from dpu_agent.storage.blockstore import (
    DEFAULT_MAX_VOLUME_BYTES,
    BlockDevice,
    BlockVolumeStore,
    Catalog,
    VolumeRow,
)
from dpu_agent.storage.keys import MASTER_KEY_BYTES, KeySealer

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dpu_agent.storage.dataservices import BlockRecord
    from dpu_agent.storage.types import VolumeInfo


class MemoryDevice(BlockDevice):
    """A sparse in-memory device: one bytes object per written slot."""

    def __init__(self, size_bytes: int, block_size: int) -> None:
        self.size_bytes = size_bytes
        self.block_size = block_size
        self._bs = block_size
        self._zero = bytes(block_size)
        self.slots: dict[int, bytes] = {}

    def read(self, offset: int, length: int) -> bytes:
        """See `BlockDevice.read`."""
        first, zero, slots = offset // self._bs, self._zero, self.slots
        return b"".join(slots.get(b, zero) for b in range(first, first + length // self._bs))

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """See `BlockDevice.write`."""
        view, bs, first = memoryview(data), self._bs, offset // self._bs
        for i in range(len(view) // bs):
            self.slots[first + i] = bytes(view[i * bs : (i + 1) * bs])

    def sync(self) -> None:
        """See `BlockDevice.sync`: nothing to do in RAM."""

    def discard(self, offset: int, length: int) -> None:
        """See `BlockDevice.discard`."""
        first = offset // self._bs
        for block in range(first, first + length // self._bs):
            self.slots.pop(block, None)

    def resize(self, size_bytes: int) -> None:
        """See `BlockDevice.resize`."""
        keep = size_bytes // self._bs
        for block in [b for b in self.slots if b >= keep]:
            del self.slots[block]
        self.size_bytes = size_bytes

    def close(self) -> None:
        """See `BlockDevice.close`: the data stays with the store."""


class MemoryCatalog(Catalog):
    """Volumes and block records in dicts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, VolumeRow] = {}
        self._blocks: dict[str, dict[int, BlockRecord]] = {}

    def volumes(self) -> builtins.list[VolumeRow]:
        """See `Catalog.volumes`."""
        with self._lock:
            return builtins.list(self._rows.values())

    def add_volume(self, row: VolumeRow) -> None:
        """See `Catalog.add_volume`."""
        with self._lock:
            self._rows[row.info.volume_id] = row
            self._blocks[row.info.volume_id] = {}

    def remove_volume(self, volume_id: str) -> None:
        """See `Catalog.remove_volume`."""
        with self._lock:
            self._rows.pop(volume_id, None)
            self._blocks.pop(volume_id, None)

    def set_size(
        self, volume_id: str, size_bytes: int, update_ns: int, drop_from_block: int | None
    ) -> None:
        """See `Catalog.set_size`."""
        with self._lock:
            row = self._rows[volume_id]
            info = row.info
            self._rows[volume_id] = dataclasses.replace(
                row, info=dataclasses.replace(info, size_bytes=size_bytes, update_ns=update_ns)
            )
            if drop_from_block is not None:
                blocks = self._blocks[volume_id]
                for block in [b for b in blocks if b >= drop_from_block]:
                    del blocks[block]

    def block_records(self, volume_id: str, first: int, count: int) -> dict[int, BlockRecord]:
        """See `Catalog.block_records`."""
        with self._lock:
            blocks = self._blocks.get(volume_id, {})
            if count <= len(blocks):
                found = ((b, blocks.get(b)) for b in range(first, first + count))
                return {b: r for b, r in found if r is not None}
            return {b: r for b, r in blocks.items() if first <= b < first + count}

    def has_blocks_from(self, volume_id: str, first: int) -> bool:
        """See `Catalog.has_blocks_from`."""
        with self._lock:
            return any(b >= first for b in self._blocks.get(volume_id, {}))

    def put_blocks(self, volume_id: str, records: Mapping[int, BlockRecord]) -> None:
        """See `Catalog.put_blocks`."""
        with self._lock:
            self._blocks[volume_id].update(records)

    def drop_blocks(self, volume_id: str, first: int, count: int) -> None:
        """See `Catalog.drop_blocks`."""
        with self._lock:
            blocks = self._blocks.get(volume_id, {})
            for block in [b for b in blocks if first <= b < first + count]:
                del blocks[block]

    def close(self) -> None:
        """See `Catalog.close`."""


class MemoryVolumeStore(BlockVolumeStore):
    """Volumes in RAM.

    Space policy as for files: volumes are sparse, and one is refused when it is
    larger than `capacity_bytes` (default: the physical memory available when asked)
    minus what the store's blocks take now.
    """

    def __init__(
        self,
        *,
        max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
        capacity_bytes: int | None = None,
    ) -> None:
        self._capacity = capacity_bytes
        self._devices: dict[str, MemoryDevice] = {}
        super().__init__(
            MemoryCatalog(),
            KeySealer(secrets.token_bytes(MASTER_KEY_BYTES)),
            max_volume_bytes=max_volume_bytes,
        )

    def __repr__(self) -> str:
        return f"MemoryVolumeStore(volumes={len(self._devices)})"

    def _create_device(self, info: VolumeInfo) -> BlockDevice:
        device = MemoryDevice(info.size_bytes, info.block_size)
        self._devices[info.volume_id] = device
        return device

    def _open_device(self, info: VolumeInfo) -> BlockDevice:
        return self._devices[info.volume_id]

    def _destroy_device(self, volume_id: str) -> None:
        self._devices.pop(volume_id, None)

    def _free_bytes(self) -> int:
        used = sum(len(d.slots) * d.block_size for d in builtins.list(self._devices.values()))
        if self._capacity is not None:
            return max(0, self._capacity - used)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
