"""Per-volume I/O counters and latency histogram."""

from __future__ import annotations

import bisect
import threading

from dpu_agent.storage.types import LATENCY_BOUNDS_US, U64_MASK, VolumeStats


class StatsCounter:
    """Thread-safe counters of one volume; `snapshot()` gives a VolumeStats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_ops = self._write_ops = self._read_bytes = self._write_bytes = 0
        self._errors = 0
        self._counts = [0] * len(LATENCY_BOUNDS_US)

    def _sample(self, seconds: float, count: int = 1) -> None:
        micros = max(0, int(seconds * 1_000_000))
        i = min(bisect.bisect_left(LATENCY_BOUNDS_US, micros), len(self._counts) - 1)
        self._counts[i] = (self._counts[i] + count) & U64_MASK

    def read(self, nbytes: int, seconds: float) -> None:
        """Count a successful read of `nbytes` that took `seconds`."""
        with self._lock:
            self._read_ops = (self._read_ops + 1) & U64_MASK
            self._read_bytes = (self._read_bytes + nbytes) & U64_MASK
            self._sample(seconds)

    def write(self, nbytes: int, seconds: float, count: int = 1) -> None:
        """Count `count` successful writes of `nbytes` in all, each of which took `seconds`."""
        with self._lock:
            self._write_ops = (self._write_ops + count) & U64_MASK
            self._write_bytes = (self._write_bytes + nbytes) & U64_MASK
            self._sample(seconds, count)

    def error(self) -> None:
        """Count a failed call."""
        with self._lock:
            self._errors = (self._errors + 1) & U64_MASK

    def snapshot(self) -> VolumeStats:
        """The counters now."""
        with self._lock:
            return VolumeStats(
                read_ops=self._read_ops,
                write_ops=self._write_ops,
                read_bytes=self._read_bytes,
                write_bytes=self._write_bytes,
                errors=self._errors,
                latency_bounds_us=LATENCY_BOUNDS_US,
                latency_counts=tuple(self._counts),
            )
