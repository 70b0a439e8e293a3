"""The agent's Prometheus metrics: one registry the agent owns, served over HTTP.

Nothing else in the agent imports prometheus_client but `metrics_http`, the endpoint
that serves this registry (bounded connections and timeouts). Two kinds of facts:

- events, recorded by the layer where they happen through `AgentMetrics`'s methods
  (the session manager and the sessions hold an `AgentMetrics`, or None when the
  endpoint is off): a job finished, a session opened or closed, a data plane failed,
  a capsule was refused. Each adds to plain integers on the event loop's thread
  (no lock, no call into prometheus_client; about a quarter of the cost of
  prometheus_client's Counter and Histogram objects);
- state the agent already keeps (sessions and jobs in flight, the MQTT publisher's
  counters and backlog, the volume store's I/O counters, the flow table), read when
  Prometheus scrapes, so keeping it costs nothing between scrapes.

Metrics (all names start with ``dpu_agent_``; counters are Python integers, so
monotonic and never wrapped, exposed as Prometheus' float64; they restart from 0
with the agent):

    info{agent,version}                        1; who is answering
    jobs_total{kind,status}                    finished jobs: kind copy, crc32c,
                                               volume_write, ..., status the gRPC
                                               code name (OK, INVALID_ARGUMENT,
                                               CANCELLED, UNAVAILABLE, ...)
    job_duration_seconds{kind}                 histogram, submit to completion
    dataplane_bytes_total{direction,transport} bytes the agent READ from (read) and
                                               WROTE to (written) host memory
    job_bytes_total{kind,direction}            the same bytes by the kind of job that
                                               moved them
    jobs_in_flight                             gauge: admitted, not finished
    job_slots                                  gauge: queue slots of the open sessions
    sessions_open{transport}                   gauge: sessions the agent holds
    dataplane_links                            gauge: links the data-plane reactor
                                               drives (one per session whose data
                                               plane is up; more means a leak)
    reactor_passes_total                       passes of the reactor's loop: about one
                                               a second when idle, one per wake-up
                                               under load (a rate far above the job
                                               rate on an idle agent means it spins)
    dataplane_offload_waiting{pool}            gauge: job steps waiting for a worker
                                               thread, pool compute or io (a session
                                               has at most queue_depth storage calls
                                               in the io pool)
    dataplane_offload_waiting_peak{pool}       gauge: the most that ever waited at once
    sessions_opened_total{transport}
    sessions_closed_total{reason}              closed (CloseSession); orphaned: the
                                               host is gone (no host watched it for
                                               orphan_timeout, or the host closed its
                                               end of the data plane: its process
                                               died); failed (its data plane failed
                                               otherwise); shutdown (agent stop)
    dataplane_errors_total{transport}          sessions whose data plane failed, the
                                               host closing its end aside (queue pair
                                               in error, corrupt stream, socket errors)
    capsules_rejected_total                    capsules answered without making a job
                                               (undecodable, duplicate or reserved id)
    dataplane_tenant_pauses_total{tenant}      times a tenant's data-plane links were
                                               not read for a while: it sent more
                                               capsules that ran no job than
                                               [dataplane] refusals_per_s allows
    mqtt_events_queued_total                   completions accepted into the backlog
    mqtt_events_published_total                ... acknowledged by the broker
    mqtt_events_dropped_total                  ... lost: backlog full (the newest of
                                               a tenant over its share) or stopped
    mqtt_events_rejected_total                 ... that could not be encoded
    mqtt_backlog                               gauge: queued, not yet acknowledged
    mqtt_connected                             gauge: 1 while connected
    mqtt_reconnects_total, mqtt_connect_failures_total
    volume_ops_total{volume,op}                op read or write (the store's counters)
    volume_bytes_total{volume,op}
    volume_errors_total{volume}
    volume_throttled_total{volume}             reads and writes its QoS limits delayed
    volume_throttle_seconds_total{volume}      the delay they were given
    volume_qos_limit{volume,limit}             gauge: the limits set (read_iops, write_iops,
                                               read_bytes_per_second, write_bytes_per_second)
    volume_allocated_bytes{volume}             gauge: bytes the volume's own blocks hold
    snapshot_allocated_bytes{snapshot}         gauge: bytes a snapshot holds
    flow_rules{port}                           gauge: rules installed per ingress port

The MQTT families appear only with ``[mqtt] enabled``, the volume families with a
volume store, ``flow_rules`` with a network backend. The process collector adds the
standard ``process_*`` metrics (CPU, memory, file descriptors).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING, Final

import grpc
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from dpu_wire.capsule import JobKind
from dpu_wire.v1 import agent_pb2

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from prometheus_client.metrics_core import Metric

    from dpu_agent.dataplane.bus import Published
    from dpu_agent.dataplane.jobs import JobRecord
    from dpu_agent.dataplane.manager import SessionManager
    from dpu_agent.events.publisher import MqttEventPublisher
    from dpu_agent.network.table import FlowTable
    from dpu_agent.storage import VolumeStore

log = logging.getLogger(__name__)

PREFIX: Final = "dpu_agent"
CLOSE_REASONS: Final = ("closed", "orphaned", "failed", "shutdown")
# Seconds from submission to completion: a small job on loopback takes ~100 µs, the
# default deadline is 60 s.
LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_STATUS_NAMES: Final = {int(code.value[0]): code.name for code in grpc.StatusCode}
_TRANSPORTS: Final = {
    int(agent_pb2.TRANSPORT_VERBS): "verbs",
    int(agent_pb2.TRANSPORT_TCP): "tcp",
}


def transport_name(kind: int) -> str:
    """The label of a dpu.v1.Transport number: verbs, tcp."""
    return _TRANSPORTS.get(kind, str(kind))


def status_name(code: int) -> str:
    """The label of a gRPC status code number: OK, INVALID_ARGUMENT, ..."""
    return _STATUS_NAMES.get(code, str(code))


class AgentMetrics(Collector):
    """The agent's metrics in their own registry (`registry`), not the global default.

    The recording methods run on the event loop's or the data-plane reactor's thread
    and only add to plain integers (no lock, no call into prometheus_client: a
    finished job costs a few dictionary updates and a bisect). Prometheus reads them
    from the HTTP server's thread through `collect`, which copies each table first (a
    dict or list copy is atomic under the GIL). Python integers never wrap.
    """

    def __init__(self, agent_id: str, version: str) -> None:
        self._identity = (agent_id, version)
        self._jobs: dict[tuple[int, int], int] = {(kind, 0): 0 for kind in JobKind}
        self._buckets = {kind: [0] * (len(LATENCY_BUCKETS) + 1) for kind in JobKind}
        self._seconds = dict.fromkeys(JobKind, 0.0)
        self._read = dict.fromkeys(_TRANSPORTS, 0)
        self._written = dict.fromkeys(_TRANSPORTS, 0)
        self._kind_read = dict.fromkeys(JobKind, 0)
        self._kind_written = dict.fromkeys(JobKind, 0)
        self._opened = dict.fromkeys(_TRANSPORTS, 0)
        self._errors = dict.fromkeys(_TRANSPORTS, 0)
        self._closed = dict.fromkeys(CLOSE_REASONS, 0)
        self._rejected = 0
        self._state = _StateCollector()
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.registry.register(self._state)
        ProcessCollector(registry=self.registry)

    # ------------------------------------------------------------------ events
    def on_completions(self, session: Published, jobs: Sequence[JobRecord]) -> None:
        """Completion-bus subscriber: count a batch of finished jobs (reactor thread)."""
        transport = session.transport_kind
        read = written = 0
        table, buckets, seconds_by_kind = self._jobs, self._buckets, self._seconds
        kind_read, kind_written = self._kind_read, self._kind_written
        for job in jobs:
            kind = job.kind
            key = (kind, job.status)
            table[key] = table.get(key, 0) + 1
            seconds = max(0, job.end_ns - job.submit_ns) / 1e9
            buckets[kind][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            seconds_by_kind[kind] += seconds
            if job.bytes_read or job.bytes_written:
                read += job.bytes_read
                written += job.bytes_written
                kind_read[kind] += job.bytes_read
                kind_written[kind] += job.bytes_written
        if read or written:
            self._read[transport] = self._read.get(transport, 0) + read
            self._written[transport] = self._written.get(transport, 0) + written

    def session_opened(self, transport: int) -> None:
        """Count a session whose data plane connected."""
        self._opened[transport] = self._opened.get(transport, 0) + 1

    def session_closed(self, reason: str) -> None:
        """Count a session the agent closed and forgot; `reason` is one of CLOSE_REASONS."""
        self._closed[reason] = self._closed.get(reason, 0) + 1

    def dataplane_failed(self, transport: int) -> None:
        """Count a session whose data plane failed."""
        self._errors[transport] = self._errors.get(transport, 0) + 1

    def capsule_rejected(self) -> None:
        """Count a capsule answered without making a job."""
        self._rejected += 1

    # ------------------------------------------------------------------ state
    def observe(
        self,
        *,
        sessions: SessionManager | None = None,
        events: MqttEventPublisher | None = None,
        store: VolumeStore | None = None,
        flows: FlowTable | None = None,
    ) -> None:
        """Read these parts of the agent at every scrape (None: leave their metrics out)."""
        self._state.sessions = sessions
        self._state.events = events
        self._state.store = store
        self._state.flows = flows

    # ------------------------------------------------------------------ the scrape
    def describe(self) -> Iterable[Metric]:
        """The families `collect` yields, for the registry's duplicate check."""
        return self.collect()

    def collect(self) -> Iterable[Metric]:
        """The counters above as metric families (runs on the HTTP server's thread)."""
        info = GaugeMetricFamily(
            f"{PREFIX}_info", "The agent answering", labels=["agent", "version"]
        )
        info.add_metric(list(self._identity), 1)
        jobs = CounterMetricFamily(
            f"{PREFIX}_jobs", "Finished jobs by kind and gRPC status", labels=["kind", "status"]
        )
        for (kind, code), count in sorted(dict(self._jobs).items()):
            jobs.add_metric([JobKind(kind).name.lower(), status_name(code)], count)
        duration = HistogramMetricFamily(
            f"{PREFIX}_job_duration_seconds",
            "Seconds from a job's submission to its completion",
            labels=["kind"],
        )
        for kind in JobKind:
            cumulative = list(itertools.accumulate(list(self._buckets[kind])))
            bounds = [*map(floatToGoString, LATENCY_BUCKETS), "+Inf"]
            duration.add_metric(
                [kind.name.lower()], list(zip(bounds, cumulative, strict=True)), self._seconds[kind]
            )
        moved = CounterMetricFamily(
            f"{PREFIX}_dataplane_bytes",
            "Bytes the agent read from (read) and wrote to (written) host memory",
            labels=["direction", "transport"],
        )
        for direction, table in (("read", self._read), ("written", self._written)):
            for transport, count in sorted(dict(table).items()):
                moved.add_metric([direction, transport_name(transport)], count)
        by_kind = CounterMetricFamily(
            f"{PREFIX}_job_bytes",
            "Bytes the agent read from and wrote to host memory, by the kind of job",
            labels=["kind", "direction"],
        )
        for direction, by in (("read", self._kind_read), ("written", self._kind_written)):
            for kind, count in dict(by).items():
                by_kind.add_metric([JobKind(kind).name.lower(), direction], count)
        opened = _by_transport(f"{PREFIX}_sessions_opened", "Sessions opened", self._opened)
        closed = CounterMetricFamily(
            f"{PREFIX}_sessions_closed",
            "Sessions closed: closed (CloseSession), orphaned (the host is gone), "
            "failed (its data plane failed), shutdown",
            labels=["reason"],
        )
        for reason, count in dict(self._closed).items():
            closed.add_metric([reason], count)
        errors = _by_transport(
            f"{PREFIX}_dataplane_errors",
            "Sessions whose data plane failed, the host closing its end aside",
            self._errors,
        )
        rejected = CounterMetricFamily(
            f"{PREFIX}_capsules_rejected",
            "Capsules answered without making a job (undecodable, duplicate or reserved id)",
            self._rejected,
        )
        return [info, jobs, duration, moved, by_kind, opened, closed, errors, rejected]


