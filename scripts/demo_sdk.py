"""The SDK part of `make demo`: what a host program does with the agent."""

import asyncio
import sys

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


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
