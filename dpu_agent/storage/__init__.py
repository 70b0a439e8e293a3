"""The agent's volume store: block volumes on the DPU with per-block data services.

`VolumeStore` is the interface the storage service uses; `FileVolumeStore` (a pool
file and a metadata log, the default) and `MemoryVolumeStore` implement it, both on
the copy-on-write engine (`engine.py`) with snapshots, clones and QoS. `open_store`
picks one by name, as the agent's configuration does.
"""

from dpu_agent.storage.backend import VolumeStore
from dpu_agent.storage.engine import DEFAULT_MAX_VOLUME_BYTES
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
    QosLimits,
    SnapshotInfo,
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
    "QosLimits",
    "SnapshotInfo",
    "VolumeInfo",
    "VolumeStats",
    "VolumeStore",
    "open_store",
]
