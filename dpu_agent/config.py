"""Agent configuration: defaults < TOML file < environment < command-line flags.

Example file (every key optional):

    [agent]
    id = "dpu-0"                  # the agent's resource name is "agents/dpu-0"
    listen = "127.0.0.1:50051"    # host:port; port 0 picks a free port
    grace_period = 10.0           # seconds in-flight RPCs get to finish on SIGTERM
    max_connections = 1024        # gRPC client connections held at once; one more is
                                  # closed at accept (keeps descriptors for the agent's work)
    handshake_timeout = 10.0      # seconds a new connection gets to finish its TLS and
                                  # HTTP/2 handshake before it is closed

    [log]
    level = "info"                # debug, info, warning, error
    format = "json"               # json, text
    access_per_s = 100            # access-log lines a second per tenant (the rest are
                                  # dropped and counted in the next line); 0 = every call

    [dataplane]
    transports = "auto"           # auto (verbs if an RDMA port is ACTIVE, and tcp), or a
                                  # comma list of verbs, tcp
    rdma_device = ""              # "" = the first device with an ACTIVE port
    poll_mode = "adaptive"        # adaptive (poll while busy and poll_spin s after, then
                                  # sleep on the completion channel), busy, event
    poll_spin = 0.002             # adaptive: seconds a queue pair stays polled when idle
                                  # (up to 10x that for one whose jobs come ms apart)
    reactor_cpus = ""             # CPUs the data-plane thread runs on ("2", "2-3,6");
                                  # "" = wherever the scheduler puts it
    queue_depth = 32              # default jobs in flight per session (1-1024)
    max_sessions = 64             # sessions the agent serves at once
    max_sessions_per_connection = 8   # sessions one client connection (gRPC peer) holds
    refusals_per_s = 1000         # capsules a tenant may send a second that run no job
                                  # (refused, failed at admission, CANCEL of no open job);
                                  # past it its links are not read for a while; 0 = no limit
    orphan_timeout = 10.0         # seconds a session lives after its last watcher left
    first_watch_timeout = 5.0     # seconds a new session lives if no host ever watches it
    failed_retention = 30.0       # seconds a FAILED session stays listed
    chunk_size = 1048576          # bytes moved per RDMA op and large staging buffer
    staging_buffers = 4           # large staging buffers per session
    compute_workers = 2           # threads for compression, encryption, hashing
    io_workers = 16               # threads for blocking volume calls (syncs, large I/O)
    tcp_allow = "peer"            # where the tcp data plane may dial: the gRPC caller's
                                  # own address ("peer"), and/or networks ("10.0.0.0/8")
    verbs_allow = "any"           # which host GIDs (::ffff:a.b.c.d) the verbs data plane
                                  # may connect to: any, peer, and/or networks
    op_timeout = 30.0             # seconds a tcp host may leave a READ/WRITE unanswered,
                                  # or read none of the agent's waiting frames
    inline_max = 4096             # the largest job source a SUBMIT may carry inline
                                  # (0-16384; 0 = none; verbs: each RECV buffer is then
                                  # 80 + inline_max bytes)

    [storage]
    backend = "file"              # file (a pool file + metadata log; survives crashes) or memory
    dir = ""                      # "" = $STATE_DIRECTORY/volumes (systemd) or
                                  # ~/.local/state/dpu-agent/volumes
    memory_capacity = 0           # memory backend: the most bytes of RAM its volumes hold
                                  # (data, log, checkpoints); past it a write fails as on
                                  # a full disk. 0 = half the memory available at start
                                  # (MemAvailable, or the cgroup's limit less its usage)

    [network]
    backend = "none"              # tc (Linux tc flower), memory (rules kept, no datapath), none
    ports = "p0,p1,pf*,rep*"      # netdev name patterns of the managed ports
    rules_file = ""               # "" = next to the volume store: <state>/flow-rules.json
    netns = ""                    # the ports' network namespace ("" = the agent's own)
    tenant_tags_file = ""         # the VLAN ids and VNIs each tenant's flow rules may push,
                                  # pop and match, and untagged uplink traffic (TOML,
                                  # dpu_agent/network/tags.py); "" = none: only the
                                  # admin role uses tags or sends untagged to an uplink

    [virtualization]
    backend = "none"              # linux (veth + netns, NBD + NVMe-oF), bluefield, memory, none
    state_file = ""               # "" = next to the volume store: <state>/functions.json
    host_netns_prefix = "fn-"     # linux: a network function's end goes to netns <prefix><id>
    block_export = "nvmf-rdma"    # linux: nvmf-rdma (NBD under the kernel NVMe-oF target,
                                  # connected over RDMA) or nbd (the NBD device itself)
    nvmf_address = ""             # linux: the RDMA interface address the target listens on
    nvmf_port = 4420
    nvmf_host_address = ""        # linux: the host side's RDMA address to connect from
                                  # ("" = the kernel's choice)

    [mqtt]
    enabled = false               # publish completions, status and telemetry
    host = "127.0.0.1"
    port = 1883
    client_id = ""                # "" = dpu-agent-{agent id}
    username = ""                 # "" = anonymous
    password_file = ""            # the password is read from this file, never configured inline
    keepalive = 30
    backlog = 100000              # events kept while the broker is away or slow; each
                                  # tenant with events waiting gets an equal share
    telemetry_interval = 10.0     # seconds; 0 = no telemetry
    topic_prefix = "dpu/v1"
    flush_timeout = 5.0           # seconds shutdown waits to send the backlog

    [metrics]
    listen = "127.0.0.1:9464"     # Prometheus GET /metrics over HTTP; port 0 = any free
                                  # port (logged); "" = no endpoint

    [tls]                         # the gRPC listener (see dpu_agent/tls.py, README "Security")
    cert = ""                     # the agent's certificate chain (PEM)
    key = ""                      # its private key (PEM, unencrypted, mode 0600)
    client_ca = ""                # CA bundle client certificates must chain to (mTLS)
    plaintext_loopback = false    # no TLS: allowed only on a loopback listen address

    [auth]
    tokens_file = ""              # plaintext loopback only: bearer tokens -> tenants (TOML,
                                  # mode 0600); "" = every local caller is the local admin

    [quota]                       # per tenant; 0 = no limit
    max_volumes = 1024            # volumes (clones too) of a tenant (on by default)
    max_volume_bytes = 0          # total size of the tenant's volumes
    max_snapshots = 1024          # snapshots of a tenant (on by default)
    max_sessions = 16             # open sessions of a tenant (on by default)
    max_queue_depth = 0           # jobs in flight over all the tenant's sessions
    max_flow_rules = 1024         # flow rules of a tenant (on by default)
    max_functions = 64            # functions (VFs, SFs, virtio, NVMe) of a tenant (on)
    max_block_functions = 4       # of them block functions (virtio-blk, NVMe): each holds
                                  # one of the kernel's NBD devices (16 by default) (on)

Without [tls] files the agent refuses to start unless plaintext_loopback is set and
it listens on loopback. With them every caller needs a client certificate that chains
to client_ca: its subject CN is the tenant, O=admin gives the admin role.

Each key has an environment variable that overrides the file, e.g.
`DPU_AGENT_LISTEN=0.0.0.0:50051`; `dpu-agent serve --help` lists them. Every numeric
setting has bounds, stated once in `SETTINGS` (a `Number`) and shown by `--help`; a
value outside them is a ConfigError from every source (file, environment, flags).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from dpu_agent import logs, tomltext
from dpu_agent.dataplane import hostpolicy
from dpu_wire import names
from dpu_wire.capsule import MAX_INLINE
from dpu_wire.events import TopicError, check_prefix

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping


MAX_FILE_BYTES: Final = 1 << 20  # a configuration file is a few kilobytes


class ConfigError(Exception):
    """The configuration is malformed; the message says where and why."""


def _default_agent_id() -> str:
    host = socket.gethostname().lower().split(".")[0]
    cleaned = "".join(c if c.isalnum() else "-" for c in host).strip("-")[: names.MAX_ID_LENGTH]
    return cleaned or "dpu"


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The agent's settings after all sources are merged and validated."""

    agent_id: str = dataclasses.field(default_factory=_default_agent_id)
    listen: str = "127.0.0.1:50051"
    grace_period: float = 10.0
    max_connections: int = 1024
    handshake_timeout: float = 10.0
    log_level: str = "info"
    log_format: str = "json"
    log_access_per_s: int = logs.ACCESS_PER_S
    transports: str = "auto"
    rdma_device: str = ""
    poll_mode: str = "adaptive"
    poll_spin: float = 0.002
    reactor_cpus: str = ""
    queue_depth: int = 32
    max_sessions: int = 64
    max_sessions_per_connection: int = 8
    refusals_per_s: int = 1000
    orphan_timeout: float = 10.0
    first_watch_timeout: float = 5.0
    failed_retention: float = 30.0
    chunk_size: int = 1 << 20
    staging_buffers: int = 4
    compute_workers: int = 2
    io_workers: int = 16
    tcp_allow: str = "peer"
    verbs_allow: str = "any"
    op_timeout: float = 30.0
    inline_max: int = 4096
    storage_backend: str = "file"
    storage_dir: str = ""
    storage_memory_capacity: int = 0
    network_backend: str = "none"
    network_ports: str = "p0,p1,pf*,rep*"
    network_rules_file: str = ""
    network_netns: str = ""
    network_tenant_tags_file: str = ""
    virt_backend: str = "none"
    virt_state_file: str = ""
    virt_host_netns_prefix: str = "fn-"
    virt_block_export: str = "nvmf-rdma"
    virt_nvmf_address: str = ""
    virt_nvmf_port: int = 4420
    virt_nvmf_host_address: str = ""
    mqtt_enabled: bool = False
    mqtt_host: str = "127.0.0.1"
    mqtt_port: int = 1883
    mqtt_client_id: str = ""
    mqtt_username: str = ""
    mqtt_password_file: str = ""
    mqtt_keepalive: int = 30
    mqtt_backlog: int = 100_000
    mqtt_telemetry_interval: float = 10.0
    mqtt_topic_prefix: str = "dpu/v1"
    mqtt_flush_timeout: float = 5.0
    metrics_listen: str = "127.0.0.1:9464"
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    tls_plaintext_loopback: bool = False
    auth_tokens_file: str = ""
    quota_max_volumes: int = 1024
    quota_max_volume_bytes: int = 0
    quota_max_snapshots: int = 1024
    quota_max_sessions: int = 16
    quota_max_queue_depth: int = 0
    quota_max_flow_rules: int = 1024
    quota_max_functions: int = 64
    quota_max_block_functions: int = 4


