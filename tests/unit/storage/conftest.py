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
from dpu_agent.storage.engine import CowVolumeStore

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


def make_store(backend: str, path: Path, **kwargs) -> CowVolumeStore:
    if backend == "file":
        return FileVolumeStore(path / "store", **kwargs)
    return MemoryVolumeStore(**kwargs)


@pytest.fixture(params=["file", "memory"])
def backend(request) -> str:
    return str(request.param)


@pytest.fixture
def store(backend, tmp_path) -> Iterator[CowVolumeStore]:
    """A store of each backend, closed after the test."""
    with make_store(backend, tmp_path) as s:
        yield s


def flip_stored_byte(store: CowVolumeStore, volume_id: str, block: int, at: int = 0) -> None:
    """Damage one byte of a block where the store keeps it (the test plays the disk)."""
    bs = store.get(volume_id).block_size
    store.flush(volume_id)
    found = store.physical(volume_id, block * bs)
    assert found is not None, "the block was never written"
    offset = found[0] + at
    pool = store._pool
    byte = pool.pread(1, offset)
    pool.pwrite(bytes([byte[0] ^ 0x5A]), offset)
