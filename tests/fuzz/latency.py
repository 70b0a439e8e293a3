"""A second client's view of the agent: GetAgentInfo latency, from its own process.

Run as `python -m tests.fuzz.latency ADDRESS [--count N]`: N sequential GetAgentInfo
calls (without --count: calls until stdin closes), then one JSON line with the
latencies in seconds. A process of its own, on a connection of its own, so the fuzzing
process's work (and GIL) does not add to what it measures; idle, during and after
figures are all taken this way, so they compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import Final

import grpc

from dpu_wire.v1 import agent_pb2, agent_pb2_grpc

LOCAL_POOL: Final = (("grpc.use_local_subchannel_pool", 1),)


INTERVAL: Final = 0.01  # between calls while sampling until stopped: a client, not a load


def sample(address: str, count: int | None) -> list[float]:
    """Sequential calls: `count` of them, or (every INTERVAL s) until stdin closes."""
    stop = threading.Event()
    if count is None:

        def wait_for_eof() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=wait_for_eof, daemon=True).start()
    taken: list[float] = []
    with grpc.insecure_channel(address, options=LOCAL_POOL) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)
        stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest(), timeout=30)  # connected, warm
        while not stop.is_set() and (count is None or len(taken) < count):
            start = time.perf_counter()
            stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest(), timeout=30)
            taken.append(time.perf_counter() - start)
            if count is None:
                stop.wait(INTERVAL)
    return taken


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Probe:
    """A probe process sampling until `stop()` (the "during" figure)."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.latency", address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> list[float]:
        out, _ = self.proc.communicate("", timeout=120)
        return [float(v) for v in json.loads(out)]


def measure(address: str, count: int) -> list[float]:
    """`count` calls from a probe process (the idle and after figures)."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.latency", address, "--count", str(count)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    return [float(v) for v in json.loads(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("address")
    parser.add_argument("--count", type=int)
    args = parser.parse_args()
    print(json.dumps(sample(args.address, args.count)))  # noqa: T201 - the probe's output


if __name__ == "__main__":
    main()
