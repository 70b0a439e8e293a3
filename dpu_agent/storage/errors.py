"""Errors of the volume store beyond the agent's common set (`dpu_agent.errors`).

    AgentError
    └── DataLoss
        └── DataCorruption   stored data failed its end-to-end check, or cannot be decoded

The store raises the common domain errors (InvalidArgument, NotFound, ...) for
everything else. Messages never contain key material.
"""

from __future__ import annotations

from dpu_agent.errors import DataLoss


class DataCorruption(DataLoss):
    """Stored data failed its CRC32C check or could not be decoded; nothing is returned.

    The service maps it to DATA_LOSS. A store never hands out data that failed a
    check, and never retries silently.
    """
