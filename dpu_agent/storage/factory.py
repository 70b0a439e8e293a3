"""Open a volume store by backend name, as the agent's configuration names it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from dpu_agent.errors import InvalidArgument
from dpu_agent.storage.engine import DEFAULT_MAX_VOLUME_BYTES
from dpu_agent.storage.file_backend import FileVolumeStore
from dpu_agent.storage.memory_backend import MemoryVolumeStore

if TYPE_CHECKING:
    import os

    from dpu_agent.storage.backend import VolumeStore

BACKENDS: Final = ("file", "memory")


def open_store(
    backend: str,
    directory: str | os.PathLike[str] | None = None,
    *,
    max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
) -> VolumeStore:
    """Open the `file` store in `directory`, or a new `memory` store."""
    if backend == "file":
        if directory is None:
            raise InvalidArgument("the file backend needs a directory")
        return FileVolumeStore(directory, max_volume_bytes=max_volume_bytes)
    if backend == "memory":
        return MemoryVolumeStore(max_volume_bytes=max_volume_bytes)
    raise InvalidArgument(f"unknown storage backend {backend!r} (one of {', '.join(BACKENDS)})")
