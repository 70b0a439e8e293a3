"""The agent's metrics: what each hook counts, the state read at scrape time, the endpoint.

Sessions here are real: a SessionManager on a data-plane reactor over the tcp
transport on loopback, with a TcpHostLink as the host. The endpoint is scraped over
HTTP on loopback.
"""

import asyncio
import contextlib
import functools
import socket
import types
import urllib.request

import crc32c
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from dpu_agent import config, metrics, metrics_http, request_context
from dpu_agent.dataplane import transports
from dpu_agent.dataplane.admission import JobRequest
from dpu_agent.dataplane.bus import CompletionBus
from dpu_agent.dataplane.hostpolicy import parse_allow
from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_agent.dataplane.manager import TRANSPORT_TCP, ManagerSettings, SessionManager
from dpu_agent.dataplane.reactor import Reactor
from dpu_agent.dataplane.regions import AdvertisedRegion
from dpu_agent.events import MqttEventPublisher, MqttSettings
from dpu_agent.network import model
from dpu_agent.network.memory_backend import MemoryFlowBackend
from dpu_agent.network.rulestore import RuleStore
from dpu_agent.network.table import FlowTable
from dpu_agent.storage import open_store
from dpu_agent.storage.types import DataServices
from dpu_wire.capsule import JobKind, Span, State
from dpu_wire.transport.base import Access
from dpu_wire.transport.tcp import TcpHostLink

T0 = 1_700_000_000_000_000_000


