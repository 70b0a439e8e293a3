"""What the fuzzer aims at: real objects on the agent, and safe places for it to dial.

`World` keeps a few real objects alive on the agent under test (sessions with host
regions, finished jobs and a key, volumes with each data service, flow rules) and
hands their names to the request strategies, so many fuzzed requests name objects
that exist and get past validation into service logic. Fuzzed requests close,
delete and withdraw these objects too: `World.restore` puts them back.

Safety: the agent dials the TCP endpoint an OpenSession names. The fuzzer must not
make it reach beyond loopback (no DNS lookups either) or into another process's
listener, so `safe_tcp_endpoints` only offers our own sink, a port we hold closed,
the agent's own port, ports the agent refuses before dialling, and host names that
fail to encode before any lookup.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
from typing import TYPE_CHECKING, Any, Final, TypeVar

from hypothesis import strategies as st

import host_client
from dpu_wire.v1 import job_pb2, network_pb2, session_pb2, storage_pb2, virtualization_pb2
from tests.fuzz.proto_strategies import texts, weighted

if TYPE_CHECKING:
    from collections.abc import Coroutine, Sequence

    from google.protobuf import descriptor as pbd

_T = TypeVar("_T")

BUFFER_BYTES: Final = 64 * 1024
VOLUME_BYTES: Final = 1 << 20
VOLUMES: Final[tuple[tuple[str, dict[str, Any]], ...]] = (
    ("fz-vol-0", {}),
    ("fz-vol-1", {"crc32c": True, "compression": "lz4", "block_size": 512}),
    ("fz-vol-2", {"crc32c": True, "compression": "zstd"}),
    ("fz-vol-3", {"encryption": "aes-xts-256"}),
)
SNAPSHOTS: Final = (("fz-snap-0", "fz-vol-0"), ("fz-snap-1", "fz-vol-3"))  # (id, volume)
RULES: Final = (
    (
        "fz-rule-0",
        network_pb2.FlowRule(
            priority=10,
            ingress_port="ports/p0",
            actions=[
                network_pb2.FlowAction(count=network_pb2.CountAction()),
                network_pb2.FlowAction(forward=network_pb2.ForwardAction(port="ports/pf0vf0")),
            ],
        ),
    ),
    (
        "fz-rule-1",
        network_pb2.FlowRule(
            priority=20,
            ingress_port="ports/pf0vf0",
            match=network_pb2.FlowMatch(ethertype=0x0800, ip_protocol=6, dst_l4_port=80),
            actions=[network_pb2.FlowAction(drop=network_pb2.DropAction())],
        ),
    ),
)
FUNCTIONS: Final = (
    (
        "fz-fn-0",
        virtualization_pb2.Function(
            type=virtualization_pb2.FUNCTION_TYPE_VF, mac_address="02:00:00:00:0f:01"
        ),
    ),
    (
        "fz-fn-1",
        virtualization_pb2.Function(
            type=virtualization_pb2.FUNCTION_TYPE_VIRTIO_BLK, volume="volumes/fz-vol-0"
        ),
    ),
)
NEW_IDS: Final = ("fz-new-0", "fz-new-1", "fz-new-2", "fz-0")
REQUEST_IDS: Final = ("fz-request-0", "fz-request-1")
# Nouns in message names, most specific first, and the collection each names.
_NOUNS: Final = (
    ("FlowRule", "rules"),
    ("Function", "functions"),
    ("Region", "regions"),
    ("Job", "jobs"),
    ("Session", "sessions"),
    ("Snapshot", "snapshots"),
    ("Volume", "volumes"),
    ("Port", "ports"),
)
_FIELD_POOLS: Final = {
    "session": "sessions",
    "volume": "volumes",
    "source_volume": "volumes",
    "source_snapshot": "snapshots",
    "region": "regions",
    "port": "ports",
    "ingress_port": "ports",
    "representor_port": "ports",
    "names": "rules",
    "page_token": "tokens",
}
_LITERALS: Final[dict[str, tuple[str, ...]]] = {
    "src_ip_prefix": (
        "10.0.0.0/24",
        "2001:db8::/64",
        "10.0.0.1/24",
        "0.0.0.0/0",
        "::/0",
        "1.2.3.4",
    ),
    "dst_ip_prefix": ("192.168.1.0/24", "2001:db8:1::/48", "300.1.1.0/24", "10.0.0.0/33"),
    "src_mac": ("aa:bb:cc:dd:ee:ff", "AA:BB:CC:DD:EE:FF", "02:00:00:00:00:01", "aa:bb:cc"),
    "dst_mac": ("02:00:00:00:00:02", "ff:ff:ff:ff:ff:ff", "aabbccddeeff"),
    "mac_address": ("02:00:00:00:00:10", "zz:zz:zz:zz:zz:zz"),
    "src_ip": ("10.0.0.1", "::1", "fe80::1%eth0", "1.1.1"),
    "dst_ip": ("10.0.0.2", "2001:db8::2", "256.0.0.1"),
    "paths": ("priority", "match", "actions", "offload", "name", "ingress_port", "mtu", "a.b"),
    "request_id": REQUEST_IDS,
    "client_label": ("fuzz", ""),
    "host_device": ("0000:03:00.1",),
}


class Loop:
    """One event loop, driven from the (synchronous) test thread.

    Hypothesis draws examples synchronously; each example's calls run on this loop
    with `run`. Keeping everything on one thread avoids a thread hop (and a GIL
    hand-over) per example. Background tasks (the SDK's session readers and watch
    streams, the sink) make progress whenever a coroutine runs.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[object, object, _T], timeout: float = 60.0) -> _T:
        """Run `coro` to completion (at most `timeout` seconds) and return its result."""
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def close(self) -> None:
        """Cancel what is left and close the loop."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.loop.run_until_complete(cancel_all())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


class Sink:
    """A loopback listener that fuzzed OpenSession calls may point the agent at.

    It accepts the agent's data-plane connections and reads until the agent closes
    them; it never sends. `closed_port` is a port held bound and not listening, so
    dialling it is refused and no other process can take it meanwhile.
    """

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self.port = 0
        self._closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._closed.bind(("127.0.0.1", 0))
        self.closed_port: int = self._closed.getsockname()[1]

    async def start(self) -> None:
        """Listen on a free loopback port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):
                pass
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def stop(self) -> None:
        """Stop listening and release the closed port."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._closed.close()


def safe_tcp_endpoints(sink: Sink, agent_port: int) -> st.SearchStrategy[session_pb2.TcpEndpoint]:
    """TCP endpoints the agent may be told to dial without leaving our own sockets."""
    ours = st.builds(
        session_pb2.TcpEndpoint,
        host=st.just("127.0.0.1"),
        port=st.sampled_from([sink.port, sink.port, sink.closed_port, agent_port]),
    )
    refused_port = st.builds(
        session_pb2.TcpEndpoint, host=texts(), port=st.sampled_from([0, 65536, 2**32 - 1])
    )
    # Names the IDNA codec rejects locally (label too long, empty label): no lookup.
    unencodable = st.builds(
        session_pb2.TcpEndpoint,
        host=st.sampled_from(["a" * 64, "a..b", ".", "x." + "b" * 70]),
        port=st.integers(1, 65535),
    )
    no_host = st.builds(session_pb2.TcpEndpoint, port=st.integers(0, 2**32 - 1))
    return weighted((ours, 3), (refused_port, 1), (unencodable, 1), (no_host, 1))


class FuzzSession:
    """A real data-plane session held open (and watched) by the SDK, with buffers."""

    def __init__(self, session: host_client.Session) -> None:
        self.session = session
        self.buffers: list[host_client.Buffer] = []
        self.job_names: list[str] = []

    @property
    def name(self) -> str:
        """sessions/{id}."""
        return self.session.name


class World:
    """Real objects on the agent and the pools of names the strategies draw from."""

    def __init__(self, client: host_client.Client, sink: Sink, agent_port: int) -> None:
        self.client = client
        self.sink = sink
        self.agent_port = agent_port
        self.sessions: list[FuzzSession] = []
        self.ports: list[str] = []
        # Live pools: strategies index into these lists at draw time, so restores show.
        self.pools: dict[str, list[str]] = {
            "sessions": [],
            "regions": [],
            "jobs": [],
            "volumes": [f"volumes/{v}" for v, _ in VOLUMES],
            "snapshots": [*(f"snapshots/{s}" for s, _ in SNAPSHOTS), "snapshots/fz-new-0"],
            "rules": [f"flowRules/{r}" for r, _ in RULES],
            "ports": [],
            "functions": [*(f"functions/{f}" for f, _ in FUNCTIONS), "functions/fz-0"],
            "ids": [*NEW_IDS, *(v for v, _ in VOLUMES), *(r for r, _ in RULES)],
            "tokens": [],
        }

    # ------------------------------------------------------------------ objects
    async def setup(self, sessions: int = 2) -> None:
        """Create every object once."""
        self.ports = [p.name for p in await self.client.list_ports()]
        self.pools["ports"][:] = [*self.ports, "ports/nope"]
        await self.restore()
        for _ in range(sessions):
            self.sessions.append(await self._open_session())
        self._refresh_pools()
        await self._add_page_tokens()

    async def _open_session(self) -> FuzzSession:
        session = await self.client.open_session(transport="tcp", queue_depth=16, label="fuzz")
        fuzz = FuzzSession(session)
        fuzz.buffers = [
            await session.alloc(BUFFER_BYTES, readable=True),
            await session.alloc(BUFFER_BYTES, writable=True),
            await session.alloc(BUFFER_BYTES, readable=True, writable=True),
        ]
        src, dst, _ = fuzz.buffers
        await session.register_key(bytes(range(32)))
        await session.register_key(bytes(range(16)))
        for volume_id, _ in VOLUMES:
            with contextlib.suppress(host_client.DpuError):
                await session.attach(f"volumes/{volume_id}")
        await session.copy(src[0:4096], dst[0:4096])
        rpc_job = await session.submit_rpc("crc32c", src[0:4096])
        await rpc_job
        fuzz.job_names = [f"{session.name}/jobs/1", f"{session.name}/jobs/{rpc_job.job_id}"]
        return fuzz

    async def restore(self) -> None:
        """Re-create what fuzzed requests closed, deleted or withdrew; refresh the pools."""
        await asyncio.gather(*(self._restore_volume(v, o) for v, o in VOLUMES))
        await asyncio.gather(*(self._restore_snapshot(s, v) for s, v in SNAPSHOTS))
        await asyncio.gather(*(self._restore_rule(r, rule) for r, rule in RULES))
        await asyncio.gather(*(self._restore_function(f, spec) for f, spec in FUNCTIONS))
        for index, fuzz in enumerate(self.sessions):
            if not await self._session_intact(fuzz):
                with contextlib.suppress(host_client.DpuError):
                    await fuzz.session.close()
                self.sessions[index] = await self._reopen()
        self._refresh_pools()
        await self._add_page_tokens()

    async def _add_page_tokens(self) -> None:
        """Add tokens the agent issued to the pool (page_size 1), beside the made-up ones.

        A token is bound to its List method, parent and filters: these continue their own
        call, and make every other List call they are sent with answer INVALID_ARGUMENT.
        """
        stubs = self.client.stubs
        calls: list[tuple[Any, Any]] = [
            (stubs.storage.ListVolumes, storage_pb2.ListVolumesRequest(page_size=1)),
            (stubs.storage.ListSnapshots, storage_pb2.ListSnapshotsRequest(page_size=1)),
            (stubs.network.ListFlowRules, network_pb2.ListFlowRulesRequest(page_size=1)),
            (stubs.sessions.ListSessions, session_pb2.ListSessionsRequest(page_size=1)),
            *(
                (stubs.jobs.ListJobs, job_pb2.ListJobsRequest(session=s.name, page_size=1))
                for s in self.sessions
            ),
        ]
        for method, request in calls:
            with contextlib.suppress(host_client.DpuError):
                token = (await self.client._call(method, request)).next_page_token
                if token:
                    self.pools["tokens"].append(token)

    async def _reopen(self) -> FuzzSession:
        """A new session; fuzzed OpenSession calls may hold every slot for a while."""
        for _ in range(100):
            try:
                return await self._open_session()
            except host_client.DpuError as exc:
                if exc.code != "RESOURCE_EXHAUSTED":
                    raise
            await asyncio.sleep(0.1)
        return await self._open_session()

    async def _session_intact(self, fuzz: FuzzSession) -> bool:
        if fuzz.session.failed:
            return False
        try:
            state = await self.client.get_session(fuzz.name)
        except host_client.NotFoundError:
            return False
        return state.state == session_pb2.SESSION_STATE_ACTIVE and state.counters.regions >= len(
            fuzz.buffers
        )

    async def _restore_volume(self, volume_id: str, options: dict[str, Any]) -> None:
        try:
            await self.client.get_volume(f"volumes/{volume_id}")
        except host_client.NotFoundError:
            await self.client.create_volume(volume_id, VOLUME_BYTES, **options)

    async def _restore_snapshot(self, snapshot_id: str, volume_id: str) -> None:
        try:
            await self.client.get_snapshot(f"snapshots/{snapshot_id}")
        except host_client.NotFoundError:
            with contextlib.suppress(host_client.DpuError):  # e.g. the chain is full
                await self.client.create_snapshot(snapshot_id, f"volumes/{volume_id}")

    async def _restore_rule(self, rule_id: str, rule: network_pb2.FlowRule) -> None:
        try:
            await self.client.get_flow_rule(f"flowRules/{rule_id}")
        except host_client.NotFoundError:
            # A fuzzed rule may hold the port and priority now: then the pool names a
            # rule that does not exist, which is a fine request too.
            with contextlib.suppress(host_client.DpuError):
                await self.client.create_flow_rule(rule_id, rule)

    async def _restore_function(self, function_id: str, spec: virtualization_pb2.Function) -> None:
        try:
            await self.client.get_function(f"functions/{function_id}")
        except host_client.NotFoundError:
            with contextlib.suppress(host_client.DpuError):
                await self.client.create_function(function_id, spec)
        except host_client.DpuError:
            pass  # an agent without virtualization: the names are still fine requests

    def _refresh_pools(self) -> None:
        names = [s.name for s in self.sessions]
        self.pools["sessions"][:] = names
        self.pools["regions"][:] = [b.name for s in self.sessions for b in s.buffers] + [
            f"{n}/regions/fz-new" for n in names
        ]
        self.pools["jobs"][:] = [j for s in self.sessions for j in s.job_names] + [
            f"{n}/jobs/424242" for n in names
        ]
        keys = [
            *self.pools["volumes"],
            *self.pools["rules"],
            *names,
            "fz-vol-1",
            "00000000000000000001",
        ]
        self.pools["tokens"][:] = [base64.urlsafe_b64encode(k.encode()).decode() for k in keys]

    async def close(self) -> None:
        """Close the sessions."""
        for fuzz in self.sessions:
            with contextlib.suppress(host_client.DpuError):
                await fuzz.session.close()

    # ------------------------------------------------------------------ hints
    def strings_for(self, field: pbd.FieldDescriptor) -> Sequence[str]:
        """Real names and ids for a string field, or () for none.

        Pools are returned as the live lists: a restore changes them in place, and
        the strategies look values up when they draw.
        """
        name = field.name
        pool = _FIELD_POOLS.get(name)
        if name.endswith("_id") and name != "request_id":
            pool = "ids"
        elif name == "name":
            owner = field.containing_type.name if field.containing_type else ""
            pool = next((p for noun, p in _NOUNS if noun in owner), "volumes")
        if pool is not None:
            return self.pools[pool]
        return _LITERALS.get(name, ())


def request_ids() -> st.SearchStrategy[str | None]:
    """x-request-id metadata: absent, reused, long or odd (printable ASCII only)."""
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
    return st.one_of(st.none(), st.sampled_from(REQUEST_IDS), printable)
