"""The tcp data plane on loopback vs a raw TCP stream on loopback, same run.

- reference: one TCP connection on 127.0.0.1, a thread sending `size`-byte messages
  with sendall and a thread receiving them with recv_into (no framing, no acks);
- `tcp transport WRITE <size> x8`: the transport alone, driven as the agent drives it
  (bench.linkbench: a `TcpHostLink` in its own process on its own event loop, a
  `TcpAgentLink` on a reactor thread posting each WRITE from the previous one's
  completion), 8 WRITEs of `size` bytes in flight, each acknowledged by the host;
- `crc32c jobs <size> x8, tcp`: crc32c jobs through a real agent process and the SDK,
  8 in flight, submitted in batches with `submit_many` (capsule in, the agent READs the
  host buffer, CRC, completion capsule out); bytes the agent read per second;
- a table: where one 4 KiB copy job's time goes, hop by hop in both processes
  (`bench.hops --transport tcp`).
"""

from __future__ import annotations

import socket
import threading
import time

import host_client
from bench import common
from bench.common import Result, Table, agent_process, quick, write_results
from bench.linkbench import LinkPair

SECONDS = quick(2.0, 0.3)
IN_FLIGHT = 8
SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)
HOP_JOBS = quick(1000, 100)
MB = 1e6


def raw_socket_mbps(size: int, seconds: float = SECONDS) -> float:
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
        while time.perf_counter() - start < seconds:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        thread.join()
        elapsed = time.perf_counter() - start
    server.close()
    return received[0] / elapsed / MB


def transport_write_mbps(pair: LinkPair, size: int) -> float:
    """MB/s of acknowledged WRITEs from the agent side into host regions, IN_FLIGHT at once."""
    pair.run([("write", size)], IN_FLIGHT, 4 * IN_FLIGHT)  # warm-up
    jobs = max(4 * IN_FLIGHT, int(SECONDS * 400 * MB / size))  # about SECONDS at 400 MB/s
    run = pair.run([("write", size)], IN_FLIGHT, jobs)
    return jobs * size / run.elapsed_s / MB


async def crc_jobs_mbps(target: str, size: int) -> float:
    """MB/s of crc32c jobs through the agent (bytes the agent read from the host)."""
    async with (
        host_client.Client(target) as client,
        await client.open_session(transport="tcp", queue_depth=IN_FLIGHT) as session,
    ):
        requests = [
            session.crc32c_request(await session.alloc(size, readable=True))
            for _ in range(IN_FLIGHT)
        ]
        await common.run_jobs(session, requests, 0.2)  # warm-up
        done, elapsed = await common.run_jobs(session, requests, SECONDS)
        return done * size / elapsed / MB


def main() -> list[Result]:
    """Run and write bench/results/tcp_dataplane.json."""
    results = []
    ref = "raw TCP stream loopback"
    with agent_process() as target, LinkPair("tcp", IN_FLIGHT, max(SIZES)) as pair:
        for size in SIZES:
            label = common.size_label(size)
            raw = raw_socket_mbps(size)
            ours = transport_write_mbps(pair, size)
            jobs = common.arun(crc_jobs_mbps(target, size))
            print(f"{label}: raw {raw:.0f} MB/s, transport {ours:.0f}, crc32c jobs {jobs:.1f}")
            results += [
                Result(
                    f"tcp transport WRITE {label} x{IN_FLIGHT}",
                    ours,
                    raw,
                    "MB/s",
                    f"{ref}, {label} sends",
                    size=size,
                    series=f"tcp transport WRITE x{IN_FLIGHT}",
                ),
                Result(
                    f"crc32c jobs {label} x{IN_FLIGHT}, tcp",
                    jobs,
                    raw,
                    "MB/s",
                    f"{ref}, {label} sends",
                    size=size,
                    series=f"crc32c jobs x{IN_FLIGHT}, tcp",
                ),
            ]
    tables: list[Table] = common.hops_tables("tcp", HOP_JOBS)
    write_results("tcp_dataplane", results, tables)
    return results


if __name__ == "__main__":
    common.command_line(__doc__)
    main()