def value(m: metrics.AgentMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def finished(kind=JobKind.COPY, state=State.SUCCEEDED, code=0, nbytes=4096, took_ns=3_000_000):
    job = JobRecord(1, kind, Span(), Span(), Origin.CAPSULE, 0.0, submit_ns=T0)
    job.bytes_read = nbytes
    job.bytes_written = nbytes if kind == JobKind.COPY else 0
    assert job.finish(state, code)
    job.end_ns = T0 + took_ns
    return job


def over(transport: int) -> types.SimpleNamespace:
    """What the metrics read of a batch's session."""
    return types.SimpleNamespace(transport_kind=transport)


def test_finished_jobs_are_counted_by_kind_status_latency_and_bytes():
    m = metrics.AgentMetrics("dpu-0", "1.2.3")
    m.on_completions(over(TRANSPORT_TCP), [finished(), finished()])
    m.on_completions(over(TRANSPORT_TCP), [finished(JobKind.CRC32C, nbytes=100)])
    m.on_completions(over(TRANSPORT_TCP), [finished(JobKind.CRC32C, State.FAILED, 3, nbytes=0)])
    m.on_completions(over(1), [finished(JobKind.SHA256, State.CANCELLED, 1, nbytes=0)])
    assert value(m, "dpu_agent_info", agent="dpu-0", version="1.2.3") == 1
    jobs = "dpu_agent_jobs_total"
    assert value(m, jobs, kind="copy", status="OK") == 2
    assert value(m, jobs, kind="crc32c", status="OK") == 1
    assert value(m, jobs, kind="crc32c", status="INVALID_ARGUMENT") == 1
    assert value(m, jobs, kind="sha256", status="CANCELLED") == 1
    assert value(m, jobs, kind="volume_write", status="OK") == 0  # every kind starts at 0
    duration = "dpu_agent_job_duration_seconds"
    assert value(m, f"{duration}_count", kind="copy") == 2
    assert value(m, f"{duration}_sum", kind="copy") == pytest.approx(0.006)
    assert value(m, f"{duration}_bucket", kind="copy", le="0.0025") == 0
    assert value(m, f"{duration}_bucket", kind="copy", le="0.005") == 2
    moved = "dpu_agent_dataplane_bytes_total"
    assert value(m, moved, direction="read", transport="tcp") == 2 * 4096 + 100
    assert value(m, moved, direction="written", transport="tcp") == 2 * 4096
    assert value(m, moved, direction="read", transport="verbs") == 0
    by_kind = "dpu_agent_job_bytes_total"
    read_by_kind = [value(m, by_kind, kind=k, direction="read") for k in ("copy", "crc32c")]
    assert read_by_kind == [2 * 4096, 100]
    assert value(m, by_kind, kind="copy", direction="written") == 2 * 4096
    assert value(m, by_kind, kind="volume_write", direction="read") == 0


def test_counters_do_not_wrap_at_64_bits():
    m = metrics.AgentMetrics("a", "v")
    for _ in range(2):
        m.on_completions(over(TRANSPORT_TCP), [finished(nbytes=1 << 63)])
    moved = value(m, "dpu_agent_dataplane_bytes_total", direction="read", transport="tcp")
    assert moved == float(1 << 64)


def test_the_registry_is_the_agents_own():
    first, second = metrics.AgentMetrics("a", "v"), metrics.AgentMetrics("b", "v")
    first.capsule_rejected()
    assert value(first, "dpu_agent_capsules_rejected_total") == 1
    assert value(second, "dpu_agent_capsules_rejected_total") == 0
    assert REGISTRY.get_sample_value("dpu_agent_capsules_rejected_total") is None


@pytest.mark.parametrize(
    ("code", "name"), [(0, "OK"), (1, "CANCELLED"), (14, "UNAVAILABLE"), (99, "99")]
)
def test_status_names(code, name):
    assert metrics.status_name(code) == name


# ---------------------------------------------------------------- sessions, for real


@pytest_asyncio.fixture
async def manager():
    m = metrics.AgentMetrics("a", "v")
    reactor = Reactor()
    reactor.start()
    bus = CompletionBus()
    bus.subscribe(m.on_completions)
    tcp = functools.partial(transports._tcp, parse_allow("peer"), 30.0, 4096)
    manager = SessionManager(
        ManagerSettings(orphan_timeout=0.2, failed_retention=1.0, chunk_size=65536),
        {TRANSPORT_TCP: tcp},
        reactor=reactor,
        bus=bus,
        events=m,
    )
    m.observe(sessions=manager)
    manager.start()
    yield manager, m
    await manager.stop()
    await asyncio.to_thread(reactor.stop)


async def open_session(manager, depth=4):
    host = TcpHostLink()
    host.listen()
    request_context.request_id.set("open-rid-1")
    session = await manager.open(
        tenant="default",
        transport=0,
        queue_depth=depth,
        label="",
        host=host.address,
        peer="ipv4:127.0.0.1:1",
    )
    await host.connect(session.address)
    host.start(lambda _capsule: None, lambda _error: None, lambda: False)
    return session, host


async def wait_until(predicate):
    async with asyncio.timeout(10):
        while not predicate():  # noqa: ASYNC110 - polling the agent's own state
            await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_sessions_and_jobs_move_the_gauges_and_counters(manager):
    manager, m = manager
    assert value(m, "dpu_agent_sessions_open", transport="tcp") == 0
    session, host = await open_session(manager, depth=4)
    watcher = session.watch(include_retained=False)  # a host that watches: not orphaned
    assert session.open_request_id == "open-rid-1"
    assert value(m, "dpu_agent_sessions_open", transport="tcp") == 1
    assert value(m, "dpu_agent_sessions_opened_total", transport="tcp") == 1
    assert value(m, "dpu_agent_job_slots") == 4
    assert value(m, "dpu_agent_jobs_in_flight") == 0
    await wait_until(lambda: value(m, "dpu_agent_dataplane_links") == 1)  # once connected
    passes = value(m, "dpu_agent_reactor_passes_total") or 0.0
    assert passes > 0
    for pool in ("compute", "io"):
        assert value(m, "dpu_agent_dataplane_offload_waiting", pool=pool) == 0
        assert value(m, "dpu_agent_dataplane_offload_waiting_peak", pool=pool) == 0

    region = host.register(10_000, Access.REMOTE_READ)
    region.view[:] = bytes(range(100)) * 100
    session.regions.add(AdvertisedRegion("r1", region.addr, 10_000, region.rkey, region.access))
    request_context.request_id.set("submit-rid-2")
    request = JobRequest(
        session.next_job_id(), JobKind.CRC32C, Span(region.addr, 10_000, region.rkey), Span(), 0
    )
    job = await session.submit(request)
    assert job.rpc_request_id == "submit-rid-2"
    finished_job = await watcher.queue.get()
    assert finished_job is job
    assert job.result == crc32c.crc32c(bytes(region.view))
    assert value(m, "dpu_agent_jobs_total", kind="crc32c", status="OK") == 1
    read = value(m, "dpu_agent_dataplane_bytes_total", direction="read", transport="tcp")
    assert read == 10_000
    assert value(m, "dpu_agent_job_duration_seconds_count", kind="crc32c") == 1
    assert (value(m, "dpu_agent_reactor_passes_total") or 0.0) > passes

    await manager.close(session.name)
    session.unwatch(watcher)
    assert value(m, "dpu_agent_sessions_open", transport="tcp") == 0
    assert value(m, "dpu_agent_dataplane_links") == 0
    assert value(m, "dpu_agent_sessions_closed_total", reason="closed") == 1
    await host.close()


@pytest.mark.asyncio
async def test_a_session_nobody_watches_is_closed_as_orphaned(manager):
    manager, m = manager
    _, host = await open_session(manager)
    await wait_until(lambda: not manager.sessions())
    assert value(m, "dpu_agent_sessions_closed_total", reason="orphaned") == 1
    assert value(m, "dpu_agent_sessions_closed_total", reason="failed") == 0
    assert value(m, "dpu_agent_dataplane_errors_total", transport="tcp") == 0
    assert value(m, "dpu_agent_sessions_open", transport="tcp") == 0
    await host.close()


@pytest.mark.asyncio
async def test_a_broken_data_plane_is_counted_and_its_session_closed_as_failed(manager):
    manager, m = manager
    session, host = await open_session(manager)
    watcher = session.watch(include_retained=False)
    host._stream.sock.send(bytes([0xFF]) * 24)  # a frame of no known type: the link is broken
    assert await watcher.queue.get() is None  # the session failed: its watchers end
    assert not session.host_gone
    session.unwatch(watcher)
    await wait_until(lambda: not manager.sessions())
    assert value(m, "dpu_agent_dataplane_errors_total", transport="tcp") == 1
    assert value(m, "dpu_agent_sessions_closed_total", reason="failed") == 1
    assert value(m, "dpu_agent_sessions_closed_total", reason="orphaned") == 0
    assert value(m, "dpu_agent_dataplane_links") == 0  # its socket closed as it failed
    await host.close()


@pytest.mark.asyncio
async def test_a_host_that_closes_its_end_is_gone_and_its_session_orphaned(manager):
    manager, m = manager
    session, host = await open_session(manager)
    watcher = session.watch(include_retained=False)
    await host.close()  # what the kernel does when the host's process dies
    assert await watcher.queue.get() is None
    assert session.host_gone
    session.unwatch(watcher)
    await wait_until(lambda: not manager.sessions())
    assert value(m, "dpu_agent_dataplane_errors_total", transport="tcp") == 0  # not an error
    assert value(m, "dpu_agent_sessions_closed_total", reason="orphaned") == 1
    assert value(m, "dpu_agent_sessions_closed_total", reason="failed") == 0
    assert value(m, "dpu_agent_dataplane_links") == 0


@pytest.mark.asyncio
async def test_shutdown_closes_count_as_shutdown(manager):
    manager, m = manager
    session, host = await open_session(manager)
    session.watch(include_retained=False)
    await manager.stop()
    assert value(m, "dpu_agent_sessions_closed_total", reason="shutdown") == 1
    await host.close()


# ---------------------------------------------------------------- the other parts


@pytest.mark.asyncio
async def test_the_mqtt_publishers_counters_are_read_at_scrape():
    m = metrics.AgentMetrics("a", "v")
    assert value(m, "dpu_agent_mqtt_events_queued_total") is None  # no MQTT: no family
    publisher = MqttEventPublisher(MqttSettings(port=1, backlog=2), "a")  # never started
    m.observe(events=publisher)
    session = type("S", (), {"tenant": "t", "session_id": "s-1"})()
    for _ in range(3):
        publisher.publish_completion(session, finished())
    assert value(m, "dpu_agent_mqtt_events_queued_total") == 2
    assert value(m, "dpu_agent_mqtt_events_dropped_total") == 1
    assert value(m, "dpu_agent_mqtt_events_published_total") == 0
    assert value(m, "dpu_agent_mqtt_backlog") == 2
    assert value(m, "dpu_agent_mqtt_connected") == 0


def test_volume_io_is_read_from_the_store():
    m = metrics.AgentMetrics("a", "v")
    with open_store("memory") as store:
        m.observe(store=store)
        store.create("vol-a", 1 << 20, 4096, DataServices())
        store.write("vol-a", 0, bytes(8192))
        store.write("vol-a", 8192, bytes(4096))
        store.read("vol-a", 0, 4096)
        with contextlib.suppress(Exception):
            store.read("vol-a", 1 << 20, 4096)  # past the end: an error
        assert value(m, "dpu_agent_volume_ops_total", volume="vol-a", op="write") == 2
        assert value(m, "dpu_agent_volume_ops_total", volume="vol-a", op="read") == 1
        assert value(m, "dpu_agent_volume_bytes_total", volume="vol-a", op="write") == 12288
        assert value(m, "dpu_agent_volume_bytes_total", volume="vol-a", op="read") == 4096
        assert value(m, "dpu_agent_volume_errors_total", volume="vol-a") == 1


def test_flow_rules_are_counted_per_port(tmp_path):
    m = metrics.AgentMetrics("a", "v")
    table = FlowTable(MemoryFlowBackend(), RuleStore(tmp_path / "rules.json"))
    table.start()
    m.observe(flows=table)
    for rid, port, priority in (("r1", "pf0vf0", 1), ("r2", "pf0vf0", 2), ("r3", "p0", 1)):
        table.create(
            model.FlowRule(rid, priority, port, model.FlowMatch(), (model.Forward("pf0vf1"),))
        )
    assert value(m, "dpu_agent_flow_rules", port="pf0vf0") == 2
    assert value(m, "dpu_agent_flow_rules", port="p0") == 1
    table.delete("r3")
    assert value(m, "dpu_agent_flow_rules", port="p0") is None


class BrokenStore:
    def list(self):
        raise OSError("disk gone")


def test_a_part_that_fails_is_left_out_and_logged(caplog):
    m = metrics.AgentMetrics("a", "v")
    m.observe(store=BrokenStore())  # type: ignore[arg-type]
    m.capsule_rejected()
    assert value(m, "dpu_agent_capsules_rejected_total") == 1  # the rest still scrapes
    assert value(m, "dpu_agent_volume_ops_total", volume="x", op="read") is None
    assert "cannot read metrics from BrokenStore" in caplog.text


# ---------------------------------------------------------------- the endpoint


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - loopback http
        assert reply.status == 200
        text = reply.read().decode()
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.asyncio
async def test_the_endpoint_serves_the_registry_over_http():
    m = metrics.AgentMetrics("dpu-7", "0.1.0")
    m.on_completions(over(TRANSPORT_TCP), [finished()])
    server = metrics_http.MetricsServer(m.registry)
    address = server.start("127.0.0.1:0")
    try:
        assert address.startswith("127.0.0.1:")
        assert server.url == f"http://{address}/metrics"
        samples = await asyncio.to_thread(scrape, server.url)
        assert samples["dpu_agent_info[('agent', 'dpu-7'), ('version', '0.1.0')]"] == 1
        assert samples["dpu_agent_jobs_total[('kind', 'copy'), ('status', 'OK')]"] == 1
        assert "process_cpu_seconds_total[]" in samples
    finally:
        server.stop()
    server.stop()  # a second stop is harmless
    with (
        pytest.raises(ConnectionRefusedError),
        socket.create_connection(("127.0.0.1", int(address.rpartition(":")[2])), 2),
    ):
        pass


def test_a_busy_address_raises():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match="Address already in use"):
            metrics_http.MetricsServer(metrics.AgentMetrics("a", "v").registry).start(
                f"127.0.0.1:{port}"
            )


