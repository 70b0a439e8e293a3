"""The data-plane transport alone, driven as the agent drives it: a link on a real reactor.

The benches that measure the transport without jobs use this: the host side runs in its
own process (`python -m bench.linkbench host ...`: a `HostLink` on its own asyncio loop,
as the SDK runs it), the agent side is an `AgentLink` on a `Reactor` thread in the
calling process, and a `Pump` on that thread posts the operations. The pump works as the
agent's pipeline does: it posts an operation's successor from inside the completion
callback (run to completion, no thread hop and no event loop between two operations),
with a fixed number of operations in flight.

- `LinkPair(transport, regions, size)`: the host process, its regions (`regions` of
  `size` bytes, readable and writable by the agent), the agent link on a reactor;
- `pair.pump(steps, in_flight, jobs)`: `jobs` closed-loop jobs of `steps` (e.g.
  `[("write", 4096)]`, or `[("read", 1 << 20), ("write", 5000)]`), each slot on its own
  staging buffer and host region; returns each job's time and the elapsed wall time;
- `pair.echo(count, size)`: the host sends a capsule, the agent SENDs it back from its
  receive callback; the host's round-trip times (the host side's polling included);
- `pair.raw_write_floor(...)`: verbs only, the link's queue pair without the reactor:
  post a WRITE and poll its completion from plain Python; `pair.raw_write_stream(...)`
  the same with several WRITEs in flight.

The reactor's polling mode is `pair.reactor.spin` (the agent's [dataplane] poll_mode
maps to it: adaptive = poll_spin, busy = -1, event = 0), and may change between runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any, Self

from dpu_agent.dataplane.reactor import Reactor
from dpu_wire.transport import tcp
from dpu_wire.transport.base import (
    Access,
    PeerAddress,
    TcpAddress,
    TransportError,
    VerbsAddress,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dpu_wire.transport.base import AgentLink, HostLink, LinkSink, Region

# [dataplane] poll_mode -> the reactor's spin, as dpu_agent.server maps it
SPIN = {"adaptive": 0.002, "busy": -1.0, "event": 0.0}
RUN_TIMEOUT_S = 600.0


# ---------------------------------------------------------------- addresses as JSON


def encode_address(address: PeerAddress | None) -> dict[str, Any] | None:
    """A link's address as JSON (bytes as hex)."""
    if address is None:
        return None
    fields = dataclasses.asdict(address)
    kind = "tcp" if isinstance(address, TcpAddress) else "verbs"
    return {
        "kind": kind,
        **{k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()},
    }


def decode_address(doc: dict[str, Any] | None) -> PeerAddress | None:
    """The address `encode_address` wrote."""
    if doc is None:
        return None
    fields = {k: v for k, v in doc.items() if k != "kind"}
    if doc["kind"] == "tcp":
        return TcpAddress(fields["host"], fields["port"], bytes.fromhex(fields["token"]))
    return VerbsAddress(
        bytes.fromhex(fields["gid"]), fields["qp_num"], fields["psn"], fields["mtu"], fields["lid"]
    )


# ---------------------------------------------------------------- the host process


def _say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def _host_main(transport: str, count: int, size: int, queue_depth: int) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    link: HostLink
    if transport == "tcp":
        host = tcp.TcpHostLink()
        host.listen()
        link = host
    else:
        from dpu_wire.transport.verbs import VerbsHostLink  # noqa: PLC0415

        device = os.environ.get("DPU_TEST_HOST_RDMA_DEVICE") or os.environ.get(
            "DPU_TEST_RDMA_DEVICE"
        )
        link = VerbsHostLink(device=device, queue_depth=queue_depth)  # the host's node
    access = Access.REMOTE_READ | Access.REMOTE_WRITE
    regions = [link.register(size, access) for _ in range(count)]
    for region in regions:
        region.view[:] = os.urandom(size)
    _say({"address": encode_address(link.address), "regions": [[r.addr, r.rkey] for r in regions]})
    agent = decode_address(json.loads(await reader.readline())["address"])
    await link.connect(agent)
    echo: list[asyncio.Future[None]] = []

    def on_capsule(_data: memoryview) -> None:
        if echo and not echo[0].done():
            echo[0].set_result(None)

    def on_failure(error: TransportError) -> None:
        if echo and not echo[0].done():
            echo[0].set_exception(error)

    link.start(on_capsule, on_failure, lambda: bool(echo))
    _say({"ready": True})
    while line := await reader.readline():
        command = json.loads(line)
        samples = []
        capsule = bytes(command["size"])
        for _ in range(command["count"]):
            echo[:] = [loop.create_future()]
            start = time.perf_counter_ns()
            link.send([capsule])
            await echo[0]
            samples.append(time.perf_counter_ns() - start)
        echo.clear()
        _say({"samples_ns": samples})
    await link.close()


def host_main(argv: Sequence[str]) -> None:
    """`python -m bench.linkbench host TRANSPORT COUNT SIZE QUEUE_DEPTH`."""
    transport, count, size, depth = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    asyncio.run(_host_main(transport, count, size, depth))


