"""The agent's event plane: completions, status and telemetry to an MQTT broker (aiomqtt).

The data plane hands every finished job to `MqttEventPublisher.publish_completion`,
which only encodes it and appends it to an in-memory backlog: it never waits, never
raises, and works whether or not a broker is reachable. A background task owns the
connection:

    connect ──▶ publish status "online" (retained) ──▶ send the backlog, tenants in
       ▲        turn, up to `window` QoS 1 messages awaiting PUBACK; telemetry every N s
       │                               │ connection lost / publish failed
       └── backoff (doubling, capped, ─┘ unacknowledged messages go back to the
           with jitter)                  front of the backlog, in order

A message leaves the backlog only when the broker acknowledged it, so a broker that
is down or restarting loses nothing the backlog can hold (QoS 1: a message whose
PUBACK was lost is sent again, so a subscriber may see a duplicate).

The backlog is shared fairly by the tenants whose completions it holds. Each tenant
has its own queue, sent in order; the queues take turns, one message each, so a
completion waits behind the `window` messages in flight and at most one message of
each other tenant per completion ahead of it in its own queue, however many another
tenant has waiting. The backlog holds `backlog` messages in all (those awaiting
their PUBACK included); a tenant's share is `backlog` divided by the number of
tenants with messages waiting. When the backlog is full, a completion of a tenant
holding its share or more is refused; one of a tenant under its share takes the
place of the newest waiting completion of the tenant holding the most. So a tenant
loses completions only while it holds about its share or more, and then its newest;
each is counted as `dropped` (the first of each tenant in a spell is logged, naming
the tenant). Status and telemetry are not in the backlog: they are published directly.

`stop()` sends what it can of the backlog within `flush_timeout`, publishes status
"offline" (retained) and disconnects cleanly. If the agent dies or its link is cut,
the broker publishes the will instead: the same retained "offline", with reason
"connection lost". Topics and payloads are in `dpu_wire.events`.

The publisher subscribes to the data plane's completion bus (`on_completions`): a
batch of finished jobs arrives on the data-plane reactor's thread and is handed to
this event loop in one call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import random
import time
from typing import TYPE_CHECKING, Final, Protocol, Self

import aiomqtt

from dpu_agent import __version__
from dpu_wire import events as payloads

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from types import TracebackType

    from dpu_wire.events import FinishedJob


class CompletionSource(Protocol):
    """What a completion's topic names of its session."""

    @property
    def tenant(self) -> str:
        """The session's owner."""

    @property
    def session_id(self) -> str:
        """The session id, "s-..."."""


log = logging.getLogger(__name__)

_U64: Final = (1 << 64) - 1
_OFFLINE_TIMEOUT: Final = 2.0  # seconds the "offline" status gets on the way out


@dataclasses.dataclass(frozen=True)
class MqttSettings:
    """Where the broker is and how the publisher behaves.

    Attributes:
        host: broker host name or address.
        port: broker TCP port.
        client_id: MQTT client identifier; "" = "dpu-agent-{agent id}". It must be
            unique on the broker: a second client with the same id takes the
            connection over (and the first one's will fires).
        username: user name, or None for an anonymous connection.
        password: password (never logged, not in repr).
        keepalive: seconds between MQTT pings; the broker declares the agent gone
            (and publishes its will) after 1.5 times this without traffic.
        backlog: completions held while the broker is slow or away, all tenants
            together; beyond a tenant's share of it, that tenant's newest are dropped.
        window: QoS 1 messages sent and not yet acknowledged, at most. 64 is the
            fastest on loopback; aiomqtt's cost per publish grows with the number
            pending, so a much larger window is slower, not faster.
        telemetry_interval: seconds between telemetry messages; 0 turns them off.
        topic_prefix: first levels of every topic.
        reconnect_min: first reconnection delay, seconds (doubles per failure).
        reconnect_max: longest reconnection delay, seconds.
        publish_timeout: seconds to wait for a CONNACK or PUBACK before declaring
            the connection dead.
        flush_timeout: seconds `stop()` spends sending the backlog.
    """

    host: str = "127.0.0.1"
    port: int = 1883
    client_id: str = ""
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    keepalive: int = 30
    backlog: int = 100_000
    window: int = 64
    telemetry_interval: float = 10.0
    topic_prefix: str = payloads.DEFAULT_PREFIX
    reconnect_min: float = 0.5
    reconnect_max: float = 30.0
    publish_timeout: float = 10.0
    flush_timeout: float = 5.0

    def __post_init__(self) -> None:
        payloads.check_prefix(self.topic_prefix)
        if not 0 < self.port < 65536:
            raise ValueError(f"mqtt port must be 1-65535, not {self.port}")
        checks = {
            "keepalive": 5 <= self.keepalive <= 65535,
            "backlog": self.backlog >= 1,
            "window": 1 <= self.window <= 65535,
            "telemetry_interval": self.telemetry_interval >= 0,
            "reconnect_min": 0 < self.reconnect_min <= self.reconnect_max,
            "publish_timeout": self.publish_timeout > 0,
            "flush_timeout": self.flush_timeout >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"mqtt {name} is out of range: {getattr(self, name)!r}")


