"""Where the store's bytes live: a few named files, behind a small interface.

The engine (`engine.py`) does every byte of its I/O through `StoreMedia` (a
directory of named files) and `StoreFile` (one file: positional reads and writes,
sync, discard). Two media ship with the agent: `FileMedia` (real files in a
directory: the `file` backend) and `MemoryMedia` (files in RAM: the `memory`
backend). A test can put its own underneath, e.g. one that keeps writes in a
volatile cache until `sync` and loses or tears them on a simulated power cut
(`tests/torture/`).

The contract the engine relies on, and nothing more:

- `pwrite` then `pread` of the same range returns the data (no sync needed);
- after `sync()` returns, every write to that file issued before the call survives
  a crash; writes not covered by a sync may survive whole, in part (any subset of
  their 512-byte sectors), or not at all, in any order;
- never-written ranges and discarded ranges read as zeros; reads past the end of a
  file read as zeros;
- `open` of a new file makes its directory entry durable before it returns.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import os
import shutil
import threading
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02
_ZERO_CHUNK: Final = 1 << 20


class StoreFile(abc.ABC):
    """One file of the store. Thread-safe: calls may overlap."""

    @abc.abstractmethod
    def pread(self, length: int, offset: int) -> bytes:
        """`length` bytes at `offset`; holes and the space past the end read as zeros."""

    @abc.abstractmethod
    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        """Store all of `data` at `offset` (durable at the next `sync`)."""

    def pwritev(self, buffers: Sequence[bytes | bytearray | memoryview], offset: int) -> None:
        """Store the buffers back to back from `offset`."""
        for buffer in buffers:
            self.pwrite(buffer, offset)
            offset += memoryview(buffer).nbytes

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every write issued before this call durable (fdatasync)."""

    @abc.abstractmethod
    def discard(self, offset: int, length: int) -> None:
        """The range reads as zeros from now on, and gives its space back where possible."""

    @abc.abstractmethod
    def data_ranges(self) -> list[tuple[int, int]]:
        """The [start, end) ranges that hold space (written, not discarded), in order."""

    @abc.abstractmethod
    def size(self) -> int:
        """The end of the file (the highest byte written, at least)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the file; a second call does nothing."""


