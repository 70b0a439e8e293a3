"""The `file` backend (the default): a sparse file per volume, metadata in SQLite.

Layout of the store directory (mode 0700):

    store.lock        held (flock) by the one store that has the directory open
    master.key        32 random bytes, mode 0600: seals the volume keys (see keys.py)
    catalog.sqlite    volumes (with their owning tenant) and block records; WAL journal,
                      synchronous=FULL; a version 1 catalog (before tenants) is upgraded
    volumes/<id>.vol  one sparse file per volume, exactly size_bytes long

Block `i` of a volume has the fixed slot `[i * block_size, (i + 1) * block_size)` in
its file. A compressed block occupies the start of its slot (its record says how
many bytes); the rest of the slot is unused, so compression saves no disk space in
this layout, only bytes written. Space of never-written and trimmed blocks is not
allocated (trim punches a hole with fallocate, or writes zeros where the filesystem
cannot).

On open the store removes volume files that the catalog does not know (a create or
delete interrupted by a crash) and sets each file back to its recorded size (an
interrupted resize). A volume whose file has gone fails every I/O with DataCorruption.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from dpu_agent.auth import DEFAULT_TENANT
from dpu_agent.errors import FailedPrecondition, ResourceExhausted, Unavailable
from dpu_agent.storage.blockstore import (
    DEFAULT_MAX_VOLUME_BYTES,
    BlockDevice,
    BlockVolumeStore,
    Catalog,
    VolumeRow,
)
from dpu_agent.storage.dataservices import BlockRecord
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.keys import MASTER_KEY_BYTES, KeySealer
from dpu_agent.storage.types import Compression, DataServices, Encryption, VolumeInfo

if TYPE_CHECKING:
    import builtins
    from collections.abc import Callable, Iterator, Mapping

log = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 2  # 2 added volumes.tenant; a version 1 catalog is upgraded on open
VOLUME_SUFFIX: Final = ".vol"

_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02
_ZERO_CHUNK: Final = 1 << 20


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_or_create_master_key(path: Path) -> bytes:
    """Read the master key file, creating it (mode 0600, 32 random bytes) if absent.

    A file that group or others may access, or of the wrong size, is refused. On a
    BlueField the master key would come from secure storage (TPM, secure-boot keys)
    instead of a file next to the data.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, os.urandom(MASTER_KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(path.parent)
        log.info("created the store's master key", extra={"path": str(path)})
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode & 0o777
        if mode & 0o077:
            raise FailedPrecondition(
                f"{path} may be accessed by group or others (mode {mode:04o}); it must be 0600"
            )
        data = os.read(fd, MASTER_KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != MASTER_KEY_BYTES:
        raise FailedPrecondition(f"{path} does not hold a {MASTER_KEY_BYTES}-byte master key")
    return data


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.fallocate64
    except (OSError, AttributeError):
        return None
    func.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    func.restype = ctypes.c_int
    return func


_fallocate = _load_fallocate()


class FileDevice(BlockDevice):
    """A volume file opened for positional I/O."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path
        self._punch = _fallocate is not None

    def __repr__(self) -> str:
        return f"FileDevice({str(self.path)!r})"

    def read(self, offset: int, length: int) -> bytes:
        """See `BlockDevice.read`."""
        data = os.pread(self._fd, length, offset)
        if len(data) == length:
            return data
        parts = [data]  # a short read: go on; past the end of the file reads as zeros
        done = len(data)
        while done < length:
            chunk = os.pread(self._fd, length - done, offset + done)
            if not chunk:
                parts.append(bytes(length - done))
                break
            parts.append(chunk)
            done += len(chunk)
        return b"".join(parts)

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """See `BlockDevice.write`."""
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def sync(self) -> None:
        """See `BlockDevice.sync`: fdatasync (the file's size never changes on write)."""
        os.fdatasync(self._fd)

    def discard(self, offset: int, length: int) -> None:
        """See `BlockDevice.discard`: punch a hole, or write zeros."""
        if self._punch and _fallocate is not None:
            mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
            if _fallocate(self._fd, mode, offset, length) == 0:
                return
            err = ctypes.get_errno()
            if err not in {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}:
                raise OSError(err, os.strerror(err), str(self.path))
            self._punch = False
        zeros = bytes(min(length, _ZERO_CHUNK))
        for at in range(offset, offset + length, _ZERO_CHUNK):
            self.write(at, zeros[: min(_ZERO_CHUNK, offset + length - at)])

    def resize(self, size_bytes: int) -> None:
        """See `BlockDevice.resize`."""
        os.ftruncate(self._fd, size_bytes)
        os.fsync(self._fd)

    def close(self) -> None:
        """See `BlockDevice.close`."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class SqliteCatalog(Catalog):
    """Volumes and block records in SQLite (WAL, synchronous=FULL).

    One connection, shared by the store's threads behind a lock.
    """

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._closed = False
        # The catalog holds sealed keys only, but it is nobody else's business either;
        # SQLite gives its -wal and -shm files the database file's mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        with _sqlite_errors():
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                self._setup()
            except BaseException:
                self._db.close()
                raise

    def _setup(self) -> None:
        db = self._db
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise FailedPrecondition(f"the catalog cannot use WAL (journal_mode is {mode})")
        db.execute("PRAGMA synchronous=FULL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in {0, 1, SCHEMA_VERSION}:
            raise FailedPrecondition(
                f"the catalog has schema version {version}; this agent knows {SCHEMA_VERSION}"
            )
        if version == 0:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "CREATE TABLE volumes ("
                " volume_id TEXT PRIMARY KEY, size_bytes INTEGER NOT NULL,"
                " block_size INTEGER NOT NULL, crc32c INTEGER NOT NULL,"
                " compression TEXT NOT NULL, encryption TEXT NOT NULL, sealed_key BLOB,"
                " create_ns INTEGER NOT NULL, update_ns INTEGER NOT NULL,"
                f" tenant TEXT NOT NULL DEFAULT '{DEFAULT_TENANT}')"
            )
            db.execute(
                "CREATE TABLE blocks ("
                " volume_id TEXT NOT NULL, block INTEGER NOT NULL, length INTEGER NOT NULL,"
                " flags INTEGER NOT NULL, crc INTEGER,"
                " PRIMARY KEY (volume_id, block)) WITHOUT ROWID"
            )
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
        elif version == 1:  # before tenants: every volume belongs to the default tenant
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                f"ALTER TABLE volumes ADD COLUMN tenant TEXT NOT NULL DEFAULT '{DEFAULT_TENANT}'"
            )
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
            log.info("upgraded the volume catalog", extra={"schema_version": SCHEMA_VERSION})

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, _sqlite_errors():
            self._check_open()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...]) -> builtins.list[Any]:
        with self._lock, _sqlite_errors():
            self._check_open()
            return self._db.execute(sql, args).fetchall()

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the volume store is closed")

    def volumes(self) -> builtins.list[VolumeRow]:
        """See `Catalog.volumes`."""
        rows = self._query(
            "SELECT volume_id, size_bytes, block_size, crc32c, compression, encryption,"
            " sealed_key, create_ns, update_ns, tenant FROM volumes",
            (),
        )
        result = []
        for vid, size, bs, crc, comp, enc, sealed, create_ns, update_ns, tenant in rows:
            try:
                services = DataServices(bool(crc), Compression(comp), Encryption(enc))
            except ValueError:
                raise DataCorruption(f"volume {vid!r} has unknown data services") from None
            info = VolumeInfo(vid, size, bs, services, create_ns, update_ns, tenant)
            result.append(VolumeRow(info, None if sealed is None else bytes(sealed)))
        return result

    def add_volume(self, row: VolumeRow) -> None:
        """See `Catalog.add_volume`."""
        info = row.info
        with self._tx() as db:
            db.execute(
                "INSERT INTO volumes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    info.volume_id,
                    info.size_bytes,
                    info.block_size,
                    int(info.services.crc32c),
                    str(info.services.compression),
                    str(info.services.encryption),
                    row.sealed_key,
                    info.create_ns,
                    info.update_ns,
                    info.tenant,
                ),
            )

    def remove_volume(self, volume_id: str) -> None:
        """See `Catalog.remove_volume`."""
        with self._tx() as db:
            db.execute("DELETE FROM blocks WHERE volume_id = ?", (volume_id,))
            db.execute("DELETE FROM volumes WHERE volume_id = ?", (volume_id,))

    def set_size(
        self, volume_id: str, size_bytes: int, update_ns: int, drop_from_block: int | None
    ) -> None:
        """See `Catalog.set_size`."""
        with self._tx() as db:
            db.execute(
                "UPDATE volumes SET size_bytes = ?, update_ns = ? WHERE volume_id = ?",
                (size_bytes, update_ns, volume_id),
            )
            if drop_from_block is not None:
                db.execute(
                    "DELETE FROM blocks WHERE volume_id = ? AND block >= ?",
                    (volume_id, drop_from_block),
                )

    def block_records(self, volume_id: str, first: int, count: int) -> dict[int, BlockRecord]:
        """See `Catalog.block_records`."""
        rows = self._query(
            "SELECT block, length, flags, crc FROM blocks"
            " WHERE volume_id = ? AND block >= ? AND block < ?",
            (volume_id, first, first + count),
        )
        return {block: BlockRecord(length, flags, crc) for block, length, flags, crc in rows}

    def has_blocks_from(self, volume_id: str, first: int) -> bool:
        """See `Catalog.has_blocks_from`."""
        return bool(
            self._query(
                "SELECT 1 FROM blocks WHERE volume_id = ? AND block >= ? LIMIT 1",
                (volume_id, first),
            )
        )

    def put_blocks(self, volume_id: str, records: Mapping[int, BlockRecord]) -> None:
        """See `Catalog.put_blocks`."""
        with self._tx() as db:
            db.executemany(
                "INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?, ?)",
                ((volume_id, b, r.length, r.flags, r.crc) for b, r in records.items()),
            )

    def drop_blocks(self, volume_id: str, first: int, count: int) -> None:
        """See `Catalog.drop_blocks`."""
        with self._tx() as db:
            db.execute(
                "DELETE FROM blocks WHERE volume_id = ? AND block >= ? AND block < ?",
                (volume_id, first, first + count),
            )

    def close(self) -> None:
        """See `Catalog.close`."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()


@contextlib.contextmanager
def _sqlite_errors() -> Iterator[None]:
    """Turn SQLite failures into domain errors."""
    try:
        yield
    except sqlite3.Error as exc:
        code = getattr(exc, "sqlite_errorcode", None)
        if code == sqlite3.SQLITE_FULL:
            raise ResourceExhausted("no space left for the volume catalog") from exc
        if code == sqlite3.SQLITE_CORRUPT:
            raise DataCorruption(f"the volume catalog is damaged: {exc}") from exc
        raise Unavailable(f"the volume catalog failed: {exc}") from exc


class FileVolumeStore(BlockVolumeStore):
    """Volumes as sparse files under `directory`, surviving restarts (see the module doc).

    Space policy: `shutil.disk_usage(directory).free` must cover the size of a new
    volume, or the growth of a resized one; nothing is reserved (files are sparse).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self._volume_dir = self.directory / "volumes"
        self._lock_fd = -1
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._volume_dir.mkdir(mode=0o700, exist_ok=True)
        self._lock_fd = _lock_directory(self.directory / "store.lock")
        try:
            sealer = KeySealer(load_or_create_master_key(self.directory / "master.key"))
            catalog = SqliteCatalog(self.directory / "catalog.sqlite")
            try:
                super().__init__(catalog, sealer, max_volume_bytes=max_volume_bytes)
                self._remove_orphans()
            except BaseException:
                catalog.close()
                raise
        except BaseException:
            self._close_backend()
            raise

    def __repr__(self) -> str:
        return f"FileVolumeStore({str(self.directory)!r})"

    def _path(self, volume_id: str) -> Path:
        return self._volume_dir / f"{volume_id}{VOLUME_SUFFIX}"

    def _remove_orphans(self) -> None:
        known = {info.volume_id for info in self.list()}
        removed = False
        for path in self._volume_dir.iterdir():
            if path.suffix == VOLUME_SUFFIX and path.stem not in known:
                log.warning(
                    "removing a volume file the catalog does not know", extra={"path": str(path)}
                )
                path.unlink()
                removed = True
        if removed:
            fsync_dir(self._volume_dir)

    def _create_device(self, info: VolumeInfo) -> BlockDevice:
        path = self._path(info.volume_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, info.size_bytes)
            os.fsync(fd)
            fsync_dir(self._volume_dir)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return FileDevice(fd, path)

    def _open_device(self, info: VolumeInfo) -> BlockDevice:
        path = self._path(info.volume_id)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise DataCorruption(f"volume {info.volume_id!r}: its data file is missing") from None
        try:
            if os.fstat(fd).st_size != info.size_bytes:
                log.warning(
                    "setting a volume file back to its recorded size",
                    extra={"volume_id": info.volume_id, "size_bytes": info.size_bytes},
                )
                os.ftruncate(fd, info.size_bytes)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return FileDevice(fd, path)

    def _destroy_device(self, volume_id: str) -> None:
        self._path(volume_id).unlink(missing_ok=True)
        fsync_dir(self._volume_dir)

    def _free_bytes(self) -> int:
        return shutil.disk_usage(self.directory).free

    def _close_backend(self) -> None:
        if self._lock_fd >= 0:
            fd, self._lock_fd = self._lock_fd, -1
            os.close(fd)  # releases the flock


def _lock_directory(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FailedPrecondition(
            f"the volume store {path.parent} is open in another store or process"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd
