"""What the conformance checks stand on: agent processes, raw gRPC, raw data planes.

`Agents` starts real `dpu-agent` processes (one per configuration profile, on first
use) offering one transport. A check gets a `Ctx`: it opens sessions the way an
independent host would (`Ctx.open`: raw gRPC stubs, the host's side of the data plane
from `rawtcp` or `rawverbs`, the lease stream held open), and everything it opened is
closed after it, so checks do not depend on each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, Final, Protocol

import grpc

from dpu_wire.v1 import (
    agent_pb2_grpc,
    common_pb2,
    job_pb2,
    job_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    storage_pb2,
    storage_pb2_grpc,
)
from tests.conformance import wire
from tests.conformance.rawtcp import READ, WRITE, RawTcpHost
from tests.integration.conftest import start_agent

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from tests.integration.conftest import AgentProcess

CHUNK: Final = 64 << 10  # the agents' [dataplane] chunk_size: multi-chunk jobs stay cheap
BASE_ENV: Final = {
    "DPU_AGENT_STORAGE_BACKEND": "memory",
    "DPU_AGENT_CHUNK_SIZE": str(CHUNK),
    "DPU_AGENT_LOG_LEVEL": "info",
}
PROFILES: Final[dict[str, dict[str, str]]] = {
    # the shutdown scenario stops this one last (tests/conformance/shutdown.py)
    "main": {"DPU_AGENT_GRACE_PERIOD": "4"},
    # session timers and op_timeout short enough to watch them pass, session limits
    # small enough to reach
    "short": {
        "DPU_AGENT_FIRST_WATCH_TIMEOUT": "1",
        "DPU_AGENT_ORPHAN_TIMEOUT": "1",
        "DPU_AGENT_FAILED_RETENTION": "2",
        "DPU_AGENT_OP_TIMEOUT": "1",
        "DPU_AGENT_MAX_SESSIONS_PER_CONNECTION": "2",
        "DPU_AGENT_QUOTA_MAX_SESSIONS": "3",
    },
    # verbs: a GID policy that leaves the test hosts out (DP-1.2-4)
    "verbs_allow": {"DPU_AGENT_VERBS_ALLOW": "peer,198.51.100.0/24"},
}
TIMERS: Final = {"first_watch": 1.0, "orphan": 1.0, "failed_retention": 2.0, "op_timeout": 1.0}
GRACE: Final = 4.0
PROMPT: Final = 10.0
"""Seconds within which something the spec says happens "at once" or "within about a
second" must be seen: far below what it is told apart from (a job that would run half a
minute, an answer that never comes), far above a loaded machine's or the VM's delays."""
WAIT: Final = 30.0  # a hang guard for things that must happen


class Agents:
    """Agent processes by profile, started on first use, all offering `transport`."""

    def __init__(self, transport: str, tmp: Path, device: str | None = None) -> None:
        self.transport = transport
        self.device = device
        self._tmp = tmp
        self._running: dict[str, AgentProcess] = {}
        self.memo: dict[str, object] = {}  # scenarios several rows look at, run once

    def env(self, profile: str) -> dict[str, str]:
        env = {**BASE_ENV, **PROFILES[profile], "DPU_AGENT_TRANSPORTS": self.transport}
        if self.device:
            env["DPU_AGENT_RDMA_DEVICE"] = self.device
        return env

    def get(self, profile: str = "main") -> AgentProcess:
        agent = self._running.get(profile)
        if agent is None or agent.proc.poll() is not None:
            agent = start_agent(self._tmp, env=self.env(profile))
            self._running[profile] = agent
        return agent

    def take(self, profile: str) -> AgentProcess:
        """The running agent of this profile, which the caller stops (the shutdown
        scenario); a later `get` starts a new one."""
        agent = self.get(profile)
        del self._running[profile]
        return agent

    def stop(self) -> list[str]:
        """Stop every agent; the problems found (an agent that died or exited non-zero)."""
        problems = []
        for profile, agent in self._running.items():
            alive = agent.proc.poll() is None
            code = agent.terminate()
            if not alive or code != 0:
                tail = agent.log_path.read_text()[-3000:]
                problems.append(f"agent {profile!r} exited {code} (alive {alive}):\n{tail}")
        self._running.clear()
        return problems


class Stubs:
    """Raw dpu.v1 stubs on one channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.agent = agent_pb2_grpc.AgentServiceStub(channel)
        self.sessions = session_pb2_grpc.SessionServiceStub(channel)
        self.jobs = job_pb2_grpc.JobServiceStub(channel)
        self.storage = storage_pb2_grpc.StorageServiceStub(channel)