def test_ipv6_urls_have_brackets():
    assert metrics_http.split_listen("[::1]:9464") == ("::1", 9464)
    server = metrics_http.MetricsServer(metrics.AgentMetrics("a", "v").registry)
    server.address = "[::1]:9464"
    assert server.url == "http://[::1]:9464/metrics"


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, "127.0.0.1:9464"),
        ({"DPU_AGENT_METRICS_LISTEN": ""}, ""),
        ({"DPU_AGENT_METRICS_LISTEN": "[::1]:0"}, "[::1]:0"),
    ],
)
def test_metrics_listen_setting(environ, expected):
    assert config.load(environ=environ).metrics_listen == expected


def test_a_bad_metrics_listen_is_a_config_error(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('[metrics]\nlisten = "9464"\n')
    with pytest.raises(config.ConfigError, match=r"metrics\.listen: '9464' is not host:port"):
        config.load(path, environ={})


def http(address: str, request: bytes) -> bytes:
    host, port = metrics_http.split_listen(address)
    with socket.create_connection((host, port), 5) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"200"),
        (b"GET /?name=x HTTP/1.0\r\n\r\n", b"200"),
        (b"HEAD /metrics HTTP/1.1\r\n\r\n", b"200"),
        (b"GET /nope HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
        (b"garbage\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b""),  # too long: closed
    ],
)
def test_the_endpoint_answers_each_request_once_and_closes(request_bytes, status):
    server = metrics_http.MetricsServer(metrics.AgentMetrics("a", "v").registry)
    address = server.start("127.0.0.1:0")
    try:
        reply = http(address, request_bytes)
    finally:
        server.stop()
    assert reply.startswith(b"HTTP/1.1 " + status) if status else reply == b""
    if request_bytes.startswith(b"HEAD"):
        assert reply.endswith(b"\r\n\r\n")
    elif status == b"200":
        assert b"dpu_agent_info{" in reply


def test_connections_are_bounded_and_a_scraper_crowds_out_half_sent_ones():
    server = metrics_http.MetricsServer(
        metrics.AgentMetrics("a", "v").registry, max_connections=4, read_timeout=30
    )
    address = server.start("127.0.0.1:0")
    host, port = metrics_http.split_listen(address)
    held = [socket.create_connection((host, port), 5) for _ in range(10)]
    try:
        for sock in held:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request
        assert b"dpu_agent_info{" in http(address, b"GET /metrics HTTP/1.0\r\n\r\n")
        closed = 0
        for sock in held:
            sock.settimeout(0.5)
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        assert closed >= len(held) - 4 + 1  # at most 4 were open; the scrape took one more
    finally:
        for sock in held:
            sock.close()
        server.stop()