@dataclasses.dataclass(frozen=True)
class Setting:
    """One configuration key: where it lives in the file and the environment."""

    section: str
    key: str
    attr: str
    env: str
    parse: Callable[[object, str], Any]
    help: str


def _agent_id(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__}")
    try:
        return names.check_id(value, "agent id")
    except names.InvalidNameError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _listen(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__}")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{where}: {value!r} is not host:port (port 0-65535)")
    return value


def _optional_listen(value: object, where: str) -> str:
    return "" if value == "" else _listen(value, where)


def _allow(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 1024:
        raise ConfigError(f"{where}: expected peer, any or a comma list of networks")
    try:
        hostpolicy.parse_allow(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return ",".join(item.strip() for item in value.split(",") if item.strip())


def _transports(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__}")
    items = [v.strip().lower() for v in value.split(",") if v.strip()]
    if items == ["auto"]:
        return "auto"
    if not items or any(v not in {"verbs", "tcp"} for v in items):
        raise ConfigError(f"{where}: expected auto or a comma list of verbs, tcp; got {value!r}")
    return ",".join(dict.fromkeys(items))


MAX_CPU: Final = 4095


def parse_cpus(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list ("2", "0-3,6"; "" is none); ValueError if malformed."""
    cpus: set[int] = set()
    for item in filter(None, (part.strip() for part in text.split(","))):
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{item!r} is not a CPU number or a range a-b")
        first, last = int(low), int(high) if dash else int(low)
        if first > last or last > MAX_CPU:
            raise ValueError(f"{item!r} is not a range within 0-{MAX_CPU}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _cpus(value: object, where: str) -> str:
    """A CPU list this process may run on, normalised ("3,1-2" -> "1-3")."""
    if not isinstance(value, str) or len(value) > 1024:
        raise ConfigError(f'{where}: expected a CPU list such as "2" or "0-3,6"')
    try:
        cpus = parse_cpus(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        missing = ",".join(str(cpu) for cpu in sorted(cpus - allowed))
        raise ConfigError(
            f"{where}: CPU {missing} is not one this process may run on "
            f"({_cpu_text(frozenset(allowed))})"
        )
    return _cpu_text(cpus)


def _cpu_text(cpus: frozenset[int]) -> str:
    """The shortest CPU list for `cpus` ("0-3,6")."""
    runs: list[str] = []
    ordered = sorted(cpus)
    start = 0
    for i, cpu in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != cpu + 1:
            first = ordered[start]
            runs.append(str(cpu) if first == cpu else f"{first}-{cpu}")
            start = i + 1
    return ",".join(runs)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 64:
        raise ConfigError(f"{where}: expected a string of at most 64 characters")
    return value


def _boolean(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in {
        "true",
        "1",
        "yes",
        "on",
        "false",
        "0",
        "no",
        "off",
    }:
        return value.lower() in {"true", "1", "yes", "on"}
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _topic_prefix(value: object, where: str) -> str:
    try:
        return check_prefix(_text(value, where))
    except TopicError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _path(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 4096:
        raise ConfigError(f"{where}: expected a path")
    return value


@dataclasses.dataclass(frozen=True)
class Number:
    """The parser of a numeric setting: an integer or a number of seconds in low..high.

    `off`, when given, is what 0 means; 0 is then allowed below `low` (e.g. "no limit").
    The bounds are stated here once: `dpu-agent serve --help` shows them (`text`) and
    every source (file, environment, flags) goes through `__call__`.
    """

    low: float
    high: float
    seconds: bool = False
    off: str = ""

    @property
    def text(self) -> str:
        """The allowed values, for --help: "1-1024", "0 = off, or 1-3600 s"."""
        unit = " s" if self.seconds else ""
        span = f"{_plain_number(self.low)}-{_plain_number(self.high)}{unit}"
        return f"0 = {self.off}, or {span}" if self.off else span

    def __call__(self, value: object, where: str) -> int | float:
        """The value as an int (float for seconds); ConfigError naming `where` otherwise."""
        what = "a number of seconds" if self.seconds else "an integer"
        if isinstance(value, str):
            try:
                value = float(value) if self.seconds else int(value.strip(), 10)
            except ValueError:
                raise ConfigError(f"{where}: {value!r} is not {what} ({self.text})") from None
        kinds = (int, float) if self.seconds else (int,)
        if (
            isinstance(value, bool)
            or not isinstance(value, kinds)
            or not (self.low <= value <= self.high or (self.off and value == 0))
        ):
            raise ConfigError(f"{where}: expected {what} in {self.text}, got {value!r}")
        return float(value) if self.seconds else int(value)


def _plain_number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


NO_LIMIT: Final = "no limit"
MIN_MEMORY_CAPACITY: Final = 1 << 20  # the memory store's log and checkpoints take ~300 KiB


def _integer(low: int, high: int, off: str = "") -> Number:
    return Number(low, high, off=off)


def _seconds(low: float, high: float, off: str = "") -> Number:
    return Number(low, high, seconds=True, off=off)


def _choice(*allowed: str) -> Callable[[object, str], str]:
    def parse(value: object, where: str) -> str:
        if not isinstance(value, str) or value.lower() not in allowed:
            raise ConfigError(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
        return value.lower()

    return parse


SETTINGS: Final = (
    Setting(
        "agent", "id", "agent_id", "DPU_AGENT_ID", _agent_id, "agent id (resource agents/{id})"
    ),
    Setting("agent", "listen", "listen", "DPU_AGENT_LISTEN", _listen, "gRPC listen address"),
    Setting(
        "agent",
        "grace_period",
        "grace_period",
        "DPU_AGENT_GRACE_PERIOD",
        _seconds(0, 3600),
        "seconds in-flight RPCs get on shutdown",
    ),
    Setting(
        "agent",
        "max_connections",
        "max_connections",
        "DPU_AGENT_MAX_CONNECTIONS",
        _integer(8, 1 << 20),
        "gRPC client connections held at once (one more is closed at accept)",
    ),
    Setting(
        "agent",
        "handshake_timeout",
        "handshake_timeout",
        "DPU_AGENT_HANDSHAKE_TIMEOUT",
        _seconds(0.1, 120),
        "seconds a new gRPC connection gets to finish its TLS and HTTP/2 handshake",
    ),
    Setting("log", "level", "log_level", "DPU_AGENT_LOG_LEVEL", _choice(*logs.LEVELS), "log level"),
    Setting(
        "log", "format", "log_format", "DPU_AGENT_LOG_FORMAT", _choice(*logs.FORMATS), "log format"
    ),
    Setting(
        "log",
        "access_per_s",
        "log_access_per_s",
        "DPU_AGENT_LOG_ACCESS_PER_S",
        _integer(1, 1_000_000, off="every call"),
        "access-log lines a second per tenant; the rest are dropped and counted",
    ),
    Setting(
        "dataplane",
        "transports",
        "transports",
        "DPU_AGENT_TRANSPORTS",
        _transports,
        "auto, or a comma list of verbs, tcp",
    ),
    Setting(
        "dataplane", "rdma_device", "rdma_device", "DPU_AGENT_RDMA_DEVICE", _text, "RDMA device"
    ),
    Setting(
        "dataplane",
        "poll_mode",
        "poll_mode",
        "DPU_AGENT_POLL_MODE",
        _choice("adaptive", "busy", "event"),
        "CQ polling: adaptive, busy or event",
    ),
    Setting(
        "dataplane",
        "poll_spin",
        "poll_spin",
        "DPU_AGENT_POLL_SPIN",
        _seconds(0, 1),
        "adaptive polling: seconds an idle queue pair stays polled (grows to 10x for one "
        "woken after a short sleep)",
    ),
    Setting(
        "dataplane",
        "reactor_cpus",
        "reactor_cpus",
        "DPU_AGENT_REACTOR_CPUS",
        _cpus,
        'CPUs the data-plane thread runs on, a CPU list ("2", "0-3,6"); "" = any',
    ),
    Setting(
        "dataplane",
        "queue_depth",
        "queue_depth",
        "DPU_AGENT_QUEUE_DEPTH",
        _integer(1, 1024),
        "default jobs in flight per session",
    ),
    Setting(
        "dataplane",
        "max_sessions",
        "max_sessions",
        "DPU_AGENT_MAX_SESSIONS",
        _integer(1, 4096),
        "sessions the agent serves at once",
    ),
    Setting(
        "dataplane",
        "max_sessions_per_connection",
        "max_sessions_per_connection",
        "DPU_AGENT_MAX_SESSIONS_PER_CONNECTION",
        _integer(1, 4096),
        "sessions one client connection may hold",
    ),
    Setting(
        "dataplane",
        "refusals_per_s",
        "refusals_per_s",
        "DPU_AGENT_REFUSALS_PER_S",
        _integer(100, 1_000_000, off=NO_LIMIT),
        "capsules a tenant may send a second that run no job (refused, failed at "
        "admission, a CANCEL of no open job); past it its data-plane links are not read "
        "until the allowance refills",
    ),
    Setting(
        "dataplane",
        "orphan_timeout",
        "orphan_timeout",
        "DPU_AGENT_ORPHAN_TIMEOUT",
        _seconds(0.5, 3600),
        "seconds a session lives after its last watcher left",
    ),
    Setting(
        "dataplane",
        "first_watch_timeout",
        "first_watch_timeout",
        "DPU_AGENT_FIRST_WATCH_TIMEOUT",
        _seconds(0.5, 3600),
        "seconds a new session lives without ever being watched",
    ),
    Setting(
        "dataplane",
        "failed_retention",
        "failed_retention",
        "DPU_AGENT_FAILED_RETENTION",
        _seconds(1, 3600),
        "seconds a FAILED session stays listed",
    ),
    Setting(
        "dataplane",
        "chunk_size",
        "chunk_size",
        "DPU_AGENT_CHUNK_SIZE",
        _integer(4096, 16 << 20),
        "bytes per RDMA op and large staging buffer",
    ),
    Setting(
        "dataplane",
        "staging_buffers",
        "staging_buffers",
        "DPU_AGENT_STAGING_BUFFERS",
        _integer(1, 64),
        "large staging buffers per session",
    ),
    Setting(
        "dataplane",
        "compute_workers",
        "compute_workers",
        "DPU_AGENT_COMPUTE_WORKERS",
        _integer(1, 64),
        "threads for compute job steps",
    ),
    Setting(
        "dataplane",
        "io_workers",
        "io_workers",
        "DPU_AGENT_IO_WORKERS",
        _integer(1, 256),
        "threads for blocking volume calls",
    ),
    Setting(
        "dataplane",
        "tcp_allow",
        "tcp_allow",
        "DPU_AGENT_TCP_ALLOW",
        _allow,
        "where the tcp data plane may dial: peer, networks, any",
    ),
    Setting(
        "dataplane",
        "verbs_allow",
        "verbs_allow",
        "DPU_AGENT_VERBS_ALLOW",
        _allow,
        "which host GIDs (::ffff:a.b.c.d) the verbs data plane may connect to: any (the"
        " default), peer (the caller's address), networks",
    ),
    Setting(
        "dataplane",
        "op_timeout",
        "op_timeout",
        "DPU_AGENT_OP_TIMEOUT",
        _seconds(1, 3600),
        "seconds a tcp host may leave a READ/WRITE unanswered",
    ),
    Setting(
        "dataplane",
        "inline_max",
        "inline_max",
        "DPU_AGENT_INLINE_MAX",
        _integer(1, MAX_INLINE, "none"),
        "the largest job source a SUBMIT may carry inline (0: none; verbs: each RECV buffer"
        " is then 80 + inline_max bytes)",
    ),
    Setting(
        "storage",
        "backend",
        "storage_backend",
        "DPU_AGENT_STORAGE_BACKEND",
        _choice("file", "memory"),
        "volume store: file or memory",
    ),
    Setting("storage", "dir", "storage_dir", "DPU_AGENT_STORAGE_DIR", _path, "volume directory"),
    Setting(
        "storage",
        "memory_capacity",
        "storage_memory_capacity",
        "DPU_AGENT_STORAGE_MEMORY_CAPACITY",
        _integer(MIN_MEMORY_CAPACITY, 1 << 50, off="half the memory available at start"),
        "memory backend: the most bytes of RAM its volumes hold (data, log, checkpoints); "
        "past it writes fail as on a full disk (RESOURCE_EXHAUSTED)",
    ),
    Setting(
        "network",
        "backend",
        "network_backend",
        "DPU_AGENT_NETWORK_BACKEND",
        _choice("none", "memory", "tc"),
        "flow datapath: tc, memory or none",
    ),
    Setting("network", "ports", "network_ports", "DPU_AGENT_NETWORK_PORTS", _text, "port patterns"),
    Setting(
        "network",
        "rules_file",
        "network_rules_file",
        "DPU_AGENT_NETWORK_RULES_FILE",
        _path,
        "where flow rules are saved",
    ),
    Setting("network", "netns", "network_netns", "DPU_AGENT_NETWORK_NETNS", _text, "ports' netns"),
    Setting(
        "network",
        "tenant_tags_file",
        "network_tenant_tags_file",
        "DPU_AGENT_NETWORK_TENANT_TAGS_FILE",
        _path,
        'VLAN ids and VNIs granted to each tenant\'s flow rules (TOML; "" = none)',
    ),
    *(
        Setting("virtualization", key, f"virt_{key}", f"DPU_AGENT_VIRT_{key.upper()}", parse, text)
        for key, parse, text in (
            (
                "backend",
                _choice("none", "memory", "linux", "bluefield"),
                "function backend: linux, bluefield, memory or none",
            ),
            ("state_file", _path, "where function records are saved"),
            ("host_netns_prefix", _text, "linux: netns name prefix of network functions"),
            ("block_export", _choice("nvmf-rdma", "nbd"), "linux: nvmf-rdma or nbd"),
            ("nvmf_address", _text, "linux: NVMe-oF target address (RDMA interface)"),
            ("nvmf_port", _integer(1, 65535), "linux: NVMe-oF target port"),
            ("nvmf_host_address", _text, "linux: the host side's address to connect from"),
        )
    ),
    *(
        Setting("mqtt", key, f"mqtt_{key}", f"DPU_AGENT_MQTT_{key.upper()}", parse, text)
        for key, parse, text in (
            ("enabled", _boolean, "publish events over MQTT (true/false)"),
            ("host", _text, "broker host"),
            ("port", _integer(1, 65535), "broker port"),
            ("client_id", _text, "MQTT client id"),
            ("username", _text, "broker user name"),
            ("password_file", _path, "file holding the broker password"),
            ("keepalive", _integer(5, 65535), "MQTT keepalive seconds"),
            ("backlog", _integer(1, 10_000_000), "events kept for the broker, shared by tenants"),
            ("telemetry_interval", _seconds(0.1, 3600, off="off"), "seconds between telemetry"),
            ("topic_prefix", _topic_prefix, "topic prefix"),
            ("flush_timeout", _seconds(0, 3600), "seconds to send the backlog at shutdown"),
        )
    ),
    Setting(
        "metrics",
        "listen",
        "metrics_listen",
        "DPU_AGENT_METRICS_LISTEN",
        _optional_listen,
        'Prometheus /metrics host:port ("" = off)',
    ),
    Setting("tls", "cert", "tls_cert", "DPU_AGENT_TLS_CERT", _path, "agent certificate (PEM)"),
    Setting("tls", "key", "tls_key", "DPU_AGENT_TLS_KEY", _path, "agent private key (PEM, 0600)"),
    Setting(
        "tls",
        "client_ca",
        "tls_client_ca",
        "DPU_AGENT_TLS_CLIENT_CA",
        _path,
        "CA of client certificates (mTLS)",
    ),
    Setting(
        "tls",
        "plaintext_loopback",
        "tls_plaintext_loopback",
        "DPU_AGENT_TLS_PLAINTEXT_LOOPBACK",
        _boolean,
        "serve loopback without TLS (true/false)",
    ),
    Setting(
        "auth",
        "tokens_file",
        "auth_tokens_file",
        "DPU_AGENT_AUTH_TOKENS_FILE",
        _path,
        "bearer tokens (plaintext loopback)",
    ),
    *(
        Setting("quota", key, f"quota_{key}", f"DPU_AGENT_QUOTA_{key.upper()}", parse, text)
        for key, parse, text in (
            ("max_volumes", _integer(1, 1 << 20, NO_LIMIT), "volumes per tenant"),
            ("max_volume_bytes", _integer(1, 1 << 62, NO_LIMIT), "volume bytes per tenant"),
            ("max_snapshots", _integer(1, 1 << 20, NO_LIMIT), "snapshots per tenant"),
            ("max_sessions", _integer(1, 4096, NO_LIMIT), "sessions per tenant"),
            ("max_queue_depth", _integer(1, 1 << 22, NO_LIMIT), "jobs in flight per tenant"),
            ("max_flow_rules", _integer(1, 1 << 20, NO_LIMIT), "flow rules per tenant"),
            ("max_functions", _integer(1, 1 << 20, NO_LIMIT), "functions per tenant"),
            (
                "max_block_functions",
                _integer(1, 1 << 20, NO_LIMIT),
                "block functions (each an NBD device) per tenant",
            ),
        )
    ),
)


def rules_file(config: AgentConfig) -> Path:
    """Where the flow rules are saved."""
    if config.network_rules_file:
        return Path(config.network_rules_file).expanduser()
    return storage_dir(config).parent / "flow-rules.json"


def functions_file(config: AgentConfig) -> Path:
    """Where the function records are saved."""
    if config.virt_state_file:
        return Path(config.virt_state_file).expanduser()
    return storage_dir(config).parent / "functions.json"


def storage_dir(config: AgentConfig) -> Path:
    """Where the file backend keeps volumes."""
    if config.storage_dir:
        return Path(config.storage_dir).expanduser()
    state = os.environ.get("STATE_DIRECTORY")  # set by systemd's StateDirectory=
    if state:
        return Path(state.split(":")[0]) / "volumes"
    return Path.home() / ".local" / "state" / "dpu-agent" / "volumes"


def _from_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        text = raw.decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        data = tomltext.loads(text)
    except tomltext.TomlError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    known = {(s.section, s.key): s for s in SETTINGS}
    values: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [{section}] must be a table")
        for key, value in table.items():
            setting = known.get((section, key))
            if setting is None:
                valid = ", ".join(sorted(f"{s.section}.{s.key}" for s in SETTINGS))
                raise ConfigError(f"{path}: unknown setting {section}.{key} (valid: {valid})")
            values[setting.attr] = setting.parse(value, f"{path}: {section}.{key}")
    return values


def load(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> AgentConfig:
    """Merge defaults, the TOML file, the environment and explicit overrides."""
    values: dict[str, Any] = _from_file(path) if path is not None else {}
    env = os.environ if environ is None else environ
    by_attr = {s.attr: s for s in SETTINGS}
    for setting in SETTINGS:
        if setting.env in env:
            values[setting.attr] = setting.parse(env[setting.env], f"${setting.env}")
    for attr, value in (overrides or {}).items():
        if value is not None:
            values[attr] = by_attr[attr].parse(value, f"--{attr.replace('_', '-')}")
    return AgentConfig(**values)
