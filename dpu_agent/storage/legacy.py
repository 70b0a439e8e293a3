"""Reading a store of the format before engine v2, to copy it into the new one.

The old `file` store kept, in its directory:

    catalog.sqlite    volumes (schema 1: before tenants; 2: with the tenant) and one
                      record (length, flags, crc) per written block; WAL journal
    volumes/<id>.vol  a sparse file per volume, block i at [i * block_size, ...)

`FileVolumeStore` finds `catalog.sqlite` next to no new pool, copies every volume
(settings, sealed key, owner, and each block's stored bytes with its record: the
codec is unchanged, so nothing is re-encoded) into the new format, makes that
durable, and only then removes these files. A crash in between redoes the copy.
Blocks written but never flushed were never in the catalog and were never promised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
from typing import TYPE_CHECKING, Final

from dpu_agent.auth import DEFAULT_TENANT
from dpu_agent.errors import FailedPrecondition
from dpu_agent.storage.dataservices import FLAG_ENCRYPTED, XTS_MIN_BYTES
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.types import Compression, DataServices, Encryption, VolumeInfo

if TYPE_CHECKING:
    import builtins
    from collections.abc import Iterator
    from pathlib import Path

log = logging.getLogger(__name__)

CATALOG: Final = "catalog.sqlite"
VOLUME_DIR: Final = "volumes"
VOLUME_SUFFIX: Final = ".vol"
KNOWN_VERSIONS: Final = (1, 2)


class LegacyStore:
    """The old catalog and volume files of a store directory (read only, then removed)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._db = sqlite3.connect(directory / CATALOG, isolation_level=None)
        try:
            self._tenant = self._tenant_column()
        except BaseException:
            self._db.close()
            raise

    def _tenant_column(self) -> str:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in KNOWN_VERSIONS:
            raise FailedPrecondition(
                f"the old volume catalog has schema version {version}; "
                f"this agent upgrades {KNOWN_VERSIONS}"
            )
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(volumes)")}
        return "tenant" if "tenant" in columns else f"'{DEFAULT_TENANT}'"

    @staticmethod
    def present(directory: Path) -> bool:
        """True if the directory holds an old catalog."""
        return (directory / CATALOG).exists()

    def close(self) -> None:
        """Close the catalog."""
        self._db.close()

    def volumes(self) -> builtins.list[tuple[VolumeInfo, bytes | None]]:
        """Every volume with its sealed key."""
        rows = self._db.execute(
            "SELECT volume_id, size_bytes, block_size, crc32c, compression, encryption,"  # noqa: S608 - a column name of ours
            f" sealed_key, create_ns, update_ns, {self._tenant} FROM volumes ORDER BY volume_id"
        ).fetchall()
        found = []
        for vid, size, bs, crc, comp, enc, sealed, create_ns, update_ns, tenant in rows:
            try:
                services = DataServices(bool(crc), Compression(comp), Encryption(enc))
            except ValueError:
                raise DataCorruption(f"volume {vid!r} has unknown data services") from None
            info = VolumeInfo(vid, size, bs, services, create_ns, update_ns, tenant)
            found.append((info, None if sealed is None else bytes(sealed)))
        return found

    def blocks(self, info: VolumeInfo) -> Iterator[tuple[int, bytes, int, int, int | None]]:
        """(block, stored bytes, length, flags, crc) of each block the catalog records."""
        path = self.directory / VOLUME_DIR / f"{info.volume_id}{VOLUME_SUFFIX}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise FailedPrecondition(
                f"cannot upgrade the volume store: volume {info.volume_id!r} has no data file "
                f"({path}); restore it, or delete the volume with the previous agent version"
            ) from None
        try:
            rows = self._db.execute(
                "SELECT block, length, flags, crc FROM blocks WHERE volume_id = ? ORDER BY block",
                (info.volume_id,),
            )
            bs = info.block_size
            for block, length, flags, crc in rows:
                if block >= info.blocks or not 0 < length <= bs:
                    continue  # outside the volume (an interrupted shrink): never readable
                stored = max(length, XTS_MIN_BYTES) if flags & FLAG_ENCRYPTED else length
                data = os.pread(fd, stored, block * bs)
                data += bytes(stored - len(data))
                yield block, data, length, flags, crc
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Delete the old catalog and volume files."""
        self.close()
        shutil.rmtree(self.directory / VOLUME_DIR, ignore_errors=True)
        for suffix in ("-wal", "-shm", ""):  # the catalog last: it is what marks the old format
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"{CATALOG}{suffix}").unlink()
        log.info("removed the old volume store format", extra={"dir": str(self.directory)})