@dataclasses.dataclass(slots=True)
class _Counters:
    queued: int = 0
    published: int = 0
    dropped: int = 0
    rejected: int = 0
    connects: int = 0
    connect_failures: int = 0
    telemetry: int = 0


@dataclasses.dataclass(slots=True)
class _Message:
    tenant: str
    topic: str
    payload: bytes


class _Backlog:
    """Completions waiting to be sent: a queue per tenant, the queues served in turn.

    A tenant's queue exists while it holds messages. `pop()` takes the oldest message
    of the tenant whose turn it is and passes the turn on.
    """

    def __init__(self) -> None:
        self._queues: collections.OrderedDict[str, collections.deque[_Message]] = (
            collections.OrderedDict()
        )
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def tenants(self) -> int:
        """Tenants with messages waiting."""
        return len(self._queues)

    def held(self, tenant: str) -> int:
        """Messages of `tenant` waiting."""
        queue = self._queues.get(tenant)
        return 0 if queue is None else len(queue)

    def _queue(self, tenant: str) -> collections.deque[_Message]:
        """The tenant's queue, made (its turn last) if it had none."""
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = collections.deque()
        return queue

    def append(self, message: _Message) -> None:
        """Queue a message last of its tenant's (a new tenant's turn comes last)."""
        self._queue(message.tenant).append(message)
        self._size += 1

    def pop(self) -> _Message:
        """The oldest message of the tenant whose turn it is; the turn passes on."""
        tenant, queue = next(iter(self._queues.items()))
        message = queue.popleft()
        self._size -= 1
        if queue:
            self._queues.move_to_end(tenant)
        else:
            del self._queues[tenant]
        return message

    def put_back(self, messages: Sequence[_Message]) -> None:
        """Put messages taken by `pop()` back, in order, ahead of the rest of their tenant's.

        Their tenants' turns come first.
        """
        for message in reversed(messages):
            queue = self._queue(message.tenant)
            self._queues.move_to_end(message.tenant, last=False)
            queue.appendleft(message)
            self._size += 1

    def drop_newest_of_the_largest(self) -> str | None:
        """Drop the newest message of the tenant holding the most.

        Returns that tenant, or None if nothing waits.
        """
        if not self._queues:
            return None
        tenant, queue = max(self._queues.items(), key=lambda item: len(item[1]))
        queue.pop()
        self._size -= 1
        if not queue:
            del self._queues[tenant]
        return tenant


