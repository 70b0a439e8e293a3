"""The async-first SDK client."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import TYPE_CHECKING, Final, Literal, Self, TypeVar

import grpc
from google.protobuf import field_mask_pb2
from grpc_health.v1 import health_pb2

from dpu_wire import REQUEST_ID_METADATA_KEY
from dpu_wire.transport.base import TransportError
from dpu_wire.transport.tcp import TcpHostLink
from dpu_wire.v1 import (
    agent_pb2,
    job_pb2,
    network_pb2,
    session_pb2,
    storage_pb2,
    virtualization_pb2,
)
from host_client._completion import Completion
from host_client._diagnose import explain
from host_client._errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from host_client._request_ids import for_call
from host_client._rpc import Rpc, Stubs, _Page
from host_client._session import TRANSPORT_NUMBERS, Session
from host_client._tls import TOKEN_ENV, TlsConfig, open_channel

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
    from types import TracebackType

    from dpu_wire.transport.base import HostLink

_R = TypeVar("_R")
_T = TypeVar("_T")
_P = TypeVar("_P", bound=_Page)


MAX_QUEUE_DEPTH: Final = 1024
DEFAULT_SPIN_S: Final = 0.002  # verbs: seconds a session polls after its last activity
_COMPRESSIONS: Final = {
    "none": storage_pb2.COMPRESSION_NONE,
    "lz4": storage_pb2.COMPRESSION_LZ4,
    "zstd": storage_pb2.COMPRESSION_ZSTD,
}
_ENCRYPTIONS: Final = {
    "none": storage_pb2.ENCRYPTION_NONE,
    "aes-xts-256": storage_pb2.ENCRYPTION_AES_XTS_256,
}
_ORIGINS: Final = {
    "any": job_pb2.JOB_ORIGIN_UNSPECIFIED,
    "capsule": job_pb2.JOB_ORIGIN_CAPSULE,
    "rpc": job_pb2.JOB_ORIGIN_RPC,
}
DEFAULT_TARGET: Final = "127.0.0.1:50051"
TARGET_ENV: Final = "DPU_TARGET"


def default_target() -> str:
    """The agent address from $DPU_TARGET, else 127.0.0.1:50051."""
    return os.environ.get(TARGET_ENV, DEFAULT_TARGET)


_HEALTH_STATES: Final = {
    health_pb2.HealthCheckResponse.SERVING: "SERVING",
    health_pb2.HealthCheckResponse.NOT_SERVING: "NOT_SERVING",
    health_pb2.HealthCheckResponse.SERVICE_UNKNOWN: "SERVICE_UNKNOWN",
    health_pb2.HealthCheckResponse.UNKNOWN: "UNKNOWN",
}

RDMA_DEVICE_ENV: Final = "DPU_RDMA_DEVICE"
"""The host's RDMA device when `open_session` names none (two nodes on one machine)."""


