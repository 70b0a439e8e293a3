"""Open a volume store by backend name, as the agent's configuration names it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from dpu_agent.errors import InvalidArgument
from dpu_agent.storage.engine import DEFAULT_MAX_VOLUME_BYTES
from dpu_agent.storage.file_backend import FileVolumeStore
from dpu_agent.storage.memory_backend import MemoryVolumeStore, memory_limits

if TYPE_CHECKING:
    import os

    from dpu_agent.storage.backend import VolumeStore

BACKENDS: Final = ("file", "memory")


def open_store(
    backend: str,
    directory: str | os.PathLike[str] | None = None,
    *,
    max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
    memory_capacity_bytes: int = 0,
) -> VolumeStore:
    """Open the `file` store in `directory`, or a new `memory` store.

    `memory_capacity_bytes`: the most RAM a `memory` store holds (0: its default, a
    share of the memory available now); more than the memory this process may use at
    all (`memory_limits`) is refused, as such a bound would not hold.
    """
    if backend == "file":
        if directory is None:
            raise InvalidArgument("the file backend needs a directory")
        return FileVolumeStore(directory, max_volume_bytes=max_volume_bytes)
    if backend == "memory":
        if memory_capacity_bytes < 0:
            raise InvalidArgument(f"memory capacity {memory_capacity_bytes} is negative")
        total = memory_limits()[0]
        if memory_capacity_bytes > total:
            raise InvalidArgument(
                f"a memory capacity of {memory_capacity_bytes} bytes is more than the "
                f"{total} bytes of memory this process may use (MemTotal, or its cgroup's limit)"
            )
        return MemoryVolumeStore(
            max_volume_bytes=max_volume_bytes, capacity_bytes=memory_capacity_bytes or None
        )
    raise InvalidArgument(f"unknown storage backend {backend!r} (one of {', '.join(BACKENDS)})")
