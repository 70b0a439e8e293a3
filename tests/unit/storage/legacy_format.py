"""Writes a store directory in the format before engine v2, as that agent left it.

The layout (see dpu_agent/storage/legacy.py): `catalog.sqlite` (schema 2, or 1 before
tenants) with a `volumes` row per volume and a `blocks` row (length, flags, crc) per
written block, and `volumes/<id>.vol`, a sparse file per volume with block i at
[i * block_size, ...), holding what the block codec produced. The SQL is that
agent's own `CREATE TABLE` statements.
"""

from __future__ import annotations

import os
import sqlite3
from typing import TYPE_CHECKING

from dpu_agent.storage.dataservices import BlockCodec
from dpu_agent.storage.file_backend import load_or_create_master_key
from dpu_agent.storage.keys import KeySealer, generate_key
from dpu_agent.storage.types import Encryption

if TYPE_CHECKING:
    from pathlib import Path

    from dpu_agent.storage.types import DataServices

VOLUMES_V2 = (
    "CREATE TABLE volumes ("
    " volume_id TEXT PRIMARY KEY, size_bytes INTEGER NOT NULL,"
    " block_size INTEGER NOT NULL, crc32c INTEGER NOT NULL,"
    " compression TEXT NOT NULL, encryption TEXT NOT NULL, sealed_key BLOB,"
    " create_ns INTEGER NOT NULL, update_ns INTEGER NOT NULL,"
    " tenant TEXT NOT NULL DEFAULT 'default')"
)
VOLUMES_V1 = (  # before tenants
    "CREATE TABLE volumes ("
    " volume_id TEXT PRIMARY KEY, size_bytes INTEGER NOT NULL,"
    " block_size INTEGER NOT NULL, crc32c INTEGER NOT NULL,"
    " compression TEXT NOT NULL, encryption TEXT NOT NULL, sealed_key BLOB,"
    " create_ns INTEGER NOT NULL, update_ns INTEGER NOT NULL)"
)
BLOCKS = (
    "CREATE TABLE blocks ("
    " volume_id TEXT NOT NULL, block INTEGER NOT NULL, length INTEGER NOT NULL,"
    " flags INTEGER NOT NULL, crc INTEGER,"
    " PRIMARY KEY (volume_id, block)) WITHOUT ROWID"
)


class LegacyWriter:
    """An old-format store being written: volumes, then blocks (whole volumes' worth)."""

    def __init__(self, directory: Path, *, version: int = 2) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (directory / "volumes").mkdir(mode=0o700, exist_ok=True)
        self.directory = directory
        self.version = version
        self.sealer = KeySealer(load_or_create_master_key(directory / "master.key"))
        self.db = sqlite3.connect(directory / "catalog.sqlite", isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(VOLUMES_V2 if version == 2 else VOLUMES_V1)
        self.db.execute(BLOCKS)
        self.db.execute(f"PRAGMA user_version={version}")
        self.codecs: dict[str, BlockCodec] = {}
        self.block_sizes: dict[str, int] = {}

    def volume(
        self,
        volume_id: str,
        size_bytes: int,
        block_size: int,
        services: DataServices,
        *,
        tenant: str = "default",
        create_ns: int = 1_700_000_000_000_000_000,
        update_ns: int | None = None,
    ) -> None:
        """Add a volume row and its (sparse) file."""
        key = generate_key() if services.encryption is not Encryption.NONE else None
        sealed = None if key is None else self.sealer.seal(volume_id, key)
        row = [
            volume_id,
            size_bytes,
            block_size,
            int(services.crc32c),
            str(services.compression),
            str(services.encryption),
            sealed,
            create_ns,
            update_ns or create_ns,
        ]
        if self.version == 2:
            row.append(tenant)
        marks = ", ".join("?" * len(row))
        self.db.execute(f"INSERT INTO volumes VALUES ({marks})", row)  # noqa: S608 - test
        path = self.directory / "volumes" / f"{volume_id}.vol"
        with path.open("wb") as f:
            f.truncate(size_bytes)
        self.codecs[volume_id] = BlockCodec(volume_id, services, block_size, key)
        self.block_sizes[volume_id] = block_size

    def write(self, volume_id: str, offset: int, data: bytes) -> None:
        """Write whole blocks, as the old store did: slot per block, then the records."""
        codec, bs = self.codecs[volume_id], self.block_sizes[volume_id]
        path = self.directory / "volumes" / f"{volume_id}.vol"
        fd = os.open(path, os.O_RDWR)
        try:
            for i in range(len(data) // bs):
                block = offset // bs + i
                chunk = memoryview(data)[i * bs : (i + 1) * bs]
                payload: bytes | memoryview
                if codec.transparent:
                    payload, record = chunk, codec.raw_record
                else:
                    payload, record = codec.encode(block, chunk)
                os.pwrite(fd, payload, block * bs)
                self.db.execute(
                    "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?)",
                    (volume_id, block, record.length, record.flags, record.crc),
                )
        finally:
            os.close(fd)

    def close(self) -> None:
        """Done: the catalog as the old agent leaves it (WAL not checkpointed)."""
        self.db.close()