def _by_transport(name: str, text: str, table: dict[int, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=["transport"])
    for transport, count in sorted(dict(table).items()):
        family.add_metric([transport_name(transport)], count)
    return family


class _StateCollector(Collector):
    """Gauges and counters read from the agent's own state when Prometheus scrapes.

    It runs on the HTTP server's thread: it only reads attributes, takes snapshots
    (`list(...)`) and calls the thread-safe `stats()`, `list()` and `rules()`.
    A part that fails is left out of that scrape and logged.
    """

    def __init__(self) -> None:
        self.sessions: SessionManager | None = None
        self.events: MqttEventPublisher | None = None
        self.store: VolumeStore | None = None
        self.flows: FlowTable | None = None

    def describe(self) -> Iterable[Metric]:
        """Nothing: the registry must not call `collect` before the parts are set."""
        return []

    def collect(self) -> Iterable[Metric]:
        """Every family of the parts that are set."""
        parts = (
            (self.sessions, self._sessions),
            (self.events, self._events),
            (self.store, self._volumes),
            (self.flows, self._flows),
        )
        families: list[Metric] = []
        for part, read in parts:
            if part is None:
                continue
            try:
                families.extend(read())
            except Exception:
                log.exception("cannot read metrics from %s", type(part).__name__)
        return families

    def _sessions(self) -> list[Metric]:
        assert self.sessions is not None  # noqa: S101 - checked by collect()
        manager = self.sessions
        open_by = dict.fromkeys(map(transport_name, manager.available_transports), 0)
        in_flight = slots = 0
        for session in manager.sessions():
            name = transport_name(session.transport_kind)
            open_by[name] = open_by.get(name, 0) + 1
            in_flight += session.open_jobs
            slots += session.queue_depth
        sessions = GaugeMetricFamily(
            f"{PREFIX}_sessions_open", "Sessions the agent holds", labels=["transport"]
        )
        for name, count in sorted(open_by.items()):
            sessions.add_metric([name], count)
        links, passes = manager.reactor_load()
        waiting = GaugeMetricFamily(
            f"{PREFIX}_dataplane_offload_waiting",
            "Job steps waiting for a worker thread",
            labels=["pool"],
        )
        peak = GaugeMetricFamily(
            f"{PREFIX}_dataplane_offload_waiting_peak",
            "The most job steps that ever waited for a worker thread at once",
            labels=["pool"],
        )
        for pool, (now, most) in sorted(manager.offload_load().items()):
            waiting.add_metric([pool], now)
            peak.add_metric([pool], most)
        pauses = CounterMetricFamily(
            f"{PREFIX}_dataplane_tenant_pauses",
            "Times a tenant's data-plane links were not read: it spent its allowance of "
            "capsules that run no job",
            labels=["tenant"],
        )
        for tenant, count in sorted(manager.tenant_pauses().items()):
            pauses.add_metric([tenant], count)
        return [
            waiting,
            peak,
            pauses,
            sessions,
            GaugeMetricFamily(
                f"{PREFIX}_jobs_in_flight", "Jobs admitted and not finished", value=in_flight
            ),
            GaugeMetricFamily(f"{PREFIX}_job_slots", "Queue slots of the open sessions", slots),
            GaugeMetricFamily(
                f"{PREFIX}_dataplane_links", "Data-plane links the reactor drives", value=links
            ),
            CounterMetricFamily(
                f"{PREFIX}_reactor_passes", "Passes of the data-plane reactor's loop", passes
            ),
        ]

    def _events(self) -> list[Metric]:
        assert self.events is not None  # noqa: S101 - checked by collect()
        stats = self.events.stats()
        counters = (
            ("events_queued", "queued", "Completions accepted into the MQTT backlog"),
            ("events_published", "published", "Completions the broker acknowledged"),
            ("events_dropped", "dropped", "Completions lost: over a tenant's share, or stopped"),
            ("events_rejected", "rejected", "Completions that could not be encoded"),
            ("reconnects", "reconnects", "Broker connections after the first"),
            ("connect_failures", "connect_failures", "Failed broker connection attempts"),
        )
        families: list[Metric] = [
            CounterMetricFamily(f"{PREFIX}_mqtt_{name}", text, value=stats[key])
            for name, key, text in counters
        ]
        families.append(
            GaugeMetricFamily(
                f"{PREFIX}_mqtt_backlog", "Events queued, not yet acknowledged", stats["unsent"]
            )
        )
        families.append(
            GaugeMetricFamily(
                f"{PREFIX}_mqtt_connected", "1 while connected to the broker", stats["connected"]
            )
        )
        return families

    def _volumes(self) -> list[Metric]:
        assert self.store is not None  # noqa: S101 - checked by collect()
        ops = CounterMetricFamily(
            f"{PREFIX}_volume_ops", "Volume reads and writes", labels=["volume", "op"]
        )
        moved = CounterMetricFamily(
            f"{PREFIX}_volume_bytes",
            "Bytes read from and written to volumes",
            labels=["volume", "op"],
        )
        errors = CounterMetricFamily(
            f"{PREFIX}_volume_errors", "Failed volume calls", labels=["volume"]
        )
        throttled = CounterMetricFamily(
            f"{PREFIX}_volume_throttled", "Volume I/O delayed by QoS limits", labels=["volume"]
        )
        delay = CounterMetricFamily(
            f"{PREFIX}_volume_throttle_seconds",
            "Delay QoS limits gave volume I/O",
            labels=["volume"],
        )
        limits = GaugeMetricFamily(
            f"{PREFIX}_volume_qos_limit", "QoS limits set on volumes", labels=["volume", "limit"]
        )
        allocated = GaugeMetricFamily(
            f"{PREFIX}_volume_allocated_bytes",
            "Bytes a volume's own blocks hold",
            labels=["volume"],
        )
        for volume in self.store.list():
            stats = self.store.stats(volume.volume_id)
            name = volume.volume_id
            ops.add_metric([name, "read"], stats.read_ops)
            ops.add_metric([name, "write"], stats.write_ops)
            moved.add_metric([name, "read"], stats.read_bytes)
            moved.add_metric([name, "write"], stats.write_bytes)
            errors.add_metric([name], stats.errors)
            throttled.add_metric([name], stats.throttled_ops)
            delay.add_metric([name], stats.throttle_delay_us / 1_000_000)
            allocated.add_metric([name], stats.allocated_bytes)
            for limit, value in dataclasses.asdict(volume.qos).items():
                if value:
                    limits.add_metric([name, limit], value)
        held = GaugeMetricFamily(
            f"{PREFIX}_snapshot_allocated_bytes", "Bytes a snapshot holds", labels=["snapshot"]
        )
        for snapshot in self.store.list_snapshots():
            held.add_metric([snapshot.snapshot_id], snapshot.allocated_bytes)
        return [ops, moved, errors, throttled, delay, limits, allocated, held]

    def _flows(self) -> list[Metric]:
        assert self.flows is not None  # noqa: S101 - checked by collect()
        per_port: dict[str, int] = {}
        for rule in self.flows.rules():
            per_port[rule.ingress_port] = per_port.get(rule.ingress_port, 0) + 1
        family = GaugeMetricFamily(
            f"{PREFIX}_flow_rules", "Flow rules installed per ingress port", labels=["port"]
        )
        for port, count in sorted(per_port.items()):
            family.add_metric([port], count)
        return [family]
