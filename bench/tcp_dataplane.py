"""The tcp data plane on loopback vs a raw TCP socket on loopback, same run.

- reference: one TCP connection on 127.0.0.1, a thread sending `size`-byte messages
  with sendall and a thread receiving them with recv_into (no framing, no acks);
- ours (transport): `TcpAgentTransport.write` of `size` bytes into a host region,
  8 writes in flight, each acknowledged (what a job's RDMA WRITE costs);
- ours (jobs): crc32c jobs of `size` bytes through a real agent process and the SDK
  (capsule in, RDMA-style READ of the host buffer, CRC, completion capsule out).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import host_client
from bench.common import Result, agent_process, write_results
from dpu_wire.transport.base import Access
from dpu_wire.transport.tcp import TcpAgentTransport, TcpHostTransport

SECONDS = 2.0
IN_FLIGHT = 8
SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)
MB = 1e6


def raw_socket_mbps(size: int) -> float:
    """MB/s of a bare TCP stream on loopback, `size`-byte sends."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def receive() -> None:
        conn, _ = server.accept()
        buf = memoryview(bytearray(size))
        with conn:
            while n := conn.recv_into(buf):
                received[0] += n

    thread = threading.Thread(target=receive)
    thread.start()
    payload = bytes(size)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start = time.perf_counter()
        sent = 0
        while time.perf_counter() - start < SECONDS:
            sock.sendall(payload)
            sent += size
        sock.shutdown(socket.SHUT_WR)
        thread.join()
        elapsed = time.perf_counter() - start
    server.close()
    return received[0] / elapsed / MB


async def transport_write_mbps(size: int) -> float:
    """MB/s of acknowledged WRITEs from the agent side into a host region."""
    host, agent = TcpHostTransport(), TcpAgentTransport()
    await asyncio.gather(agent.connect(host.address), host.connect(agent.address))
    region = host.register(size * IN_FLIGHT, Access.REMOTE_WRITE)
    staging = agent.staging(size)
    moved = 0
    start = time.perf_counter()

    async def writer(slot: int) -> None:
        nonlocal moved
        while time.perf_counter() - start < SECONDS:
            await agent.write(staging, 0, size, region.addr + slot * size, region.rkey)
            moved += size

    await asyncio.gather(*(writer(i) for i in range(IN_FLIGHT)))
    elapsed = time.perf_counter() - start
    await agent.close()
    await host.close()
    return moved / elapsed / MB


async def crc_jobs_mbps(target: str, size: int) -> float:
    """MB/s of crc32c jobs through the agent (bytes the agent read from the host)."""
    async with (
        host_client.Client(target) as client,
        await client.open_session(transport="tcp", queue_depth=IN_FLIGHT) as session,
    ):
        src = await session.alloc(size, readable=True)
        moved = 0
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal moved
            while time.perf_counter() - start < SECONDS:
                (await (await session.submit_crc32c(src))).raise_for_status()
                moved += size

        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))
        return moved / (time.perf_counter() - start) / MB


def main() -> list[Result]:
    """Run and write bench/results/tcp_dataplane.json."""
    results = []
    with agent_process() as target:
        for size in SIZES:
            label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
            raw = raw_socket_mbps(size)
            ours = asyncio.run(transport_write_mbps(size))
            jobs = asyncio.run(crc_jobs_mbps(target, size))
            ref = "raw TCP socket loopback"
            for series, value in (("tcp transport WRITE", ours), ("crc32c jobs via agent", jobs)):
                results.append(
                    Result(f"{series} {label}", value, raw, "MB/s", ref, size=size, series=series)
                )
    write_results("tcp_dataplane", results)
    return results


if __name__ == "__main__":
    main()