class Client:
    """Async client of one DPU agent.

    Use it as an async context manager; it is reusable (enter it again after it
    exited) but not re-entrant:

        async with Client("127.0.0.1:50051") as client:
            info = await client.agent_info()

    Every call carries a request id (`x-request-id`) that the agent logs: a new one
    per call, or the caller's (`host_client.request_id(...)` around calls, or the
    `request_id=` of `open_session` and `Session.submit_rpc`). Failed calls raise a
    `DpuError` subclass that carries it too.

    An agent off loopback serves mTLS only: pass `tls=TlsConfig(ca=..., cert=...,
    key=...)` (or set $DPU_TLS_CA, $DPU_TLS_CERT, $DPU_TLS_KEY). The client
    certificate's subject CN is the tenant the calls act for.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = 10.0,
        tls: TlsConfig | Literal[False] | None = None,
        token: str | None = None,
    ) -> None:
        """Create a client for the agent at `target` (host:port, default $DPU_TARGET).

        `timeout` is the per-call deadline in seconds (None: no deadline). `tls`: the
        TLS files (None: from $DPU_TLS_CA etc., plaintext if unset; False: plaintext).
        `token`: a bearer token for a plaintext loopback agent that has a tokens file
        (None: $DPU_TOKEN; it is only ever sent to a loopback address or over TLS).
        """
        self.target = target or default_target()
        self.timeout = timeout
        self.tls = TlsConfig.from_env() if tls is None else (tls or None)
        self._token = os.environ.get(TOKEN_ENV) if token is None else token
        self._channel: grpc.aio.Channel | None = None
        self._rpc: Rpc | None = None

    async def __aenter__(self) -> Self:
        if self._channel is not None:
            raise RuntimeError("Client is already open (it is not re-entrant)")
        self._channel = open_channel(self.target, self.tls, self._token or None, [])
        self._rpc = Rpc(Stubs.over(self._channel), self.timeout, self._explain)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        channel, self._channel, self._rpc = self._channel, None, None
        if channel is not None:
            await channel.close(grace=None)

    @property
    def rpc(self) -> Rpc:
        """How calls are made (the client must be open)."""
        if self._rpc is None:
            raise RuntimeError("Client is not open: use `async with Client(...)`")
        return self._rpc

    @property
    def stubs(self) -> Stubs:
        """The raw typed stubs (the client must be open)."""
        return self.rpc.stubs

    async def wait_ready(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until the channel to the agent is connected, or raise UnavailableError."""
        if self._channel is None:
            raise RuntimeError("Client is not open: use `async with Client(...)`")
        try:
            await _with_timeout(self._channel.channel_ready(), timeout)
        except TimeoutError:
            reason = await self._explain()
            raise UnavailableError(
                "UNAVAILABLE", reason or f"agent at {self.target} not reachable within {timeout} s"
            ) from None

    async def _explain(self) -> str | None:
        """Why the channel cannot connect (one line saying what to change), if it can be told."""
        return await explain(self.target, self.tls)

    async def agent_info(self) -> agent_pb2.AgentInfo:
        """Identity, version, platform, RDMA devices and capabilities of the agent."""
        return await self._call(self.stubs.agent.GetAgentInfo, agent_pb2.GetAgentInfoRequest())

    async def health(self, service: str = "") -> str:
        """Health of the agent ("" for overall) or one service: "SERVING", "NOT_SERVING", ..."""
        try:
            response: health_pb2.HealthCheckResponse = await self._call(
                self.stubs.health.Check,
                health_pb2.HealthCheckRequest(service=service),
            )
        except NotFoundError:  # the health protocol's answer for an unknown service
            return "SERVICE_UNKNOWN"
        return _HEALTH_STATES.get(response.status, str(response.status))

    async def list_sessions(self) -> list[session_pb2.Session]:
        """Every session on the agent (all pages)."""
        return await self._all_pages(
            self.stubs.sessions.ListSessions,
            lambda token: session_pb2.ListSessionsRequest(page_token=token),
            lambda page: page.sessions,
        )

    async def get_session(self, name: str) -> session_pb2.Session:
        """One session by name ("sessions/{id}")."""
        return await self._call(
            self.stubs.sessions.GetSession, session_pb2.GetSessionRequest(name=name)
        )

    async def close_session(self, name: str) -> None:
        """Close a session on the agent: its jobs are cancelled, its data plane torn down."""
        await self._call(
            self.stubs.sessions.CloseSession,
            session_pb2.CloseSessionRequest(name=name, request_id=uuid.uuid4().hex),
        )

    async def list_jobs(self, session: str, state: int = 0) -> list[job_pb2.Job]:
        """A session's open and retained jobs (all pages), optionally in one state."""
        return await self._all_pages(
            self.stubs.jobs.ListJobs,
            lambda token: job_pb2.ListJobsRequest(session=session, page_token=token, state=state),  # type: ignore[arg-type]
            lambda page: page.jobs,
        )

    async def get_job(self, name: str) -> job_pb2.Job:
        """One job by name ("sessions/{id}/jobs/{n}")."""
        return await self._call(self.stubs.jobs.GetJob, job_pb2.GetJobRequest(name=name))

    async def cancel_job(self, name: str) -> job_pb2.Job:
        """Ask the agent to cancel a job; its completion says whether it did."""
        return await self._call(
            self.stubs.jobs.CancelJob,
            job_pb2.CancelJobRequest(name=name, request_id=uuid.uuid4().hex),
        )

    async def watch_completions(
        self, session: str, *, include_retained: bool = False, origin: str = "any"
    ) -> AsyncIterator[Completion]:
        """The completions of a session's jobs as they finish (the gRPC event stream).

        `origin`: "any", "capsule" (data-plane jobs) or "rpc" (SubmitJob jobs);
        `include_retained` also sends those that finished before the stream opened and
        are still retained. It ends when the session closes.
        """
        if origin not in _ORIGINS:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", f"origin is one of {', '.join(_ORIGINS)}, not {origin!r}"
            )
        rid = for_call()
        stream = self.stubs.jobs.WatchCompletions(
            job_pb2.WatchCompletionsRequest(
                session=session, include_retained=include_retained, origin=_ORIGINS[origin]
            ),
            metadata=((REQUEST_ID_METADATA_KEY, rid),),
        )
        try:
            async for message in stream:
                yield Completion.from_proto(message)
        except grpc.aio.AioRpcError as exc:
            raise await self.rpc.error(exc, rid) from None
        finally:
            stream.cancel()

    async def create_volume(  # noqa: PLR0913 - a volume's settings
        self,
        volume_id: str,
        size_bytes: int,
        *,
        block_size: int = 4096,
        crc32c: bool = False,
        compression: str = "none",
        encryption: str = "none",
        key: bytes | None = None,
        qos: storage_pb2.QosLimits | None = None,
    ) -> storage_pb2.Volume:
        """Create a volume on the DPU.

        `compression`: none, lz4, zstd; `encryption`: none or aes-xts-256 with a 64-byte
        `key` (None: the agent generates one and keeps it sealed); `qos`: I/O limits
        (`storage_pb2.QosLimits`, 0 = no limit; none by default).
        """
        if compression not in _COMPRESSIONS or encryption not in _ENCRYPTIONS:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT",
                f"compression is one of {', '.join(_COMPRESSIONS)}; "
                f"encryption one of {', '.join(_ENCRYPTIONS)}",
            )
        request = storage_pb2.CreateVolumeRequest(
            volume_id=volume_id,
            volume=storage_pb2.Volume(
                size_bytes=size_bytes,
                block_size=block_size,
                data_services=storage_pb2.DataServices(
                    crc32c=crc32c,
                    compression=_COMPRESSIONS[compression],
                    encryption=_ENCRYPTIONS[encryption],
                ),
                qos=qos,
            ),
            encryption_key=key or b"",
            request_id=uuid.uuid4().hex,
        )
        return await self._call(self.stubs.storage.CreateVolume, request)

    async def clone_volume(
        self,
        volume_id: str,
        snapshot: str,
        *,
        size_bytes: int = 0,
        qos: storage_pb2.QosLimits | None = None,
    ) -> storage_pb2.Volume:
        """Create a volume as a clone of `snapshot` ("snapshots/{id}"), sharing its blocks.

        The clone has the snapshot's block size, data services and key; `size_bytes` 0
        means the snapshot's size, a larger one reads zeros past it.
        """
        request = storage_pb2.CreateVolumeRequest(
            volume_id=volume_id,
            volume=storage_pb2.Volume(size_bytes=size_bytes, source_snapshot=snapshot, qos=qos),
            request_id=uuid.uuid4().hex,
        )
        return await self._call(self.stubs.storage.CreateVolume, request)

    async def set_volume_qos(
        self, name: str, qos: storage_pb2.QosLimits, *, fields: list[str] | None = None
    ) -> storage_pb2.Volume:
        """Change a volume's QoS limits: all four, or the `fields` named (e.g. "read_iops")."""
        paths = ["qos"] if fields is None else [f"qos.{f}" for f in fields]
        return await self._call(
            self.stubs.storage.UpdateVolume,
            storage_pb2.UpdateVolumeRequest(
                volume=storage_pb2.Volume(name=name, qos=qos),
                update_mask=field_mask_pb2.FieldMask(paths=paths),
                request_id=uuid.uuid4().hex,
            ),
        )

    async def get_volume(self, name: str) -> storage_pb2.Volume:
        """One volume ("volumes/{id}") with its statistics."""
        return await self._call(
            self.stubs.storage.GetVolume, storage_pb2.GetVolumeRequest(name=name)
        )

    async def list_volumes(self) -> list[storage_pb2.Volume]:
        """Every volume (all pages)."""
        return await self._all_pages(
            self.stubs.storage.ListVolumes,
            lambda token: storage_pb2.ListVolumesRequest(page_token=token),
            lambda page: page.volumes,
        )

    async def resize_volume(
        self, name: str, size_bytes: int, *, force: bool = False
    ) -> storage_pb2.Volume:
        """Grow a volume, or shrink it (over written data only with force)."""
        return await self._call(
            self.stubs.storage.ResizeVolume,
            storage_pb2.ResizeVolumeRequest(
                name=name, size_bytes=size_bytes, force=force, request_id=uuid.uuid4().hex
            ),
        )

    async def delete_volume(self, name: str) -> None:
        """Delete a volume and its data (its snapshots stay)."""
        await self._call(
            self.stubs.storage.DeleteVolume,
            storage_pb2.DeleteVolumeRequest(name=name, request_id=uuid.uuid4().hex),
        )

    async def create_snapshot(self, snapshot_id: str, volume: str) -> storage_pb2.Snapshot:
        """A read-only point-in-time snapshot of `volume` ("volumes/{id}"), durable when done."""
        return await self._call(
            self.stubs.storage.CreateSnapshot,
            storage_pb2.CreateSnapshotRequest(
                snapshot_id=snapshot_id,
                snapshot=storage_pb2.Snapshot(source_volume=volume),
                request_id=uuid.uuid4().hex,
            ),
        )

    async def get_snapshot(self, name: str) -> storage_pb2.Snapshot:
        """One snapshot ("snapshots/{id}")."""
        return await self._call(
            self.stubs.storage.GetSnapshot, storage_pb2.GetSnapshotRequest(name=name)
        )

    async def list_snapshots(self, volume: str = "") -> list[storage_pb2.Snapshot]:
        """Every snapshot (all pages), or those of `volume` ("volumes/{id}")."""
        return await self._all_pages(
            self.stubs.storage.ListSnapshots,
            lambda token: storage_pb2.ListSnapshotsRequest(page_token=token, source_volume=volume),
            lambda page: page.snapshots,
        )

    async def delete_snapshot(self, name: str) -> None:
        """Delete a snapshot (FailedPreconditionError while volumes were cloned from it)."""
        await self._call(
            self.stubs.storage.DeleteSnapshot,
            storage_pb2.DeleteSnapshotRequest(name=name, request_id=uuid.uuid4().hex),
        )

    async def list_ports(self) -> list[network_pb2.Port]:
        """The DPU's managed ports with state and counters."""
        reply: network_pb2.ListPortsResponse = await self._call(
            self.stubs.network.ListPorts, network_pb2.ListPortsRequest()
        )
        return list(reply.ports)

    async def create_flow_rule(
        self, rule_id: str, rule: network_pb2.FlowRule
    ) -> network_pb2.FlowRule:
        """Program a flow rule ("flowRules/{rule_id}") on its ingress port."""
        return await self._call(
            self.stubs.network.CreateFlowRule,
            network_pb2.CreateFlowRuleRequest(
                flow_rule_id=rule_id, flow_rule=rule, request_id=uuid.uuid4().hex
            ),
        )

    async def get_flow_rule(self, name: str) -> network_pb2.FlowRule:
        """One rule with its counters."""
        return await self._call(
            self.stubs.network.GetFlowRule, network_pb2.GetFlowRuleRequest(name=name)
        )

    async def list_flow_rules(self, port: str = "") -> list[network_pb2.FlowRule]:
        """Every rule (on one port, "ports/{name}"), all pages."""
        return await self._all_pages(
            self.stubs.network.ListFlowRules,
            lambda token: network_pb2.ListFlowRulesRequest(ingress_port=port, page_token=token),
            lambda page: page.flow_rules,
        )

    async def delete_flow_rule(self, name: str) -> None:
        """Remove a rule from the datapath."""
        await self._call(
            self.stubs.network.DeleteFlowRule,
            network_pb2.DeleteFlowRuleRequest(name=name, request_id=uuid.uuid4().hex),
        )

    async def apply_flow_rules(
        self,
        creates: Sequence[network_pb2.FlowRule] = (),
        updates: Sequence[network_pb2.FlowRule] = (),
        deletes: Sequence[str] = (),
        *,
        validate_only: bool = False,
    ) -> network_pb2.ApplyFlowRulesResponse:
        """Create, update and delete rules as one unit: all of them take, or none.

        Each rule carries its name ("flowRules/{rule}"); an update replaces the rule
        of that name (same ingress port); `deletes` are names. With `validate_only`
        the agent checks everything and changes nothing. At most 1024 per list.
        """
        return await self._call(
            self.stubs.network.ApplyFlowRules,
            network_pb2.ApplyFlowRulesRequest(
                creates=creates,
                updates=updates,
                deletes=deletes,
                validate_only=validate_only,
                request_id=uuid.uuid4().hex,
            ),
        )

    async def create_function(
        self, function_id: str, function: virtualization_pb2.Function
    ) -> virtualization_pb2.Function:
        """Make a function ("functions/{function_id}"): its device, representor and volume.

        Set `function.type` (FUNCTION_TYPE_VF, _SF, _VIRTIO_NET, _VIRTIO_BLK, _NVME) and,
        for a block function, `function.volume` ("volumes/{id}"). The answer carries the
        representor port and the device the host sees.
        """
        return await self._call(
            self.stubs.virtualization.CreateFunction,
            virtualization_pb2.CreateFunctionRequest(
                function_id=function_id, function=function, request_id=uuid.uuid4().hex
            ),
        )

    async def get_function(self, name: str) -> virtualization_pb2.Function:
        """One function ("functions/{id}")."""
        return await self._call(
            self.stubs.virtualization.GetFunction,
            virtualization_pb2.GetFunctionRequest(name=name),
        )

    async def list_functions(self) -> list[virtualization_pb2.Function]:
        """Every function (all pages)."""
        return await self._all_pages(
            self.stubs.virtualization.ListFunctions,
            lambda token: virtualization_pb2.ListFunctionsRequest(page_token=token),
            lambda page: page.functions,
        )

    async def update_function(
        self, function: virtualization_pb2.Function, fields: Sequence[str]
    ) -> virtualization_pb2.Function:
        """Change the named fields (mac_address, mtu, vlan_id, rate_limit_bps, trust, ...)."""
        request = virtualization_pb2.UpdateFunctionRequest(
            function=function, request_id=uuid.uuid4().hex
        )
        request.update_mask.paths.extend(fields)
        return await self._call(self.stubs.virtualization.UpdateFunction, request)

    async def delete_function(self, name: str) -> None:
        """Remove a function (refused while a flow rule or a mounted filesystem uses it)."""
        await self._call(
            self.stubs.virtualization.DeleteFunction,
            virtualization_pb2.DeleteFunctionRequest(name=name, request_id=uuid.uuid4().hex),
        )

    async def open_session(  # noqa: PLR0913 - the session's settings, all by keyword
        self,
        *,
        transport: str = "auto",
        queue_depth: int = 32,
        label: str = "",
        data_host: str = "127.0.0.1",
        rdma_device: str | None = None,
        request_id: str | None = None,
        poll_spin: float = DEFAULT_SPIN_S,
        inline: bool = True,
    ) -> Session:
        """Open a data-plane session; use it as `async with await client.open_session():`.

        `transport`: "verbs" (RDMA RC queue pair), "tcp" (a socket the agent dials
        back to at `data_host`, which must be where this client's calls come from, as
        the agent sees it), or "auto" (verbs when both this host and the agent have an
        RDMA device, else tcp). `rdma_device`: this host's RDMA device for verbs
        (default: $DPU_RDMA_DEVICE, else the first with an ACTIVE port); its IPv4-mapped
        RoCEv2 GID is the endpoint. `queue_depth` bounds the jobs in flight. `request_id`
        is the OpenSession call's id (and idempotency key); the completion events of
        the session's capsule jobs carry it (`Session.request_id`). `poll_spin`
        (verbs): seconds the session keeps polling for completions after the last
        activity before it sleeps on the completion channel (0: never poll), while
        answers have come, on average, within `poll_spin` of the send or answer before
        them (a job run alone always spins). `inline`:
        send a job's source inside its SUBMIT when the agent offers it and the source
        fits (`Session.inline_max`; tcp), instead of leaving it for the agent to READ.
        """
        if transport not in TRANSPORT_NUMBERS:
            choices = ", ".join(TRANSPORT_NUMBERS)
            raise InvalidArgumentError("INVALID_ARGUMENT", f"transport must be one of {choices}")
        rdma_device = rdma_device or os.environ.get(RDMA_DEVICE_ENV) or None
        if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", f"queue_depth must be 1..{MAX_QUEUE_DEPTH}, not {queue_depth}"
            )
        if transport == "auto":
            offered = set((await self.agent_info()).transports)
            verbs = TRANSPORT_NUMBERS["verbs"] in offered and _local_rdma(rdma_device)
            transport = "verbs" if verbs else "tcp"
        if not 0 <= poll_spin <= 1:
            raise InvalidArgumentError("INVALID_ARGUMENT", "poll_spin must be 0 to 1 s")
        host = _host_link(transport, data_host, rdma_device, queue_depth, poll_spin)
        session = Session(self.rpc, host, queue_depth, inline=inline)
        try:
            await session._open(TRANSPORT_NUMBERS[transport], label, request_id)  # noqa: SLF001
        except BaseException:
            await host.close()
            raise
        return session

    async def _all_pages(
        self,
        method: Callable[..., Awaitable[_P]],
        request: Callable[[str], object],
        items: Callable[[_P], Iterable[_T]],
    ) -> list[_T]:
        """Every item of a paged List RPC: one call per page until the last."""
        return await self.rpc.all_pages(method, request, items)

    async def _call(
        self,
        method: Callable[..., Awaitable[_R]],
        request: object,
        *,
        request_id: str | None = None,
    ) -> _R:
        return await self.rpc.call(method, request, request_id=request_id)


def _local_rdma(device: str | None) -> bool:
    try:
        from dpu_wire.transport import verbs  # noqa: PLC0415 - needs pyverbs
    except ImportError:
        return False
    try:
        verbs.find_port(device)
    except TransportError:
        return False
    return True


def _host_link(
    transport: str, data_host: str, rdma_device: str | None, queue_depth: int, spin: float
) -> HostLink:
    if transport == "tcp":
        link = TcpHostLink(data_host)
        link.listen()  # the agent dials while it answers OpenSession
        return link
    try:
        from dpu_wire.transport.verbs import VerbsHostLink  # noqa: PLC0415
    except ImportError as exc:
        raise FailedPreconditionError(
            "FAILED_PRECONDITION", f"the verbs transport needs pyverbs: {exc}"
        ) from None
    try:
        return VerbsHostLink(device=rdma_device, queue_depth=queue_depth, spin=spin)
    except TransportError as exc:
        raise FailedPreconditionError("FAILED_PRECONDITION", str(exc)) from None


async def _with_timeout(awaitable: Awaitable[None], timeout: float) -> None:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        await awaitable
