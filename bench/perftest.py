"""perftest (ib_write_lat, ib_write_bw, ib_send_lat) between two RDMA ports: the verbs references.

Each tool runs as a server on the agent's port and a client on the host's (in the test
VM rxe0 and rxe1, two nodes across a veth pair; one port to itself elsewhere), as the
project's benches run theirs. perftest reports MiB/s as "MB/s"
(2**20 bytes), and latencies as half a ping-pong round trip.
"""

from __future__ import annotations

import math
import subprocess
import time

PORT_WAIT_S = 30.0
# perftest on rxe under TCG sometimes reports a bandwidth of 0.00 or a latency of inf
# (its cycle counter under emulation): such a run is run again
ATTEMPTS = 3
LAT_SIZE = 4096
LAT_ITERS = 2000

Port = tuple[str, int, int]  # device, port number, GID index (bench.common.find_port)


def _run(tool: str, args: list[str], client_args: list[str] | None = None) -> list[str]:
    """Run a perftest server and its client (`client_args`, else `args`); the result line."""
    server = subprocess.Popen(
        [tool, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    client_args = args if client_args is None else client_args
    try:
        deadline = time.monotonic() + PORT_WAIT_S
        while True:  # the client fails until the server listens
            client = subprocess.run(
                [tool, *client_args, "127.0.0.1"], capture_output=True, text=True, check=False
            )
            if client.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    if client.returncode != 0:
        raise RuntimeError(f"{tool} failed: {client.stdout}{client.stderr}")
    size = args[args.index("-s") + 1]
    for line in client.stdout.splitlines():
        fields = line.split()
        if fields and fields[0] == size:
            return fields
    raise RuntimeError(f"no result line for size {size} in:\n{client.stdout}")


def _where(port: Port, size: int) -> list[str]:
    device, port_num, gid = port
    return ["-d", device, "-i", str(port_num), "-x", str(gid), "-F", "-s", str(size)]


def write_bw(
    port: Port, size: int, in_flight: int, total_bytes: int, *, client: Port | None = None
) -> float:
    """ib_write_bw's BW average in MiB/s: `in_flight` WRITEs of `size` (-t), `total_bytes` in all.

    perftest's duration mode (-D) under-reports on rxe under TCG (10 MiB/s at 1 MiB with
    its default 128 in flight, 48 with -n), so the count is given.
    """
    shape = ["-t", str(in_flight), "-n", str(max(total_bytes // size, 16))]
    args, client_args = [*_where(port, size), *shape], [*_where(client or port, size), *shape]
    for _ in range(ATTEMPTS):
        fields = _run("ib_write_bw", args, client_args)
        average = float(fields[3])  # #bytes #iterations BW-peak BW-average MsgRate
        if math.isfinite(average) and average > 0:
            return average
        print(f"ib_write_bw reported {' '.join(fields)}: running it again")
    raise RuntimeError(f"ib_write_bw reported no bandwidth {ATTEMPTS} times at {size} bytes")


def _latency(tool: str, port: Port, size: int, client: Port | None) -> tuple[float, float]:
    """(typical, p99) in microseconds from an ib_*_lat run."""
    iters = ["-n", str(LAT_ITERS)]
    for _ in range(ATTEMPTS):
        fields = _run(tool, [*_where(port, size), *iters], [*_where(client or port, size), *iters])
        # bytes iterations min max typical average stdev p99 p99.9
        typical, p99 = float(fields[4]), float(fields[7])
        if all(math.isfinite(v) and v > 0 for v in (typical, p99)):
            return typical, p99
        print(f"{tool} reported {' '.join(fields)}: running it again")
    raise RuntimeError(f"{tool} reported no usable latency {ATTEMPTS} times at {size} bytes")


def write_lat(
    port: Port, size: int = LAT_SIZE, *, client: Port | None = None
) -> tuple[float, float]:
    """ib_write_lat's (typical, p99) in microseconds (server on `port`, client on `client`)."""
    return _latency("ib_write_lat", port, size, client)


def send_lat(port: Port, size: int = 64, *, client: Port | None = None) -> tuple[float, float]:
    """ib_send_lat's (typical, p99) in microseconds."""
    return _latency("ib_send_lat", port, size, client)