# ---------------------------------------------------------------- the agent side


@dataclasses.dataclass
class Run:
    """What a pump run measured."""

    job_ns: list[int]  # each job's time, first post to last completion
    elapsed_s: float
    cpu_s: float  # this process's CPU time during the run

    def p(self, q: float) -> float:
        """The q-quantile of the job times, in microseconds."""
        ordered = sorted(self.job_ns)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))] / 1000


class Pump:
    """Runs closed-loop jobs of RDMA operations on the reactor thread (LinkOwner, LinkSink).

    Slot i uses staging buffer i and host region i; its next operation is posted from
    the completion of the previous one.
    """

    def __init__(
        self,
        reactor: Reactor,
        link: AgentLink,
        staging: Sequence[Region],
        remote: list[list[int]],
    ) -> None:
        self.reactor = reactor
        self.link = link
        self.staging = staging
        self.remote = remote
        self._steps: Sequence[tuple[str, int]] = ()
        self._step: list[int] = []
        self._started: list[int] = []
        self._left = 0
        self._running = 0
        self._times: list[int] = []
        self._finished = threading.Event()
        self.error: BaseException | None = None

    # LinkOwner
    futile = 0  # LinkOwner: nothing these charge a tenant

    @property
    def sink(self) -> LinkSink:
        """This pump."""
        return self

    def end_pass(self) -> None:
        """Push out what was posted in the pass."""
        self.link.flush()

    def link_failed(self) -> None:
        """Stop the run with the link's error."""
        self._fail(self.link.error or TransportError("link failed"))

    # LinkSink
    def on_capsule(self, data: memoryview) -> None:
        """Echo the capsule to the host (unsignalled: nothing waits for the SEND)."""
        self.link.post_send(bytes(data), None)
        self.reactor.wake(self.link)

    def on_done(self, token: int, error: TransportError | None) -> None:
        """An operation finished: post the slot's next one, or finish its job."""
        if error is not None:
            self._fail(error)
            return
        slot = token
        step = self._step[slot] + 1
        if step < len(self._steps):
            self._step[slot] = step
            self._post(slot)
            return
        self._times.append(time.perf_counter_ns() - self._started[slot])
        self._running -= 1
        if self._left:
            self._begin(slot)
        elif not self._running:
            self._finished.set()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._finished.set()

    def _begin(self, slot: int) -> None:
        self._left -= 1
        self._running += 1
        self._step[slot] = 0
        self._started[slot] = time.perf_counter_ns()
        self._post(slot)

    def _post(self, slot: int) -> None:
        op, length = self._steps[self._step[slot]]
        addr, rkey = self.remote[slot]
        if op == "read":
            self.link.post_read(self.staging[slot], 0, length, addr, rkey, slot)
        else:
            self.link.post_write(self.staging[slot], 0, length, addr, rkey, slot)

    def _start(self, steps: Sequence[tuple[str, int]], in_flight: int, jobs: int) -> None:
        try:
            self._steps, self._left, self._running, self._times = steps, jobs, 0, []
            self._step, self._started = [0] * in_flight, [0] * in_flight
            for slot in range(min(in_flight, jobs)):
                self._begin(slot)
            self.reactor.wake(self.link)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            self._fail(exc)

    def run(self, steps: Sequence[tuple[str, int]], in_flight: int, jobs: int) -> Run:
        """Run `jobs` jobs of `steps`, `in_flight` at a time (blocks the calling thread)."""
        if in_flight > len(self.staging):
            raise ValueError(f"{in_flight} in flight needs as many buffers")
        self._finished.clear()
        cpu0 = _cpu_seconds()
        start = time.perf_counter()
        self.reactor.call(lambda: self._start(steps, in_flight, jobs))
        if not self._finished.wait(RUN_TIMEOUT_S):
            raise TimeoutError(f"the pump did not finish {jobs} jobs in {RUN_TIMEOUT_S:.0f} s")
        elapsed = time.perf_counter() - start
        if self.error is not None:
            raise RuntimeError(f"the link failed: {self.error}") from self.error
        return Run(list(self._times), elapsed, _cpu_seconds() - cpu0)


class _Counting:
    """A link sink for the bare queue pair: counts finished operations, takes no capsule."""

    def __init__(self) -> None:
        self.done = 0

    def on_capsule(self, _data: memoryview) -> None:
        pass

    def on_done(self, _token: int, error: TransportError | None) -> None:
        if error is not None:
            raise error
        self.done += 1


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