class StoreMedia(abc.ABC):
    """A directory of the store's named files."""

    @abc.abstractmethod
    def open(self, name: str) -> StoreFile:
        """The file `name`, created empty (and its entry made durable) if missing."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool:
        """True if the file `name` exists."""

    @abc.abstractmethod
    def remove(self, name: str) -> None:
        """Remove the file `name` (durably); no error if it is missing."""

    @abc.abstractmethod
    def free_bytes(self) -> int:
        """Space the files may still grow into."""


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class File(StoreFile):
    """A real file opened for positional I/O."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path
        self._punch = _fallocate is not None

    def __repr__(self) -> str:
        return f"File({str(self.path)!r})"

    @property
    def fd(self) -> int:
        """The file descriptor (valid until `close`)."""
        return self._fd

    def pread(self, length: int, offset: int) -> bytes:
        """See `StoreFile.pread`."""
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

    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        """See `StoreFile.pwrite`."""
        done = os.pwrite(self._fd, data, offset)
        if done == len(data):
            return
        view = memoryview(data).cast("B")
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def pwritev(self, buffers: Sequence[bytes | bytearray | memoryview], offset: int) -> None:
        """See `StoreFile.pwritev`."""
        total = sum(memoryview(b).nbytes for b in buffers)
        done = os.pwritev(self._fd, buffers, offset)
        if done < total:  # a short write: finish it the simple way
            rest = b"".join(bytes(b) for b in buffers)[done:]
            self.pwrite(rest, offset + done)

    def sync(self) -> None:
        """See `StoreFile.sync`: fdatasync."""
        os.fdatasync(self._fd)

    def discard(self, offset: int, length: int) -> None:
        """See `StoreFile.discard`: punch a hole, or write zeros."""
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
            self.pwrite(zeros[: min(_ZERO_CHUNK, offset + length - at)], at)

    def data_ranges(self) -> list[tuple[int, int]]:
        """See `StoreFile.data_ranges`: SEEK_DATA / SEEK_HOLE (the whole file without them)."""
        end = self.size()
        ranges = []
        at = 0
        try:
            while at < end:
                start = os.lseek(self._fd, at, os.SEEK_DATA)
                stop = os.lseek(self._fd, start, os.SEEK_HOLE)
                ranges.append((start, stop))
                at = stop
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data after `at`
                return ranges
            if exc.errno in {errno.EINVAL, errno.EOPNOTSUPP}:
                return [(0, end)] if end else []
            raise
        return ranges

    def size(self) -> int:
        """See `StoreFile.size`."""
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        """See `StoreFile.close`."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class FileMedia(StoreMedia):
    """Files in a directory (mode 0600 files; the directory is the caller's)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __repr__(self) -> str:
        return f"FileMedia({str(self.directory)!r})"

    def open(self, name: str) -> File:
        """See `StoreMedia.open`."""
        path = self.directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.fsync(fd)
                fsync_dir(self.directory)
            except BaseException:
                os.close(fd)
                raise
        return File(fd, path)

    def exists(self, name: str) -> bool:
        """See `StoreMedia.exists`."""
        return (self.directory / name).exists()

    def remove(self, name: str) -> None:
        """See `StoreMedia.remove`."""
        path = self.directory / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        fsync_dir(self.directory)

    def free_bytes(self) -> int:
        """See `StoreMedia.free_bytes`."""
        return shutil.disk_usage(self.directory).free


class MemoryFile(StoreFile):
    """A file in RAM: a bytearray that grows as it is written.

    Its growth is charged to `media` (`MemoryMedia.take`): a write that would grow it
    past the media's capacity fails with OSError(ENOSPC) before it changes anything.
    """

    def __init__(self, media: MemoryMedia | None = None) -> None:
        self._lock = threading.Lock()
        self._data = bytearray()
        self._media = media

    def _grow_to(self, end: int) -> None:
        """Make the file at least `end` bytes long (zeros). Call under the lock."""
        grow = end - len(self._data)
        if grow > 0:
            if self._media is not None:
                self._media.take(grow)
            self._data.extend(bytes(grow))

    def pread(self, length: int, offset: int) -> bytes:
        """See `StoreFile.pread`."""
        with self._lock:
            got = bytes(self._data[offset : offset + length])
        if len(got) < length:
            got += bytes(length - len(got))
        return got

    def pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        """See `StoreFile.pwrite`; OSError(ENOSPC), nothing written, past the capacity."""
        n = memoryview(data).nbytes
        with self._lock:
            self._grow_to(offset + n)
            self._data[offset : offset + n] = data

    def pwritev(self, buffers: Sequence[bytes | bytearray | memoryview], offset: int) -> None:
        """See `StoreFile.pwritev`: all of them, or (ENOSPC) none."""
        sizes = [memoryview(buffer).nbytes for buffer in buffers]
        with self._lock:
            self._grow_to(offset + sum(sizes))
            for buffer, n in zip(buffers, sizes, strict=True):
                self._data[offset : offset + n] = buffer
                offset += n

    def sync(self) -> None:
        """See `StoreFile.sync`: RAM is as durable as it gets."""

    def discard(self, offset: int, length: int) -> None:
        """See `StoreFile.discard`: zeros; the bytes stay held (the store reuses the range)."""
        with self._lock:
            end = min(offset + length, len(self._data))
            if end > offset:
                self._data[offset:end] = bytes(end - offset)

    def data_ranges(self) -> list[tuple[int, int]]:
        """See `StoreFile.data_ranges`: everything up to the end."""
        with self._lock:
            return [(0, len(self._data))] if self._data else []

    def size(self) -> int:
        """See `StoreFile.size`."""
        with self._lock:
            return len(self._data)

    def detach(self) -> int:
        """Stop charging growth to the media; returns the bytes the file holds."""
        with self._lock:
            self._media = None
            return len(self._data)

    def close(self) -> None:
        """See `StoreFile.close`: the data stays with the media."""


class MemoryMedia(StoreMedia):
    """Files in RAM, for the `memory` backend.

    With `capacity_bytes` the files together hold at most that many bytes, as a file
    system holds at most its size: a write that would grow a file past it fails with
    OSError(ENOSPC) and writes nothing. A discard gives nothing back (the range stays
    allocated, and the store reuses it); removing a file gives back all it held.
    Without it (None) the files grow until the process runs out of memory.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes {capacity_bytes} is not positive")
        self._files: dict[str, MemoryFile] = {}
        self._lock = threading.Lock()
        self._capacity = capacity_bytes
        self._held = 0

    @property
    def capacity_bytes(self) -> int | None:
        """The most the files may hold together (None: no bound)."""
        return self._capacity

    @property
    def held_bytes(self) -> int:
        """The bytes the files hold now."""
        with self._lock:
            return self._held

    def take(self, nbytes: int) -> None:
        """Charge `nbytes` of growth; OSError(ENOSPC), nothing charged, past the capacity."""
        with self._lock:
            if self._capacity is not None and self._held + nbytes > self._capacity:
                raise OSError(
                    errno.ENOSPC,
                    f"the memory store holds {self._held} bytes of its capacity of "
                    f"{self._capacity}; {nbytes} more do not fit",
                )
            self._held += nbytes

    def open(self, name: str) -> MemoryFile:
        """See `StoreMedia.open`."""
        with self._lock:
            found = self._files.get(name)
            if found is None:
                found = self._files[name] = MemoryFile(self)
            return found

    def exists(self, name: str) -> bool:
        """See `StoreMedia.exists`."""
        with self._lock:
            return name in self._files

    def remove(self, name: str) -> None:
        """See `StoreMedia.remove`."""
        with self._lock:
            found = self._files.pop(name, None)
        if found is not None:  # the file's lock is taken before the media's, never inside it
            size = found.detach()
            with self._lock:
                self._held -= size

    def free_bytes(self) -> int:
        """See `StoreMedia.free_bytes`: what the capacity leaves, else the memory available."""
        if self._capacity is not None:
            with self._lock:
                return max(0, self._capacity - self._held)
        with contextlib.suppress(ValueError, OSError):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return 1 << 40
