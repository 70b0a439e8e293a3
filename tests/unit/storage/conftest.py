"""Fixtures of the volume-store suites: a store of each backend, and a way to damage a block."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import pytest

from dpu_agent.storage import (
    Compression,
    DataServices,
    Encryption,
    FileVolumeStore,
    MemoryVolumeStore,
)
from dpu_agent.storage.blockstore import BlockVolumeStore
from dpu_agent.storage.memory_backend import MemoryDevice

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

MiB = 1 << 20

ALL_SERVICES = [
    DataServices(crc, comp, enc)
    for crc, comp, enc in itertools.product((False, True), tuple(Compression), tuple(Encryption))
]


def services_id(services: DataServices) -> str:
    return f"crc{int(services.crc32c)}-{services.compression}-{services.encryption}"


def make_store(backend: str, path: Path, **kwargs) -> BlockVolumeStore:
    if backend == "file":
        return FileVolumeStore(path / "store", **kwargs)
    return MemoryVolumeStore(**kwargs)


@pytest.fixture(params=["file", "memory"])
def backend(request) -> str:
    return str(request.param)


@pytest.fixture
def store(backend, tmp_path) -> Iterator[BlockVolumeStore]:
    """A store of each backend, closed after the test."""
    with make_store(backend, tmp_path) as s:
        yield s


def flip_stored_byte(store: BlockVolumeStore, volume_id: str, block: int, at: int = 0) -> None:
    """Damage one byte of a block where the backend keeps it (the test plays the disk)."""
    vol = store._volumes[volume_id]
    bs = vol.info.block_size
    store.flush(volume_id)
    if isinstance(store, FileVolumeStore):
        path = store._path(volume_id)
        with path.open("r+b") as f:
            f.seek(block * bs + at)
            byte = f.read(1)
            f.seek(block * bs + at)
            f.write(bytes([byte[0] ^ 0x5A]))
        return
    device = vol.device
    assert isinstance(device, MemoryDevice)
    slot = bytearray(device.slots[block])
    slot[at] ^= 0x5A
    device.slots[block] = bytes(slot)
