"""The SDK part of `make demo`: what a host program does with the agent."""

import asyncio
import os
import sys

import crc32c

import host_client


async def main(target: str) -> None:
    """Connect, read the agent's identity and health, list what it serves."""
    async with host_client.Client(target) as client:
        await client.wait_ready(10)
        info = await client.agent_info()
        print(f"  connected to {info.name} {info.version} on {info.hostname} ({info.machine})")
        print(f"  overall health: {await client.health()}")
        for cap in info.capabilities:
            state = "served" if cap.available else f"not yet: {cap.reason}"
            print(f"  {cap.service:<32} {state}")
        devices = ", ".join(d.name for d in info.rdma_devices) or "none on this machine"
        print(f"  RDMA devices: {devices}")
        async with await client.open_session(transport="auto", label="demo") as session:
            print(f"  opened {session.name} over {session.transport}")
            src = await session.alloc(1 << 20, readable=True)
            dst = await session.alloc(1 << 20, writable=True)
            src.view[:] = os.urandom(1 << 20)
            done = await session.copy(src, dst)
            same = "identical" if dst.view == src.view else "DIFFERENT"
            took = (done.end_ns - done.start_ns) / 1e6
            print(f"  copy job {done.job_id}: {done.bytes_written} bytes in {took:.2f} ms, {same}")
            crc = await session.crc32c(src)
            here = crc32c.crc32c(src.view)
            print(f"  crc32c job on the DPU: {crc:#010x} (the host computes {here:#010x})")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
