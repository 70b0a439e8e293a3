"""The `memory` backend: volumes in RAM, gone with the process. For tests and the demo.

The same engine as the file backend (engine.py) over files kept in RAM (media.py),
so data services, snapshots, clones, QoS, checks, errors and statistics are
identical; only durability differs. Volume keys are sealed under a master key that
exists only in this process.

The store holds at most `capacity_bytes` of RAM (the pool: volume data and the
metadata log; and the checkpoints), as a file system holds at most its size, so a
tenant writing into thin volumes cannot grow the agent until the kernel kills it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Final

from dpu_agent.errors import InvalidArgument
from dpu_agent.storage.engine import DEFAULT_MAX_VOLUME_BYTES, CowVolumeStore
from dpu_agent.storage.keys import MASTER_KEY_BYTES, KeySealer
from dpu_agent.storage.media import MemoryMedia

# The default capacity: this share of the memory available when the store opens.
DEFAULT_CAPACITY_SHARE: Final = 0.5
_PROC: Final = Path("/proc")
_CGROUPS: Final = Path("/sys/fs/cgroup")
# (limit, usage) files of a memory cgroup: v2, v1 (mounted under cgroups/memory)
_V2_FILES: Final = ("memory.max", "memory.current")
_V1_FILES: Final = ("memory.limit_in_bytes", "memory.usage_in_bytes")


class MemoryVolumeStore(CowVolumeStore):
    """Volumes in RAM, at most `capacity_bytes` of it.

    `capacity_bytes` defaults to `DEFAULT_CAPACITY_SHARE` of the memory available when
    the store opens (`memory_limits`). Space policy as for files: volumes are thin, so
    together they may promise more than the capacity; one is refused when it is larger
    than the capacity minus what the store's chunks take now. A write that would make
    the store hold more than the capacity fails with ResourceExhausted ("no space left
    for volume data") and changes nothing, as on a full disk; a trim or a delete makes
    its room writable again (the RAM stays with the store, which reuses it).
    """

    def __init__(
        self,
        *,
        max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
        capacity_bytes: int | None = None,
    ) -> None:
        if capacity_bytes is None:
            capacity_bytes = default_capacity()
        if capacity_bytes <= 0:
            raise InvalidArgument(f"the memory store's capacity {capacity_bytes} is not positive")
        self._memory = MemoryMedia(capacity_bytes)
        super().__init__(
            self._memory,
            KeySealer(secrets.token_bytes(MASTER_KEY_BYTES)),
            max_volume_bytes=max_volume_bytes,
            capacity_bytes=capacity_bytes,
        )

    def __repr__(self) -> str:
        return f"MemoryVolumeStore(volumes={len(self._volumes)})"

    @property
    def capacity_bytes(self) -> int:
        """The most RAM the store holds."""
        capacity = self._memory.capacity_bytes
        assert capacity is not None  # noqa: S101 - set in __init__
        return capacity

    @property
    def held_bytes(self) -> int:
        """The RAM the store holds now (volume data, the log, checkpoints)."""
        return self._memory.held_bytes


def default_capacity() -> int:
    """`DEFAULT_CAPACITY_SHARE` of the memory available now (`memory_limits`)."""
    return int(memory_limits()[1] * DEFAULT_CAPACITY_SHARE)


def memory_limits(proc: Path = _PROC, cgroups: Path = _CGROUPS) -> tuple[int, int]:
    """(total, available) bytes of memory this process may use.

    MemTotal and MemAvailable of /proc/meminfo, each lowered to the memory limit of the
    process's cgroup and of every cgroup above it (available: the limit less the
    cgroup's usage), v2 (memory.max, memory.current) or v1 (memory.limit_in_bytes,
    memory.usage_in_bytes: the usage counts the page cache, so this errs low). In a
    container the cgroup's limit is where the kernel kills the agent, not the host's RAM.
    """
    total, available = _meminfo(proc / "meminfo")
    for directory, (limit_file, usage_file) in _memory_cgroups(proc, cgroups):
        limit = _read_int(directory / limit_file)
        if limit is None:
            continue
        usage = _read_int(directory / usage_file) or 0
        total = min(total, limit)
        available = min(available, max(0, limit - usage))
    return total, available


def _meminfo(path: Path) -> tuple[int, int]:
    fields: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            fields[name] = int(value[0]) * (1024 if value[1:] == ["kB"] else 1)
    page = os.sysconf("SC_PAGE_SIZE")
    total = fields.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * page
    available = fields.get("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * page
    return total, available


def _memory_cgroups(proc: Path, cgroups: Path) -> list[tuple[Path, tuple[str, str]]]:
    """The directories of the process's memory cgroups, innermost first, with their files."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:  # hierarchy-ID:controllers:path
            continue
        _, controllers, path = parts
        if not controllers:
            root, files = cgroups, _V2_FILES
        elif "memory" in controllers.split(","):
            root, files = cgroups / "memory", _V1_FILES
        else:
            continue
        here = root / path.lstrip("/")
        if not here.is_dir():  # a namespaced view: the root is the process's own cgroup
            here = root
        while True:
            found.append((here, files))
            if here == root or root not in here.parents:
                break
            here = here.parent
    return found


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None if absent or "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
