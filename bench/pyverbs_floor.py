"""What a bare Python loop reaches on this device: a copy job written on the link's queue pair.

    python -m bench.pyverbs_floor [--jobs N] [--shape read|inline] [--pin]

Two processes, as the SDK and the agent, both busy-polling, with no job table, no
admission and no event loop: the floor a Python data plane can approach on this device,
to put beside `ib_write_lat` and the agent's own copy job in the same run. Shapes:

- `read` (the default): the host SENDs a 64-byte capsule; the agent RDMA-READs 4 KiB
  from the host, RDMA-WRITEs it back elsewhere and SENDs a 32-byte completion;
- `inline`: the wire shape of the SDK's default 4 KiB copy job: the host SENDs an
  80-byte SUBMIT with the 4 KiB source behind it; the agent RDMA-WRITEs the 4 KiB into
  the host's destination and SENDs an 80-byte completion, both in one post.

The queue pair is the verbs transport's (`_QueuePair`), so its posts and polls go
through the native core when it is built and `DPU_NATIVE` is not `0`; with
`DPU_NATIVE=0` this is the job written on pyverbs alone. The JSON it prints says which.
Prints the p50 and p99 of the host's submit-to-completion time in microseconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

from dpu_wire.capsule import SUBMIT_SIZE
from dpu_wire.transport import native
from dpu_wire.transport.base import Access
from dpu_wire.transport.verbs import VerbsAgentLink, VerbsHostLink, _QueuePair

SIZE = 4096
SHAPES = ("read", "inline")


class _Sink:
    def __init__(self) -> None:
        self.capsules = 0
        self.done = 0

    def on_capsule(self, _data: memoryview) -> None:
        self.capsules += 1

    def on_done(self, _token: int, _error: object) -> None:
        self.done += 1


def _agent(conn: Any, jobs: int, cpu: int | None, shape: str) -> None:  # noqa: ANN401 - a Pipe end
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    agent = VerbsAgentLink(
        device=os.environ.get("DPU_TEST_RDMA_DEVICE"),
        queue_depth=4,
        inline_max=SIZE if shape == "inline" else 0,
    )
    host_address, src, dst = conn.recv()
    agent.connect(host_address)
    conn.send(agent.address)
    staging = agent.staging(SIZE)
    qp: _QueuePair = agent._qp  # noqa: SLF001 - the bare queue pair, no pipeline
    sink = _Sink()
    reply = bytes(32 if shape == "read" else SUBMIT_SIZE)
    for _ in range(jobs):
        while not sink.capsules:
            qp.poll(sink, 1)
        sink.capsules = 0
        if shape == "read":
            qp.post_rdma("read", staging, 0, SIZE, src, 1)
            while not sink.done:
                qp.poll(sink, 1)
            sink.done = 0
        qp.post_rdma("write_unsignaled", staging, 0, SIZE, dst, None)
        qp.post_send(reply, 2)  # chained behind the WRITE: one post
        while not sink.done:
            qp.poll(sink, 1)
        sink.done = 0
    conn.recv()
    agent.close()


def run(jobs: int, *, pin: bool = False, shape: str = "read") -> tuple[float, float]:
    """(p50, p99) in microseconds of `jobs` copy jobs, one at a time."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, not {shape!r}")
    if pin:
        os.sched_setaffinity(0, {0})
    host = VerbsHostLink(device=os.environ.get("DPU_TEST_HOST_RDMA_DEVICE"), queue_depth=4, spin=0)
    src = host.register(SIZE, Access.REMOTE_READ)
    dst = host.register(SIZE, Access.REMOTE_WRITE)
    qp: _QueuePair = host._qp  # noqa: SLF001
    capsule, tail = bytes(64), None
    if shape == "inline":
        qp.grow_send_slots(SUBMIT_SIZE + SIZE)
        capsule, tail = bytes(SUBMIT_SIZE), src.view
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(
        target=_agent, args=(child, jobs + 100, 1 if pin else None, shape)
    )
    proc.start()
    parent.send((host.address, (src.addr, src.rkey), (dst.addr, dst.rkey)))
    qp.connect(parent.recv())
    sink = _Sink()
    samples = []
    for i in range(jobs + 100):
        start = time.perf_counter_ns()
        if qp.send_room() == 0:
            qp.poll_sends(None)
        qp.post_send(capsule, None, tail)
        while not sink.capsules:
            qp.poll(sink, 1)
        sink.capsules = 0
        if i >= 100:  # warm up
            samples.append((time.perf_counter_ns() - start) / 1000)
    parent.send("done")
    proc.join(30)
    qp.close()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def main() -> None:
    """Run and print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--shape", choices=SHAPES, default="read", help="see the module's doc")
    parser.add_argument("--pin", action="store_true", help="host on CPU 0, agent on CPU 1")
    args = parser.parse_args()
    p50, p99 = run(args.jobs, pin=args.pin, shape=args.shape)
    on_core = native.status()[0]
    print(json.dumps({"p50_us": round(p50, 1), "p99_us": round(p99, 1), "native": on_core}))


if __name__ == "__main__":
    main()
