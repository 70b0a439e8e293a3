"""Page-aligned anonymous memory with a stable virtual address."""

from __future__ import annotations

import ctypes
import mmap


def allocate(length: int) -> tuple[mmap.mmap, int]:
    """Anonymous mapping of at least one byte and its virtual address."""
    if length < 0:
        raise ValueError(f"region length must not be negative, got {length}")
    mm = mmap.mmap(-1, max(length, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    del anchor  # drop the buffer export so the mapping can be closed later
    return mm, addr
