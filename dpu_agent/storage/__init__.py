"""The agent's volume store: block volumes on the DPU with per-block data services.

`VolumeStore` is the interface the storage service uses; `FileVolumeStore` (sparse
files and SQLite, the default) and `MemoryVolumeStore` implement it. `open_store`
picks one by name, as the agent's configuration does.
"""

from dpu_agent.storage.backend import VolumeStore
from dpu_agent.storage.blockstore import DEFAULT_MAX_VOLUME_BYTES
from dpu_agent.storage.errors import DataCorruption
from dpu_agent.storage.factory import BACKENDS, open_store
from dpu_agent.storage.file_backend import FileVolumeStore
from dpu_agent.storage.memory_backend import MemoryVolumeStore
from dpu_agent.storage.types import (
    BLOCK_SIZES,
    LATENCY_BOUNDS_US,
    Compression,
    DataServices,
    Encryption,
    VolumeInfo,
    VolumeStats,
)

__all__ = [
    "BACKENDS",
    "BLOCK_SIZES",
    "DEFAULT_MAX_VOLUME_BYTES",
    "LATENCY_BOUNDS_US",
    "Compression",
    "DataCorruption",
    "DataServices",
    "Encryption",
    "FileVolumeStore",
    "MemoryVolumeStore",
    "VolumeInfo",
    "VolumeStats",
    "VolumeStore",
    "open_store",
]
