"""The `memory` backend: volumes in RAM, gone with the process. For tests and the demo.

The same engine as the file backend (engine.py) over files kept in RAM (media.py),
so data services, snapshots, clones, QoS, checks, errors and statistics are
identical; only durability differs. Volume keys are sealed under a master key that
exists only in this process.
"""

from __future__ import annotations

import secrets

from dpu_agent.storage.engine import DEFAULT_MAX_VOLUME_BYTES, CowVolumeStore
from dpu_agent.storage.keys import MASTER_KEY_BYTES, KeySealer
from dpu_agent.storage.media import MemoryMedia


class MemoryVolumeStore(CowVolumeStore):
    """Volumes in RAM.

    Space policy as for files: volumes are thin, and one is refused when it is larger
    than `capacity_bytes` (default: the physical memory available when asked) minus
    what the store's blocks take now.
    """

    def __init__(
        self,
        *,
        max_volume_bytes: int = DEFAULT_MAX_VOLUME_BYTES,
        capacity_bytes: int | None = None,
    ) -> None:
        super().__init__(
            MemoryMedia(),
            KeySealer(secrets.token_bytes(MASTER_KEY_BYTES)),
            max_volume_bytes=max_volume_bytes,
            capacity_bytes=capacity_bytes,
        )

    def __repr__(self) -> str:
        return f"MemoryVolumeStore(volumes={len(self._volumes)})"
