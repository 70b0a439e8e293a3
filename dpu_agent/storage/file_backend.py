"""The `file` backend (the default): the copy-on-write engine over files in a directory.

Layout of the store directory (mode 0700; every file mode 0600):

    store.lock        held (flock) by the one store that has the directory open
    master.key        32 random bytes: seals the volume keys (see keys.py)
    pool              every volume's and snapshot's blocks, and the metadata log
    checkpoint.0/1    the metadata as of a point in the log (see layout.py)

A directory in the format before engine v2 (`catalog.sqlite` and `volumes/*.vol`)
is upgraded when it is first opened (see legacy.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Final

from dpu_agent.errors import FailedPrecondition
from dpu_agent.storage.engine import DEFAULT_MAX_VOLUME_BYTES, CowVolumeStore
from dpu_agent.storage.journal import DEFAULT_CHECKPOINT_LOG_BYTES
from dpu_agent.storage.keys import MASTER_KEY_BYTES, KeySealer
from dpu_agent.storage.legacy import LegacyStore
from dpu_agent.storage.media import FileMedia, fsync_dir

log = logging.getLogger(__name__)

LOCK_FILE: Final = "store.lock"
MASTER_KEY_FILE: Final = "master.key"


def load_or_create_master_key(path: Path) -> bytes:
    """Read the master key file, creating it (mode 0600, 32 random bytes) if absent.

    A file that group or others may access, or of the wrong size, is refused. On a
    BlueField the master key would come from secure storage (TPM, secure-boot keys)
    instead of a file next to the data.
    """
    if not path.exists():
        _create_master_key(path)
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


def _create_master_key(path: Path) -> None:
    """Write a new key beside `path`, sync it, then link it in: whole or not there at all.

    (Created in place, a crash between the create and the write left an empty key file,
    and every later open was refused.) A leftover of such a crash is overwritten.
    """
    new = path.with_name(path.name + ".new")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover may have had another mode
        os.write(fd, os.urandom(MASTER_KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(new, path)  # never over a key that is there
    except FileExistsError:
        pass
    else:
        log.info("created the store's master key", extra={"path": str(path)})
    finally:
        new.unlink()
        fsync_dir(path.parent)


class FileVolumeStore(CowVolumeStore):
    """Volumes in a pool file under `directory`, surviving restarts and crashes."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
        checkpoint_log_bytes: int = DEFAULT_CHECKPOINT_LOG_BYTES,
    ) -> None:
        self.directory = Path(directory)
        self._lock_fd = -1
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.directory / LOCK_FILE)
        legacy = None
        try:
            sealer = KeySealer(load_or_create_master_key(self.directory / MASTER_KEY_FILE))
            if LegacyStore.present(self.directory):
                legacy = LegacyStore(self.directory)
            super().__init__(
                FileMedia(self.directory),
                sealer,
                max_volume_bytes=max_volume_bytes,
                checkpoint_log_bytes=checkpoint_log_bytes,
                legacy=legacy,
            )
        except BaseException:
            if legacy is not None:
                legacy.close()
            self._release_lock()
            raise

    def __repr__(self) -> str:
        return f"FileVolumeStore({str(self.directory)!r})"

    def close(self) -> None:
        """See `VolumeStore.close`; releases the directory."""
        try:
            super().close()
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
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
