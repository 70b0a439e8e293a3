"""Server wiring: the grpc.aio server, its services, health, reflection and shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import grpc
from google.protobuf import descriptor, timestamp_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from dpu_agent import __version__, platform, tls
from dpu_agent.config import ConfigError, parse_cpus, rules_file, storage_dir
from dpu_agent.dataplane import transports
from dpu_agent.dataplane.bus import CompletionBus
from dpu_agent.dataplane.manager import ManagerSettings, SessionManager
from dpu_agent.dataplane.reactor import Reactor
from dpu_agent.errors import AgentError
from dpu_agent.interceptor import RpcInterceptor
from dpu_agent.network import tags
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import FlowTable
from dpu_agent.network.tags import TenantTags
from dpu_agent.quota import Quotas
from dpu_agent.services.agent_info import AgentInfoService
from dpu_agent.services.jobs import JobService
from dpu_agent.services.network import NetworkService
from dpu_agent.services.sessions import SessionService
from dpu_agent.services.storage import StorageService
from dpu_agent.services.unimplemented import unimplemented_handler
from dpu_agent.services.virtualization import VirtualizationService
from dpu_agent.storage import MemoryVolumeStore, VolumeStore, open_store
from dpu_agent.storage.exports import GuardedVolumeStore, VolumeExports
from dpu_agent.virtualization.factory import open_functions
from dpu_wire.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    job_pb2,
    job_pb2_grpc,
    network_pb2,
    network_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    storage_pb2,
    storage_pb2_grpc,
    virtualization_pb2,
    virtualization_pb2_grpc,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from dpu_agent.config import AgentConfig
    from dpu_agent.events import MqttEventPublisher
    from dpu_agent.metrics import AgentMetrics
    from dpu_agent.metrics_http import MetricsServer
    from dpu_agent.network.backend import FlowBackend
    from dpu_agent.virtualization.manager import FunctionManager

log = logging.getLogger(__name__)

# The largest request the API needs is AdvertiseRegions with 1024 regions (~300 KB at
# most); a bigger one is refused by gRPC before it is read into Python. Answers may be
# larger (a page of 500 jobs with their messages).
MAX_REQUEST_BYTES: Final = 1 << 20
MAX_ANSWER_BYTES: Final = 4 << 20
# [dataplane] poll_mode -> the reactor's spin (seconds an idle queue pair stays polled)
_SPIN: Final[dict[str, Callable[[float], float]]] = {
    "adaptive": lambda spin: spin,
    "busy": lambda _spin: -1.0,
    "event": lambda _spin: 0.0,
}
MAX_STREAMS_PER_CONNECTION: Final = 1024  # concurrent calls of one client; more wait their turn


RESERVED_DESCRIPTORS: Final = 1024  # the agent's own: volumes, data planes, MQTT, metrics


def _reserve_descriptors(connections: int) -> None:
    """Raise the soft RLIMIT_NOFILE so `connections` leave the agent its own descriptors.

    Up to the hard limit; a warning when even that is short (the connections' limit then
    does not protect the agent's own work from running out).
    """
    need = connections + RESERVED_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < need:
        log.warning(
            "the descriptor limit (%d) is below [agent] max_connections (%d) plus %d for the "
            "agent's own files: raise LimitNOFILE or lower max_connections",
            raised,
            connections,
            RESERVED_DESCRIPTORS,
        )


@dataclasses.dataclass(frozen=True)
class PlannedService:
    """An API service defined in proto/ that this agent version does not serve yet."""

    descriptor: descriptor.ServiceDescriptor
    reason: str


NETWORK_SERVICE: Final = network_pb2.DESCRIPTOR.services_by_name["NetworkService"]
NO_NETWORK: Final = PlannedService(
    NETWORK_SERVICE, "no network backend is configured ([network] backend = tc)"
)
VIRTUALIZATION_SERVICE: Final = virtualization_pb2.DESCRIPTOR.services_by_name[
    "VirtualizationService"
]
NO_VIRTUALIZATION: Final = PlannedService(
    VIRTUALIZATION_SERVICE,
    "no function backend is configured ([virtualization] backend = linux or bluefield)",
)
PLANNED_SERVICES: Final[tuple[PlannedService, ...]] = ()

SERVED_SERVICES: Final = (
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"],
    session_pb2.DESCRIPTOR.services_by_name["SessionService"],
    job_pb2.DESCRIPTOR.services_by_name["JobService"],
    storage_pb2.DESCRIPTOR.services_by_name["StorageService"],
)


def capabilities(
    served: Sequence[descriptor.ServiceDescriptor], planned: Sequence[PlannedService]
) -> list[agent_pb2.Capability]:
    """One capability entry per API service: served, or why not."""
    return [agent_pb2.Capability(service=s.full_name, available=True) for s in served] + [
        agent_pb2.Capability(service=p.descriptor.full_name, available=False, reason=p.reason)
        for p in planned
    ]


def _flow_table(config: AgentConfig) -> FlowTable | None:
    if config.network_backend == "none":
        return None
    patterns = [p.strip() for p in config.network_ports.split(",") if p.strip()]
    backend: FlowBackend
    if config.network_backend == "memory":
        backend = MemoryFlowBackend()
    else:
        from dpu_agent.network.tc_backend import TcFlowBackend  # noqa: PLC0415 - see _event_publisher

        backend = TcFlowBackend(patterns, netns=config.network_netns or None)
    table = FlowTable(backend, RuleStore(rules_file(config)))
    report = table.start()
    log.info(
        "flow rules reconciled",
        extra={
            "reapplied": len(report.reapplied),
            "present": len(report.present),
            "failed": len(report.failed),
            "foreign": len(report.foreign),
        },
    )
    return table


def _event_publisher(
    config: AgentConfig,
    start_time: timestamp_pb2.Timestamp,
    telemetry: Callable[[], dict[str, object]],
) -> MqttEventPublisher:
    # aiomqtt, prometheus_client and pyroute2 are imported by the agents that use them
    # only: they were about 40 % of the agent's import time (595 -> 376-412 ms median here,
    # 13-18 -> 7-10 s in the TCG test VM)
    from dpu_agent.events import MqttEventPublisher, MqttSettings  # noqa: PLC0415

    password = None
    if config.mqtt_password_file:
        try:
            text = Path(config.mqtt_password_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"mqtt.password_file: cannot read: {exc.strerror}") from None
        password = text.rstrip("\r\n")
    try:
        settings = MqttSettings(
            host=config.mqtt_host,
            port=config.mqtt_port,
            client_id=config.mqtt_client_id,
            username=config.mqtt_username or None,
            password=password,
            keepalive=config.mqtt_keepalive,
            backlog=config.mqtt_backlog,
            telemetry_interval=config.mqtt_telemetry_interval,
            topic_prefix=config.mqtt_topic_prefix,
            flush_timeout=config.mqtt_flush_timeout,
        )
    except ValueError as exc:
        raise ConfigError(f"mqtt: {exc}") from None
    return MqttEventPublisher(
        settings,
        config.agent_id,
        started_ns=start_time.ToNanoseconds(),
        telemetry_source=telemetry,
    )


def _open_store(config: AgentConfig) -> VolumeStore:
    directory = storage_dir(config) if config.storage_backend == "file" else None
    try:
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        store = open_store(
            config.storage_backend,
            directory,
            memory_capacity_bytes=config.storage_memory_capacity,
        )
    except (AgentError, OSError) as exc:
        where = f" at {directory}" if directory is not None else ""
        raise OSError(
            f"cannot open the {config.storage_backend} volume store{where}: {exc}"
        ) from None
    extra: dict[str, object] = {"backend": config.storage_backend, "dir": str(directory)}
    if isinstance(store, MemoryVolumeStore):
        extra["capacity_bytes"] = store.capacity_bytes
    log.info("volume store open", extra=extra)
    return store


class AgentServer:
    """The agent's gRPC server. Start it, then stop it (gracefully) once."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        extra_handlers: Sequence[grpc.GenericRpcHandler[Any, Any]] = (),
    ) -> None:
        self.config = config
        self._extra_handlers = tuple(extra_handlers)
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.port = 0
        self.sessions: SessionManager | None = None
        self.reactor: Reactor | None = None
        self.store: VolumeStore | None = None
        self.events: MqttEventPublisher | None = None
        self.flows: FlowTable | None = None
        self.metrics: AgentMetrics | None = None  # None: [metrics] listen = ""
        self.metrics_endpoint: MetricsServer | None = None
        self.functions: FunctionManager | None = None
        self.tenant_tags = TenantTags()  # read from [network] tenant_tags_file by start()
        self.exports = VolumeExports()

    @property
    def address(self) -> str:
        """host:port the server is bound to (valid after start)."""
        return f"{self.config.listen.rpartition(':')[0]}:{self.port}"

    async def start(self) -> str:
        """Bind, register every service and start serving; return the bound address."""
        if self._server is not None:
            raise RuntimeError("AgentServer.start() called twice")
        security = tls.security(self.config)  # ConfigError before anything is opened
        self.tenant_tags = tags.from_config(self.config)  # ConfigError too
        start_time = timestamp_pb2.Timestamp()
        start_time.GetCurrentTime()
        devices = await asyncio.to_thread(platform.rdma_devices)
        cfg = self.config
        self.store = await asyncio.to_thread(_open_store, cfg)
        self.flows = await asyncio.to_thread(_flow_table, cfg)
        flows = self.flows
        self.functions = await asyncio.to_thread(
            lambda: open_functions(
                cfg,
                volumes=self.store,
                exports=self.exports,
                flow_rules=flows.rules if flows is not None else list,
            )
        )
        # Everyone but a block function's export goes through the guard.
        guarded = GuardedVolumeStore(self.store, self.exports)
        served, planned = self._service_sets()
        if cfg.mqtt_enabled:
            self.events = _event_publisher(cfg, start_time, self._session_stats)
        if cfg.metrics_listen:
            from dpu_agent.metrics import AgentMetrics  # noqa: PLC0415 - see _event_publisher

            self.metrics = AgentMetrics(cfg.agent_id, __version__)
        bus = CompletionBus()
        if self.metrics is not None:
            bus.subscribe(self.metrics.on_completions)
        if self.events is not None:
            bus.subscribe(self.events.on_completions)
        factories = transports.factories(cfg, devices)
        self.reactor = Reactor(
            spin=_SPIN[cfg.poll_mode](cfg.poll_spin),
            compute_workers=cfg.compute_workers,
            io_workers=cfg.io_workers,
            on_crash=_exit_on_reactor_crash,
            cpus=parse_cpus(cfg.reactor_cpus),
            refusals_per_s=cfg.refusals_per_s,
        )
        self.reactor.start()
        self.sessions = SessionManager(
            ManagerSettings(
                max_sessions=cfg.max_sessions,
                max_sessions_per_connection=cfg.max_sessions_per_connection,
                default_queue_depth=cfg.queue_depth,
                orphan_timeout=cfg.orphan_timeout,
                first_watch_timeout=cfg.first_watch_timeout,
                failed_retention=cfg.failed_retention,
                chunk_size=cfg.chunk_size,
                large_buffers=cfg.staging_buffers,
            ),
            factories,
            reactor=self.reactor,
            bus=bus,
            store=guarded,
            quotas=Quotas.from_config(cfg),
            events=self.metrics,
        )
        server = grpc.aio.server(
            interceptors=[RpcInterceptor(security.authenticator)],
            options=[
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", MAX_ANSWER_BYTES),
                ("grpc.so_reuseport", 0),
                ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                # a connection past this is closed at accept, and one that has not finished
                # its handshake (TLS, HTTP/2 settings) in time is closed: descriptors and
                # memory stay bounded whoever connects (README "Security")
                ("grpc.max_allowed_incoming_connections", self.config.max_connections),
                ("grpc.server_handshake_timeout_ms", round(self.config.handshake_timeout * 1000)),
            ],
        )
        _reserve_descriptors(self.config.max_connections)
        self._register(server, guarded, served, planned, start_time=start_time, devices=devices)
        try:
            if security.credentials is None:  # tls.security() allowed it: loopback only
                self.port = server.add_insecure_port(self.config.listen)
            else:
                self.port = server.add_secure_port(self.config.listen, security.credentials)
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {self.config.listen}: {exc}") from None
        await server.start()
        self.sessions.start()
        if self.events is not None:
            self.events.start()
        await self._serve_metrics()
        self._server = server
        for name in (*[s.full_name for s in served], health.OVERALL_HEALTH):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving",
            extra={
                "address": self.address,
                "agent": self.config.agent_id,
                "version": __version__,
                "security": security.description,
            },
        )
        return self.address

    def _service_sets(self) -> tuple[list[descriptor.ServiceDescriptor], list[PlannedService]]:
        """The services this agent serves, and the planned ones with why they are not served."""
        served = list(SERVED_SERVICES)
        planned = list(PLANNED_SERVICES)
        if self.flows is None:
            planned.append(NO_NETWORK)
        else:
            served.append(NETWORK_SERVICE)
        if self.functions is None:
            planned.append(NO_VIRTUALIZATION)
        else:
            served.append(VIRTUALIZATION_SERVICE)
        return served, planned

    def _register(  # noqa: PLR0913 - everything the servicers are built from
        self,
        server: grpc.aio.Server,
        guarded: VolumeStore,
        served: list[descriptor.ServiceDescriptor],
        planned: list[PlannedService],
        *,
        start_time: timestamp_pb2.Timestamp,
        devices: tuple[platform.RdmaDeviceInfo, ...],
    ) -> None:
        """Add every servicer, the UNIMPLEMENTED stand-ins, health and reflection."""
        assert self.sessions is not None  # noqa: S101 - start() made it
        agent_pb2_grpc.add_AgentServiceServicer_to_server(
            AgentInfoService(
                self.config.agent_id,
                start_time,
                capabilities(served, planned),
                devices,
                self.sessions.available_transports,
            ),
            server,
        )
        session_pb2_grpc.add_SessionServiceServicer_to_server(
            SessionService(self.sessions, guarded), server
        )
        job_pb2_grpc.add_JobServiceServicer_to_server(JobService(self.sessions), server)
        quotas = Quotas.from_config(self.config)
        storage_pb2_grpc.add_StorageServiceServicer_to_server(
            StorageService(guarded, quotas), server
        )
        if self.flows is not None:
            network_pb2_grpc.add_NetworkServiceServicer_to_server(
                NetworkService(self.flows, quotas, owners=self.functions, tags=self.tenant_tags),
                server,
            )
        if self.functions is not None:
            virtualization_pb2_grpc.add_VirtualizationServiceServicer_to_server(
                VirtualizationService(self.functions, guarded), server
            )
        handlers = [unimplemented_handler(p.descriptor, p.reason) for p in planned]
        server.add_generic_rpc_handlers([*handlers, *self._extra_handlers])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [s.full_name for s in served] + [p.descriptor.full_name for p in planned]
        reflection.enable_server_reflection(
            [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )

    async def _serve_metrics(self) -> None:
        """Serve GET /metrics on [metrics] listen.

        An address that cannot be bound is logged as an error and the agent serves
        without the endpoint: metrics must not take the data path down.
        """
        if self.metrics is None:
            return
        self.metrics.observe(
            sessions=self.sessions, events=self.events, store=self.store, flows=self.flows
        )
        from dpu_agent.metrics_http import MetricsServer  # noqa: PLC0415 - see _event_publisher

        endpoint = MetricsServer(self.metrics.registry)
        listen = self.config.metrics_listen
        try:
            await asyncio.to_thread(endpoint.start, listen)
        except OSError as exc:
            log.error(  # noqa: TRY400 - the reason is in the message, no traceback needed
                "metrics endpoint disabled: cannot listen",
                extra={"listen": listen, "error": str(exc)},
            )
            return
        self.metrics_endpoint = endpoint
        if not tls.is_loopback(endpoint.address):
            log.warning(
                "metrics endpoint on a non-loopback address (plain HTTP, no authentication)",
                extra={"address": endpoint.address},
            )
        log.info("metrics serving", extra={"address": endpoint.address, "url": endpoint.url})

    def _session_stats(self) -> dict[str, object]:
        return self.sessions.telemetry() if self.sessions else {"sessions": 0}

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting RPCs; give in-flight ones `grace` seconds, then cancel them."""
        if self._server is None:
            return
        server, self._server = self._server, None
        grace = self.config.grace_period if grace is None else grace
        await self._health.enter_graceful_shutdown()
        log.info("draining", extra={"grace_s": grace})
        started = time.monotonic()
        if self.sessions is not None:
            await self.sessions.drain(grace)
            await self.sessions.stop()
        if self.reactor is not None:
            await asyncio.to_thread(self.reactor.stop)
        await server.stop(max(0.0, grace - (time.monotonic() - started)))
        if self.events is not None:
            await self.events.stop()  # the last completions, then the retained "offline"
        if self.metrics_endpoint is not None:  # before what its scrapes read is closed
            await asyncio.to_thread(self.metrics_endpoint.stop)
        if self.functions is not None:
            await asyncio.to_thread(self.functions.close)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
        log.info("stopped")


async def serve(
    config: AgentConfig,
    *,
    ready_file: Path | None = None,
    extra_handlers: Iterable[grpc.GenericRpcHandler[Any, Any]] = (),
) -> None:
    """Run the agent until SIGTERM or SIGINT, then shut down gracefully."""
    server = AgentServer(config, extra_handlers=tuple(extra_handlers))
    address = await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_file is not None:
        tmp = ready_file.with_suffix(ready_file.suffix + ".tmp")
        tmp.write_text(address + "\n")
        tmp.replace(ready_file)
    try:
        await stop.wait()
        log.info("signal received, shutting down")
    finally:
        await server.stop()


EXIT_REACTOR_CRASHED: Final = 70  # EX_SOFTWARE


def _exit_on_reactor_crash(_exc: BaseException) -> None:
    """Exit at once (EX_SOFTWARE): a dead reactor is a dead data plane.

    No job would complete and no session close, and a graceful shutdown would wait on it
    forever. The supervisor restarts the agent; the volume store is crash-consistent by
    design, and hosts see their sessions fail and open new ones.
    """
    logging.shutdown()
    os._exit(EXIT_REACTOR_CRASHED)