class MqttEventPublisher:
    """Publishes the agent's events; start it once, stop it once.

    Use it as an async context manager, or call `start()` and `stop()`. Every method
    runs on the event loop's thread.
    """

    def __init__(
        self,
        settings: MqttSettings,
        agent_id: str,
        *,
        version: str = __version__,
        started_ns: int | None = None,
        telemetry_source: Callable[[], Mapping[str, object]] | None = None,
    ) -> None:
        self.settings = settings
        self.agent_id = agent_id
        self.telemetry_source = telemetry_source
        self._version = version
        self._started_ns = time.time_ns() if started_ns is None else started_ns
        self._started = time.monotonic()
        prefix = settings.topic_prefix
        self._status_topic = payloads.status_topic(prefix, agent_id)
        self._telemetry_topic = payloads.telemetry_topic(prefix, agent_id)
        self._client_id = settings.client_id or f"dpu-agent-{agent_id}"
        self._backlog = _Backlog()
        self._inflight: dict[int, _Message] = {}  # sent, awaiting PUBACK; in send order
        self._next_seq = 0
        self._counters = _Counters()
        self._wake = asyncio.Event()
        self._link_error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._stopping = asyncio.Event()  # set with _closing, to wake the backoff
        self._closed = False
        self._flush_deadline = math.inf
        self._connected = asyncio.Event()
        self._overflowing: set[str] = set()  # tenants that lost completions, logged
        self._telemetry_failing = False
        self._mqtt: aiomqtt.Client | None = None  # the current connection (for tests)
        try:  # the loop completions are handed to (on_completions); set again in start()
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def start(self) -> None:
        """Start connecting in the background; returns at once (the broker may be down)."""
        if self._task is not None or self._closed:
            raise RuntimeError("MqttEventPublisher.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="mqtt-events")

    async def stop(self, flush_timeout: float | None = None) -> None:
        """Send the backlog (up to `flush_timeout` s), publish "offline", disconnect."""
        task = self._task
        if task is None or self._closing:
            self._closed = True
            return
        wait = self.settings.flush_timeout if flush_timeout is None else flush_timeout
        self._flush_deadline = time.monotonic() + wait
        self._closing = True
        self._stopping.set()
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), wait + 2 * _OFFLINE_TIMEOUT + 1.0)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._closed = True
        unsent = len(self._backlog) + len(self._inflight)
        if unsent:
            log.warning("events not delivered at shutdown", extra={"unsent": unsent})

    @property
    def connected(self) -> bool:
        """Whether the publisher holds a connection to the broker now."""
        return self._connected.is_set()

    async def wait_connected(self) -> None:
        """Wait until the publisher is connected and has published "online"."""
        await self._connected.wait()

    # ------------------------------------------------------------------ the producer side
    def on_completions(self, session: CompletionSource, jobs: Sequence[FinishedJob]) -> None:
        """Completion-bus subscriber (any thread): queue the batch on this event loop."""
        batch = list(jobs)
        loop = self._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._publish_batch, session, batch)
                return
        except RuntimeError:  # the loop is closed: the agent is going away
            pass
        self._counters.dropped += len(batch)

    def _publish_batch(self, session: CompletionSource, jobs: list[FinishedJob]) -> None:
        for job in jobs:
            self.publish_completion(session, job)

    def publish_completion(self, session: CompletionSource, job: FinishedJob) -> None:
        """Queue a finished job's completion (on this event loop). Never blocks, never raises.

        Works before `start()` (the backlog waits for the connection); after `stop()`
        completions are dropped.
        """
        counters = self._counters
        try:
            if self._closed:
                counters.dropped += 1
                return
            tenant = session.tenant
            if self._full() and self._holds_its_share(tenant):
                self._drop(tenant)
                return
            message = _Message(
                tenant,
                payloads.completion_topic(
                    self.settings.topic_prefix,
                    self.agent_id,
                    session.tenant,
                    session.session_id,
                    job.job_id,
                ),
                payloads.completion_payload(session.session_id, job),
            )
        except Exception:
            counters.rejected += 1
            log.exception("cannot encode a completion event", extra={"job": job.job_id})
            return
        if self._full():  # the tenant is under its share: the largest one makes room
            largest = self._backlog.drop_newest_of_the_largest()
            if largest is None:  # nothing waits: all of the backlog awaits PUBACKs
                self._drop(tenant)
                return
            self._drop(largest)
        self._backlog.append(message)
        counters.queued += 1
        self._wake.set()

    def _full(self) -> bool:
        return len(self._backlog) + len(self._inflight) >= self.settings.backlog

    def _holds_its_share(self, tenant: str) -> bool:
        """Whether `tenant` has at least `backlog` / (tenants with messages waiting)."""
        held = self._backlog.held(tenant)
        tenants = self._backlog.tenants() + (held == 0)
        return held * tenants >= self.settings.backlog

    def _drop(self, tenant: str) -> None:
        """Count a completion of `tenant` lost to a full backlog; log the first of a spell."""
        self._counters.dropped += 1
        if tenant not in self._overflowing:
            self._overflowing.add(tenant)
            log.warning(
                "event backlog full; dropping this tenant's newest completions",
                extra={"tenant": tenant, "backlog": self.settings.backlog},
            )

    def stats(self) -> dict[str, int]:
        """Counters (64-bit, wrapping) and gauges of the event plane.

        queued: completions accepted into the backlog. published: completions the
        broker acknowledged (each once). dropped: completions lost to a full backlog
        (refused, or accepted and later making room for a tenant under its share) or
        refused after stop; queued == published + unsent + those that made room.
        rejected: completions that could not be encoded (logged). unsent: in the
        backlog now, waiting or awaiting their PUBACK. reconnects: successful
        connections after the first. connect_failures: connection attempts that
        failed. telemetry: telemetry reports sent. connected: 1 while connected.
        """
        c = self._counters
        return {
            "queued": c.queued & _U64,
            "published": c.published & _U64,
            "dropped": c.dropped & _U64,
            "rejected": c.rejected & _U64,
            "unsent": len(self._backlog) + len(self._inflight),
            "reconnects": max(0, c.connects - 1) & _U64,
            "connect_failures": c.connect_failures & _U64,
            "telemetry": c.telemetry & _U64,
            "connected": int(self._connected.is_set()),
        }

    # ------------------------------------------------------------------ the connection
    def _client(self) -> aiomqtt.Client:
        s = self.settings
        offline = payloads.status_payload(
            payloads.STATUS_OFFLINE,
            self.agent_id,
            self._version,
            self._started_ns,
            payloads.REASON_CONNECTION_LOST,
        )
        client = aiomqtt.Client(
            s.host,
            s.port,
            username=s.username,
            password=s.password,
            identifier=self._client_id,
            will=aiomqtt.Will(self._status_topic, offline, qos=1, retain=True),
            clean_session=True,
            keepalive=s.keepalive,
            timeout=s.publish_timeout,
            max_inflight_messages=s.window,
        )
        client.pending_calls_threshold = s.window + 16  # aiomqtt warns above this
        return client

    async def _run(self) -> None:
        attempt = 0
        while True:
            if self._closing and not self._backlog:
                return  # stopping while disconnected, nothing to flush: the will said offline
            client = self._client()
            try:
                async with client:
                    attempt = 0
                    await self._connected_session(client)
                    return  # stopping: backlog flushed, "offline" published
            except (aiomqtt.MqttError, OSError) as exc:
                self._lost(exc, attempt, connecting=not self._connected.is_set())
            except Exception:
                log.exception("event publisher failed; reconnecting")
            finally:
                self._connected.clear()
                self._mqtt = None
                _read_disconnect_reason(client)
            attempt += 1
            delay = _backoff(attempt, self.settings.reconnect_min, self.settings.reconnect_max)
            if self._closing:
                remaining = self._flush_deadline - time.monotonic()
                if remaining <= 0:
                    return
                await asyncio.sleep(min(delay, remaining))
            else:
                # stop() cuts the wait short: it wants one more try at flushing
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)

    def _lost(self, exc: BaseException, attempt: int, *, connecting: bool) -> None:
        where = {"broker": f"{self.settings.host}:{self.settings.port}", "error": str(exc)}
        unsent = len(self._backlog) + len(self._inflight)
        if connecting:
            self._counters.connect_failures += 1
            level = logging.WARNING if attempt == 0 else logging.DEBUG
            log.log(level, "event broker unreachable; retrying", extra={**where, "unsent": unsent})
        else:
            log.warning("event broker connection lost", extra={**where, "unsent": unsent})

    async def _connected_session(self, client: aiomqtt.Client) -> None:
        self._link_error = None
        self._mqtt = client
        try:
            await client.publish(self._status_topic, self._status("online"), qos=1, retain=True)
            self._counters.connects += 1
            self._connected.set()
            log.info(
                "event broker connected",
                extra={
                    "broker": f"{self.settings.host}:{self.settings.port}",
                    "client_id": self._client_id,
                    "unsent": len(self._backlog),
                },
            )
            await self._pump(client)
            await client.publish(
                self._status_topic,
                self._status("offline"),
                qos=1,
                retain=True,
                timeout=_OFFLINE_TIMEOUT,
            )
        except asyncio.CancelledError:
            # Cancelled without stop(): aiomqtt's exit sends DISCONNECT, which discards
            # the will, so say "offline" ourselves (best effort).
            with contextlib.suppress(aiomqtt.MqttError):
                await client.publish(
                    self._status_topic,
                    self._status("offline"),
                    qos=1,
                    retain=True,
                    timeout=_OFFLINE_TIMEOUT,
                )
            raise

    def _status(self, state: str) -> bytes:
        if state == payloads.STATUS_ONLINE:
            return payloads.status_payload(
                payloads.STATUS_ONLINE, self.agent_id, self._version, self._started_ns
            )
        return payloads.status_payload(
            payloads.STATUS_OFFLINE,
            self.agent_id,
            self._version,
            self._started_ns,
            payloads.REASON_SHUTDOWN,
        )

    async def _pump(self, client: aiomqtt.Client) -> None:
        """Send the backlog until the link fails (raise) or stop() is done with it (return)."""
        watch = asyncio.create_task(_until_disconnected(client))
        watch.add_done_callback(lambda _: self._wake.set())
        tasks: set[asyncio.Task[None]] = set()
        if self.settings.telemetry_interval > 0:
            tasks.add(asyncio.create_task(self._telemetry(client)))
        try:
            while True:
                self._send_waiting(client, tasks)
                if self._link_error is not None:
                    raise self._link_error
                timeout = None
                if self._closing:
                    timeout = self._flush_deadline - time.monotonic()
                    if not (self._backlog or self._inflight) or timeout <= 0:
                        return
                self._wake.clear()
                if timeout is None:
                    await self._wake.wait()
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout)
                if watch.done():
                    watch.result()  # raises the reason the connection ended
        finally:
            for task in (watch, *tasks):
                task.cancel()
            await asyncio.gather(watch, *tasks, return_exceptions=True)
            self._requeue()

    def _send_waiting(self, client: aiomqtt.Client, tasks: set[asyncio.Task[None]]) -> None:
        """Send waiting messages, tenants in turn, while the window has room."""
        while self._backlog and len(self._inflight) < self.settings.window:
            message = self._backlog.pop()
            seq = self._next_seq
            self._next_seq += 1
            self._inflight[seq] = message
            task = asyncio.create_task(self._send(client, seq, message))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if not self._backlog:
            self._overflowing.clear()  # a new spell of drops is logged again

    async def _send(self, client: aiomqtt.Client, seq: int, message: _Message) -> None:
        try:
            await client.publish(message.topic, message.payload, qos=1)
        except aiomqtt.MqttError as exc:
            if self._link_error is None:
                self._link_error = exc
        else:
            if self._inflight.pop(seq, None) is not None:
                self._counters.published += 1
        self._wake.set()

    def _requeue(self) -> None:
        """Put unacknowledged messages back at the front of the backlog, in order."""
        if self._inflight:
            self._backlog.put_back(list(self._inflight.values()))
            self._inflight.clear()

    async def _telemetry(self, client: aiomqtt.Client) -> None:
        while True:
            payload = self._telemetry_payload()
            if payload is not None:
                try:
                    await client.publish(self._telemetry_topic, payload, qos=0)
                except aiomqtt.MqttError as exc:
                    if self._link_error is None:
                        self._link_error = exc
                    self._wake.set()
                    return
                self._counters.telemetry += 1
            await asyncio.sleep(self.settings.telemetry_interval)

    def _telemetry_payload(self) -> bytes | None:
        try:
            stats = self.telemetry_source() if self.telemetry_source is not None else {}
            payload = payloads.telemetry_payload(
                self.agent_id,
                time.time_ns(),
                time.monotonic() - self._started,
                stats,
                self.stats(),
            )
        except Exception:
            if not self._telemetry_failing:
                log.exception("telemetry source failed; skipping reports until it works")
            self._telemetry_failing = True
            return None
        self._telemetry_failing = False
        return payload


def _read_disconnect_reason(client: aiomqtt.Client) -> None:
    """Mark the reason a connection ended as read.

    aiomqtt 2.5 keeps it in a future that its __aexit__ skips when the link is already
    down; unread, asyncio logs "Future exception was never retrieved".
    """
    reason = client._disconnected  # noqa: SLF001 - see above
    if reason.done() and not reason.cancelled():
        reason.exception()


async def _until_disconnected(client: aiomqtt.Client) -> None:
    """Return never; raise MqttError when the client's connection ends.

    The publisher subscribes to nothing, so aiomqtt's message iterator only ever ends,
    with the reason the connection was lost.
    """
    async for _ in client.messages:
        pass


def _backoff(attempt: int, low: float, high: float) -> float:
    """Delay before reconnection `attempt` (1, 2, ...): doubling, capped, half of it jitter."""
    ceiling = min(high, low * (1 << min(attempt - 1, 32)))
    return ceiling / 2 + random.uniform(0, ceiling / 2)  # noqa: S311 - jitter, not a secret
