"""Volume I/O through the data plane, shared by the tcp (host) and verbs (VM) suites.

For each combination of data services a volume is created; random data goes in
through host buffers (the agent READs them and stores), comes back (the agent
loads, verifies, WRITEs into host buffers), and every byte is compared.
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING

from dpu_wire.v1 import job_pb2

if TYPE_CHECKING:
    import host_client

MiB = 1 << 20
COMBINATIONS = list(
    itertools.product((False, True), ("none", "lz4", "zstd"), ("none", "aes-xts-256"))
)


def compressible(size: int) -> bytes:
    """Half random, half repeated text, so compression has something to do."""
    text = b"dpu offload volume block " * (size // 50 + 1)
    return (os.urandom(size // 2) + text)[:size]


async def round_trips(client: host_client.Client, transport: str, prefix: str) -> int:
    """Write and read back each combination; return the bytes checked."""
    checked = 0
    async with await client.open_session(transport=transport, queue_depth=8) as session:
        src = await session.alloc(2 * MiB, readable=True)
        dst = await session.alloc(2 * MiB, writable=True)
        for index, (crc, compression, encryption) in enumerate(COMBINATIONS):
            name = f"volumes/{prefix}-{index}"
            await client.create_volume(
                name.removeprefix("volumes/"),
                8 * MiB,
                crc32c=crc,
                compression=compression,
                encryption=encryption,
            )
            data = compressible(2 * MiB)
            src.view[:] = data
            # multi-block at an offset, then a single block, then the fast and slow paths
            await session.write_volume(name, 4 * MiB, src, fua=True)
            await session.write_volume(name, 4096, src[0:4096])
            await session.read_volume(name, 4 * MiB, dst)
            assert dst.view == data, f"{name}: bytes differ after a round trip"
            spec = job_pb2.JobSpec()
            spec.volume_read.volume = name
            spec.volume_read.offset = 4096
            spec.volume_read.destination.CopyFrom(dst[0:4096].region_ref())
            (await (await session.submit_spec(spec))).raise_for_status()
            assert dst.view[:4096] == data[:4096], f"{name}: the RPC read differs"
            unwritten = dst[8192:16384]
            await session.read_volume(name, 8192, unwritten)
            assert dst.view[8192:16384] == bytes(8192), f"{name}: unwritten blocks are not zero"
            checked += 2 * MiB + 4096 + 8192
    return checked