class LinkPair:
    """A host process and an agent link on a reactor, connected; use as a context manager.

    Args:
        transport: "tcp" or "verbs".
        regions: host regions (and staging buffers) to make: the most slots a run uses.
        size: bytes of each.
        queue_depth: the verbs links' queue depth.
        spin: the reactor's initial spin (see SPIN).
    """

    def __init__(
        self,
        transport: str,
        regions: int,
        size: int,
        *,
        queue_depth: int = 32,
        spin: float = SPIN["adaptive"],
    ) -> None:
        self.transport = transport
        self._args = [transport, str(regions), str(size), str(queue_depth)]
        self._queue_depth = queue_depth
        self.reactor = Reactor(spin=spin)
        self._proc: subprocess.Popen[str] | None = None
        self._link: AgentLink | None = None
        self._pump: Pump | None = None

    def __enter__(self) -> Self:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _open(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.linkbench", "host", *self._args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        host_address = decode_address(hello["address"])
        link: AgentLink
        if self.transport == "tcp":
            assert isinstance(host_address, TcpAddress)  # noqa: S101 - the host said tcp
            sock, token = asyncio.run(tcp.dial(host_address))
            link = tcp.TcpAgentLink(sock, token)
        else:
            from dpu_wire.transport.verbs import VerbsAgentLink  # noqa: PLC0415

            verbs = VerbsAgentLink(
                device=os.environ.get("DPU_TEST_RDMA_DEVICE"), queue_depth=self._queue_depth
            )
            assert host_address is not None  # noqa: S101 - verbs addresses are never None
            verbs.connect(host_address)
            link = verbs
        self._link = link
        self._write({"address": encode_address(link.address)})
        if not self._read().get("ready"):
            raise RuntimeError("the host process did not connect")
        size = int(self._args[2])
        staging = [link.staging(size) for _ in hello["regions"]]
        for region in staging:
            region.view[:] = os.urandom(size)
        self._pump = Pump(self.reactor, link, staging, hello["regions"])
        self.reactor.start()
        added = threading.Event()

        def add() -> None:
            self.reactor.add(link, self.pump)
            added.set()

        self.reactor.call(add)
        if not added.wait(30):
            raise RuntimeError("the reactor did not take the link")

    @property
    def pump(self) -> Pump:
        """The pump on the reactor."""
        if self._pump is None:
            raise RuntimeError("not open")
        return self._pump

    @property
    def link(self) -> AgentLink:
        """The agent's link."""
        if self._link is None:
            raise RuntimeError("not open")
        return self._link

    def run(self, steps: Sequence[tuple[str, int]], in_flight: int, jobs: int) -> Run:
        """See `Pump.run`."""
        return self.pump.run(steps, in_flight, jobs)

    def echo(self, count: int, size: int = 64) -> list[int]:
        """Round-trip times (ns) of `count` capsules the host sends and the agent echoes."""
        self._write({"count": count, "size": size})
        return [int(ns) for ns in self._read()["samples_ns"]]

    def detach(self) -> None:
        """Take the link off the reactor (for `raw_write_floor`)."""
        done = threading.Event()

        def remove() -> None:
            self.reactor.remove(self.link)
            done.set()

        self.reactor.call(remove)
        done.wait(30)

    def raw_write_floor(self, length: int, count: int) -> list[int]:
        """Nanoseconds per WRITE posted on the link's queue pair and polled here (verbs).

        The floor any Python caller of this queue pair has: no reactor, no callbacks
        beyond the completion's; call `detach()` first.
        """
        qp: Any = self.link._qp  # type: ignore[attr-defined]  # noqa: SLF001 - the bare queue pair
        staging, (addr, rkey) = self.pump.staging[0], self.pump.remote[0]
        sink = _Counting()
        samples = []
        for _ in range(count):
            start = time.perf_counter_ns()
            qp.post_rdma("write", staging, 0, length, (addr, rkey), 1)
            while not sink.done:
                qp.poll(sink, 1)
            sink.done = 0
            samples.append(time.perf_counter_ns() - start)
        return samples

    def raw_write_stream(self, length: int, count: int, in_flight: int) -> float:
        """Seconds for `count` WRITEs of `length`, `in_flight` at once, on the bare QP.

        As `raw_write_floor`, but a stream: each slot's staging buffer to its own host
        region, a WRITE posted for each completion taken. Call `detach()` first.
        """
        qp: Any = self.link._qp  # type: ignore[attr-defined]  # noqa: SLF001 - the bare queue pair
        slots = min(in_flight, len(self.pump.staging), len(self.pump.remote))
        sink = _Counting()
        posted = 0
        start = time.perf_counter()
        while sink.done < count:
            while posted < count and posted - sink.done < slots:
                slot = posted % slots
                qp.post_rdma("write", self.pump.staging[slot], 0, length, self.pump.remote[slot], 1)
                posted += 1
            qp.poll(sink, slots)
        return time.perf_counter() - start

    def _read(self) -> dict[str, Any]:
        assert self._proc is not None  # noqa: S101 - open
        out: IO[str] | None = self._proc.stdout
        assert out is not None  # noqa: S101 - a pipe
        line = out.readline()
        if not line:
            raise RuntimeError(f"the host process ended ({self._proc.wait(5)})")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def _write(self, doc: dict[str, Any]) -> None:
        assert self._proc is not None  # noqa: S101 - open
        assert self._proc.stdin is not None  # noqa: S101 - a pipe
        self._proc.stdin.write(json.dumps(doc) + "\n")
        self._proc.stdin.flush()

    def close(self) -> None:
        """Stop the reactor, close the link, end the host process."""
        self.reactor.stop()
        if self._link is not None:
            self._link.close()
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "host":
        host_main(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