class HostRegion(Protocol):
    """Host memory the agent may access (rawtcp.Region or rawverbs.Region)."""

    addr: int
    rkey: int
    access: int

    @property
    def length(self) -> int: ...
    @property
    def view(self) -> memoryview: ...
    def span(self, offset: int = 0, length: int | None = None) -> wire.Span: ...


class Host(Protocol):
    """The host side of one data plane (rawtcp.RawTcpHost or rawverbs.RawVerbsHost)."""

    transport: str
    capsules: asyncio.Queue[bytes]
    eof: asyncio.Event
    on_capsule: Callable[[bytes], None] | None
    violations: list[str]

    def endpoint(self) -> session_pb2.Endpoint: ...
    def listen(self) -> None: ...
    def region(self, length: int, access: int) -> Any: ...
    def withdraw(self, region: Any) -> None: ...
    async def send_capsules(self, capsules: list[bytes]) -> None: ...
    async def close(self) -> None: ...


async def code_of(call: Awaitable[object]) -> grpc.StatusCode:
    """The status code a call ends with (OK if it succeeds)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def error_of(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    """The error a call must end with."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def rid() -> str:
    return uuid.uuid4().hex


class Sess:
    """An open session as a raw host holds it (see `Ctx.open`)."""

    def __init__(self, ctx: Ctx, stubs: Stubs, host: Host, reply: session_pb2.Session) -> None:
        self.ctx = ctx
        self.stubs = stubs
        self.host = host
        self.reply = reply
        self.name = reply.name
        self.lease: Any = None
        self._ids = itertools.count(1)
        self._early: dict[int, wire.Completion] = {}
        self._region_ids = itertools.count(1)
        self.names: dict[int, str] = {}  # rkey -> the region's resource name

    # -- control plane
    async def advertise(self, *regions: Any, access: int | None = None) -> None:
        messages = []
        for region in regions:
            flags = []
            granted = region.access if access is None else access
            if granted & READ:
                flags.append(session_pb2.REGION_ACCESS_REMOTE_READ)
            if granted & WRITE:
                flags.append(session_pb2.REGION_ACCESS_REMOTE_WRITE)
            name = f"{self.name}/regions/r{next(self._region_ids)}"
            self.names[region.rkey] = name
            messages.append(
                session_pb2.MemoryRegion(
                    name=name,
                    addr=region.addr,
                    length=region.length,
                    rkey=region.rkey,
                    access=flags,
                )
            )
        await self.stubs.sessions.AdvertiseRegions(
            session_pb2.AdvertiseRegionsRequest(
                session=self.name, regions=messages, request_id=rid()
            )
        )

    async def region(
        self, length: int, access: int = READ | WRITE, fill: bytes | None = None
    ) -> Any:
        """Host memory, advertised with `access`."""
        made = self.host.region(length, access)
        if fill is not None:
            made.view[: len(fill)] = fill
        await self.advertise(made)
        return made

    def ref(self, region: Any, offset: int = 0, length: int = 0) -> common_pb2.RegionRef:
        return common_pb2.RegionRef(region=self.names[region.rkey], offset=offset, length=length)

    async def submit_rpc(
        self, spec: job_pb2.JobSpec, *, wait_for_slot: bool = False
    ) -> job_pb2.Job:
        return await self.stubs.jobs.SubmitJob(
            job_pb2.SubmitJobRequest(
                session=self.name, spec=spec, request_id=rid(), wait_for_slot=wait_for_slot
            )
        )

    async def get(self) -> session_pb2.Session:
        return await self.stubs.sessions.GetSession(session_pb2.GetSessionRequest(name=self.name))

    async def job(self, job_id: int) -> job_pb2.Job:
        return await self.stubs.jobs.GetJob(
            job_pb2.GetJobRequest(name=f"{self.name}/jobs/{job_id}")
        )

    async def running(self, job_id: int, timeout: float = 5) -> None:  # noqa: ASYNC109
        """Wait until the job is RUNNING (a capsule is admitted on the reactor, soon)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if (await self.job(job_id)).state == job_pb2.JOB_STATE_RUNNING:
                    return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            assert time.monotonic() < deadline, f"job {job_id} never ran"
            await asyncio.sleep(0.01)

    async def attach(self, volume: str) -> int:
        reply = await self.stubs.sessions.AttachVolume(
            session_pb2.AttachVolumeRequest(session=self.name, volume=volume, request_id=rid())
        )
        return int(reply.handle)

    async def key(self, key: bytes) -> int:
        reply = await self.stubs.sessions.RegisterKey(
            session_pb2.RegisterKeyRequest(session=self.name, key=key, request_id=rid())
        )
        return int(reply.handle)

    async def close(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stubs.sessions.CloseSession(
                session_pb2.CloseSessionRequest(name=self.name, request_id=rid())
            )

    async def wait_state(self, state: int, timeout: float = WAIT) -> session_pb2.Session:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        while True:
            found = await self.get()
            if found.state == state or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.02)

    def watch(self, origin: int = 0, *, include_retained: bool = False) -> Any:
        return self.stubs.jobs.WatchCompletions(
            job_pb2.WatchCompletionsRequest(
                session=self.name,
                origin=origin,  # type: ignore[arg-type]
                include_retained=include_retained,
            )
        )

    # -- data plane
    def next_id(self) -> int:
        return next(self._ids)

    async def send(self, *capsules: bytes) -> None:
        """Capsules in order, in one go (one system call on tcp, one post on verbs)."""
        await self.host.send_capsules(list(capsules))

    async def submit(
        self,
        kind: int,
        source: wire.Span = wire.ZERO,
        destination: wire.Span = wire.ZERO,
        /,
        **fields: int,
    ) -> int:
        job_id = fields.pop("job_id", None) or self.next_id()
        await self.send(wire.submit(job_id, kind, source, destination, **fields))
        return job_id

    async def completion(self, timeout: float = WAIT) -> wire.Completion:  # noqa: ASYNC109
        """The next capsule from the agent, which must be a valid COMPLETION."""
        if self._early:
            return self._early.pop(next(iter(self._early)))
        data = await asyncio.wait_for(self.host.capsules.get(), timeout)
        return wire.parse_completion(data)

    async def completion_for(self, job_id: int, timeout: float = WAIT) -> wire.Completion:  # noqa: ASYNC109
        if job_id in self._early:
            return self._early.pop(job_id)
        deadline = time.monotonic() + timeout
        while True:
            data = await asyncio.wait_for(
                self.host.capsules.get(), max(0.01, deadline - time.monotonic())
            )
            found = wire.parse_completion(data)
            if found.job_id == job_id:
                return found
            self._early[found.job_id] = found

    async def run(
        self,
        kind: int,
        source: wire.Span = wire.ZERO,
        destination: wire.Span = wire.ZERO,
        /,
        **fields: int,
    ) -> wire.Completion:
        return await self.completion_for(await self.submit(kind, source, destination, **fields))

    async def quiet(self, seconds: float) -> None:
        """Nothing arrives from the agent for `seconds`."""
        assert not self._early, self._early
        try:
            data = await asyncio.wait_for(self.host.capsules.get(), seconds)
        except TimeoutError:
            return
        raise AssertionError(f"the agent sent a capsule: {data.hex()}")

    async def slow_volume(self, chunks: int) -> tuple[str, int, HostRegion]:
        """A volume that takes one write a second (QoS), its handle, a source for it."""
        volume = await self.ctx.volume(chunks * CHUNK, write_iops=1, stubs=self.stubs)
        handle = await self.attach(volume)
        return volume, handle, await self.region(chunks * CHUNK, READ)

    async def slow_write(self, chunks: int = 30, **fields: int) -> int:
        """A capsule VOLUME_WRITE that stays open about `chunks - 1` seconds; its job id.

        It waits between chunks (QoS: one write a second), holding nothing on the wire:
        the same on both transports.
        """
        _, handle, src = await self.slow_volume(chunks)
        return await self.submit(wire.Kind.VOLUME_WRITE, src.span(), handle=handle, **fields)

    async def slow_rpc(self, chunks: int = 30) -> int:
        """The same as a SubmitJob job; its job id."""
        volume, _, src = await self.slow_volume(chunks)
        spec = job_pb2.JobSpec(
            volume_write=job_pb2.VolumeWriteJob(volume=volume, source=self.ref(src))
        )
        return int((await self.submit_rpc(spec)).job_id)

    async def held_copy(self, length: int = 4096, **fields: int) -> tuple[int, Any, Any]:
        """tcp: a COPY whose READ this host holds back; (job id, the READ, destination)."""
        assert isinstance(self.host, RawTcpHost)
        self.host.hold_reads = True
        src = await self.region(length, READ, fill=b"\x5a" * length)
        dst = await self.region(length, WRITE)
        job_id = await self.submit(wire.Kind.COPY, src.span(), dst.span(), **fields)
        read = await asyncio.wait_for(self.host.held.get(), 10)
        return job_id, read, dst

    async def break_data_plane(self) -> None:
        """End the data plane from the host's side (tcp: close; verbs: destroy the QP).

        On verbs the agent notices at its next operation (RC does not notice an idle
        dead peer), so callers keep a job running (`slow_write`).
        """
        if isinstance(self.host, RawTcpHost):
            await self.host.hang_up()
        else:
            await self.host.close()


class Ctx:
    """What one check gets: its transport, the agents, and what it opens (closed after)."""

    def __init__(self, transport: str, agents: Agents, device: str | None = None) -> None:
        self.transport = transport
        self.agents = agents
        self.device = device
        self.profile = "main"
        self._channels: list[grpc.aio.Channel] = []
        self._sessions: list[Sess] = []
        self._hosts: list[Host] = []
        self._volumes: list[tuple[Stubs, str]] = []

    @property
    def tcp(self) -> bool:
        return self.transport == "tcp"

    def agent(self, profile: str | None = None) -> AgentProcess:
        return self.agents.get(profile or self.profile)

    def stubs(self, profile: str | None = None, *, address: str | None = None) -> Stubs:
        """Stubs on a new channel (a new client connection) to the agent."""
        # its own connection: channels share connections unless they keep a local pool
        options = [("grpc.use_local_subchannel_pool", 1)]
        channel = grpc.aio.insecure_channel(address or self.agent(profile).address, options)
        self._channels.append(channel)
        return Stubs(channel)

    def host(self, queue_depth: int = 8) -> Host:
        made: Host
        if self.tcp:
            made = RawTcpHost()
        else:
            from tests.conformance.rawverbs import RawVerbsHost  # noqa: PLC0415 - pyverbs

            assert self.device is not None
            made = RawVerbsHost(self.device, queue_depth)
        self._hosts.append(made)
        return made

    def request(
        self, host: Host, queue_depth: int = 8, **fields: Any
    ) -> session_pb2.OpenSessionRequest:
        transport = 2 if self.tcp else 1
        values: dict[str, Any] = {
            "request_id": rid(),
            "transport": transport,
            "queue_depth": queue_depth,
            "client_label": "conformance",
            "host_endpoint": host.endpoint(),
        }
        values.update(fields)
        return session_pb2.OpenSessionRequest(**values)

    async def open(
        self,
        profile: str | None = None,
        *,
        queue_depth: int = 8,
        stubs: Stubs | None = None,
        lease: bool = True,
        **fields: Any,
    ) -> Sess:
        """OpenSession, connect the data plane, hold the lease (its metadata arrived)."""
        stubs = stubs or self.stubs(profile)
        host = self.host(queue_depth)
        host.listen()
        request = self.request(host, queue_depth, **fields)
        reply = await stubs.sessions.OpenSession(request, timeout=30)
        if isinstance(host, RawTcpHost):
            await host.connected(reply.agent_endpoint.tcp.token)
        else:
            await host.connected(reply.agent_endpoint, reply.inline_max)  # type: ignore[attr-defined]
        session = self.adopt(stubs, host, reply)
        if lease:
            session.lease = session.watch(job_pb2.JOB_ORIGIN_RPC)
            await asyncio.wait_for(session.lease.initial_metadata(), 10)
        return session

    def adopt(self, stubs: Stubs, host: Host, reply: session_pb2.Session) -> Sess:
        """A session opened by hand, closed after the check like the others."""
        session = Sess(self, stubs, host, reply)
        self._sessions.append(session)
        return session

    async def volume(
        self,
        size: int = 1 << 20,
        *,
        block_size: int = 4096,
        write_iops: int = 0,
        stubs: Stubs | None = None,
    ) -> str:
        """A new volume (deleted after the check), on the agent `stubs` talk to."""
        stubs = stubs or self.stubs()
        volume_id = "cf-" + uuid.uuid4().hex[:12]
        await stubs.storage.CreateVolume(
            storage_pb2.CreateVolumeRequest(
                volume_id=volume_id,
                volume=storage_pb2.Volume(
                    size_bytes=size,
                    block_size=block_size,
                    qos=storage_pb2.QosLimits(write_iops=write_iops),
                ),
                request_id=rid(),
            )
        )
        self._volumes.append((stubs, f"volumes/{volume_id}"))
        return f"volumes/{volume_id}"

    async def aclose(self) -> None:
        for session in self._sessions:
            if session.lease is not None:
                session.lease.cancel()
            await session.close()
        for host in self._hosts:
            await host.close()
        for stubs, name in self._volumes:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stubs.storage.DeleteVolume(
                    storage_pb2.DeleteVolumeRequest(name=name, request_id=rid())
                )
        for channel in self._channels:
            await channel.close(None)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
