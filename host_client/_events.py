"""Agent events from the MQTT broker: job completions, agent status, telemetry.

The agent publishes to a broker (docs/events.md has the topics and JSON; the
code building them is `dpu_wire.events`); an `EventSubscriber` connects to the same
broker and parses what arrives:

    async with EventSubscriber("broker.lab", 1883) as events:
        print(await events.agent_status("dpu-0"))            # retained: online/offline
        async with events.completions(tenant="default") as stream:   # subscribed here
            async for event in stream:
                print(event.job, event.completion.state, event.completion.crc32c)

One MQTT 5 connection carries every subscription, and each iterator gets exactly the
messages its own subscription would: iterators may overlap or repeat a filter and
run concurrently. (Iterators on one filter share one broker subscription; each join
re-subscribes with a new MQTT subscription identifier, so the broker's retained copy
goes to the new iterator only, while live messages go to all of them.)

A broker that requires log-ins (deploy/mosquitto/mosquitto-secure.conf) takes
`username`/`password`, and TLS with `ca_file` (and a client certificate with
`cert_file`/`key_file`); its ACL decides what arrives: a tenant's account receives only
its own tenant's completions and the agents' status, whatever filter it subscribes
to. A refused log-in raises `PermissionDeniedError`.

Completions are QoS 1: none is lost while the subscriber stays connected, and a run
of them may arrive twice if the agent resent them after a reconnection. Deduplicate on
`(event.job, event.completion.end_ns)`: the job's name alone is not enough, because a
host may reuse a capsule job id once its job has finished (docs/events.md, "Delivery").
If the broker connection is lost, every iterator raises `UnavailableError`; enter the
subscriber again to reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import itertools
import json
import logging
import re
import ssl
from typing import TYPE_CHECKING, Any, Final, Generic, Self, TypeVar, cast

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from host_client._completion import _CODE_NAMES, Completion
from host_client._errors import InvalidArgumentError, PermissionDeniedError, UnavailableError

if TYPE_CHECKING:
    import os
    from collections.abc import Callable
    from types import TracebackType

log = logging.getLogger(__name__)

DEFAULT_PREFIX: Final = "dpu/v1"
_T = TypeVar("_T")
_END: Final = object()
_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_TIME_RE: Final = re.compile(
    r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)", re.IGNORECASE
)
_LEVEL_FORBIDDEN: Final = frozenset("/+#\x00")
# CONNACK codes of a refused log-in: MQTT 5 "bad user name or password", "not
# authorized", "bad authentication method"; MQTT 3.1.1 4 and 5 are the same two.
_LOGIN_REFUSED: Final = frozenset({0x86, 0x87, 0x8C, 4, 5})
_NOT_AUTHORIZED: Final = 0x87


@dataclasses.dataclass(frozen=True)
class CompletionEvent:
    """A job completion the agent published.

    Attributes:
        agent_id: the agent that ran the job.
        tenant: the session's tenant.
        session_id: the session's id (its name is "sessions/{session_id}").
        job: the job's resource name, "sessions/{session_id}/jobs/{job_id}".
        kind: the job kind's name ("COPY", "CRC32C", "SHA256", ...).
        origin: "capsule" (data plane) or "grpc" (SubmitJob).
        request_id: the x-request-id of the call that made the job: its SubmitJob,
            or for a capsule job its session's OpenSession (the agent makes one up
            when the call had none). Not GetJob's `request_id`: that is
            `submit_request_id`.
        completion: the outcome, as `Session` jobs return it (`sha256` included, for
            an SHA256 job that succeeded).
        submit_request_id: the SubmitJob request's `request_id` field (its
            idempotency key, what GetJob returns as `request_id`); "" for capsule
            jobs, SubmitJob calls without one, and agents older than the field.
    """

    agent_id: str
    tenant: str
    session_id: str
    job: str
    kind: str
    origin: str
    request_id: str
    completion: Completion
    submit_request_id: str = ""

    @property
    def job_id(self) -> int:
        """The job's number in its session."""
        return self.completion.job_id


@dataclasses.dataclass(frozen=True)
class AgentStatus:
    """An agent's last published status.

    Attributes:
        agent_id: the agent.
        state: "online" or "offline".
        version: the agent's version.
        started_ns: when the agent started (ns since the epoch).
        reason: why it is offline: "shutdown" (clean stop) or "connection lost"
            (the broker published the agent's will); "" when online.
        retained: whether the broker delivered its stored copy (the state when the
            subscription started) rather than a change as it happened.
    """

    agent_id: str
    state: str
    version: str
    started_ns: int
    reason: str = ""
    retained: bool = False

    @property
    def online(self) -> bool:
        """Whether the agent is connected to the broker."""
        return self.state == "online"


@dataclasses.dataclass(frozen=True)
class Telemetry:
    """One periodic telemetry report of an agent.

    Attributes:
        agent_id: the agent.
        time_ns: when it was taken (ns since the epoch).
        uptime_s: seconds since the agent started.
        stats: the agent's figures (sessions, open jobs, summed job counters).
        events: the agent's event-publisher counters (published, dropped, unsent, ...).
    """

    agent_id: str
    time_ns: int
    uptime_s: float
    stats: dict[str, Any]
    events: dict[str, int]


# ---------------------------------------------------------------------- parsing
def parse_time(value: object) -> int:
    """Nanoseconds since the epoch from an RFC 3339 time; 0 for null."""
    if value is None:
        return 0
    if not isinstance(value, str):
        raise TypeError(f"expected an RFC 3339 time, got {value!r}")
    match = _TIME_RE.fullmatch(value)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {value!r}")
    whole, fraction, zone = match.groups()
    offset = "+00:00" if zone.upper() == "Z" else zone
    moment = dt.datetime.fromisoformat(whole + offset)
    seconds = (moment - _EPOCH) // dt.timedelta(seconds=1)
    return seconds * 1_000_000_000 + int((fraction or "").ljust(9, "0"))


def _levels(topic: str, prefix: str, shape: tuple[str | None, ...]) -> list[str]:
    """The wildcard levels of `topic` under `prefix`, checked against `shape` (None = any)."""
    head = prefix + "/"
    if not topic.startswith(head):
        raise ValueError(f"topic {topic!r} is not under {prefix!r}")
    levels = topic[len(head) :].split("/")
    if len(levels) != len(shape) or any(
        want is not None and got != want for got, want in zip(levels, shape, strict=True)
    ):
        raise ValueError(f"unexpected topic {topic!r}")
    return [got for got, want in zip(levels, shape, strict=True) if want is None]


def _object(payload: bytes) -> dict[str, Any]:
    document = json.loads(payload)
    if not isinstance(document, dict):
        raise TypeError("payload is not a JSON object")
    return document


_COMPLETION_SHAPE: Final = ("agents", None, "tenants", None, "sessions", None, "jobs", None)


def parse_completion(topic: str, payload: bytes, prefix: str = DEFAULT_PREFIX) -> CompletionEvent:
    """A completion message; raises ValueError (or TypeError, KeyError) if malformed."""
    agent_id, tenant, session_id, _ = _levels(topic, prefix, (*_COMPLETION_SHAPE, "completion"))
    d = _object(payload)
    status = d["status"]
    code = int(status["code"])
    crc = d.get("crc32c")
    digest = d.get("sha256")
    completion = Completion(
        job_id=int(d["job_id"]),
        state=str(d["state"]),
        code=_CODE_NAMES.get(code, str(code)),
        message=str(status.get("message", "")),
        bytes_read=int(d.get("bytes_read", 0)),
        bytes_written=int(d.get("bytes_written", 0)),
        crc32c=None if crc is None else int(crc),
        sha256=None if digest is None else bytes.fromhex(digest),
        submit_ns=parse_time(d.get("submit_time")),
        start_ns=parse_time(d.get("start_time")),
        end_ns=parse_time(d.get("end_time")),
    )
    return CompletionEvent(
        agent_id=agent_id,
        tenant=tenant,
        session_id=session_id,
        job=str(d["job"]),
        kind=str(d.get("kind", "")),
        origin=str(d.get("origin", "")),
        request_id=str(d.get("request_id", "")),
        completion=completion,
        submit_request_id=str(d.get("submit_request_id", "")),
    )


def parse_status(
    topic: str, payload: bytes, prefix: str = DEFAULT_PREFIX, *, retained: bool = False
) -> AgentStatus:
    """A status message; raises ValueError (or TypeError, KeyError) if malformed."""
    (agent_id,) = _levels(topic, prefix, ("agents", None, "status"))
    d = _object(payload)
    return AgentStatus(
        agent_id=agent_id,
        state=str(d["state"]),
        version=str(d.get("version", "")),
        started_ns=parse_time(d.get("started")),
        reason=str(d.get("reason", "")),
        retained=retained,
    )


def parse_telemetry(topic: str, payload: bytes, prefix: str = DEFAULT_PREFIX) -> Telemetry:
    """A telemetry message; raises ValueError (or TypeError, KeyError) if malformed."""
    (agent_id,) = _levels(topic, prefix, ("agents", None, "telemetry"))
    d = _object(payload)
    return Telemetry(
        agent_id=agent_id,
        time_ns=parse_time(d.get("time")),
        uptime_s=float(d.get("uptime_s", 0.0)),
        stats=dict(d.get("stats", {})),
        events={str(k): int(v) for k, v in dict(d.get("events", {})).items()},
    )


def _level(value: str, what: str) -> str:
    if value == "+":
        return value
    if not value or _LEVEL_FORBIDDEN.intersection(value):
        raise InvalidArgumentError(
            "INVALID_ARGUMENT", f"{what} {value!r} cannot be a topic level (or use '+')"
        )
    return value


# ---------------------------------------------------------------------- subscriptions
class Subscription(Generic[_T]):
    """One topic filter on an `EventSubscriber`'s connection, yielding parsed events.

    `async with` it to know the broker has confirmed the subscription before you go on
    (it unsubscribes on exit), or just `async for` over it (it subscribes on the
    first iteration and lives as long as the subscriber). Messages that do not parse
    are logged and skipped.
    """

    def __init__(
        self,
        owner: EventSubscriber,
        topic_filter: str,
        parse: Callable[[aiomqtt.Message], _T],
    ) -> None:
        self.topic_filter = topic_filter
        self._owner = owner
        self._parse = parse
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self.joined = 0  # the MQTT subscription identifier it joined with; 0 = not subscribed
        self._ended = False  # unsubscribed, or its subscriber closed: never subscribes again

    async def __aenter__(self) -> Self:
        if self._ended:
            raise RuntimeError("a subscription cannot be entered again; make a new one")
        await self._owner._subscribe(self)  # noqa: SLF001 - the owner's half of the protocol
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._owner._unsubscribe(self)  # noqa: SLF001

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> _T:
        if not self.joined and not self._ended:
            await self._owner._subscribe(self)  # noqa: SLF001
        while True:
            item = await self._queue.get()
            if item is _END:
                self._queue.put_nowait(_END)
                raise StopAsyncIteration
            if isinstance(item, BaseException):
                self._queue.put_nowait(item)
                raise item
            message = cast("aiomqtt.Message", item)
            try:
                return self._parse(message)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning(
                    "skipping a malformed event",
                    extra={"topic": str(message.topic), "error": repr(exc)},
                )

    def _deliver(self, item: object) -> None:
        if item is _END:
            self._ended = True
        self._queue.put_nowait(item)


class EventSubscriber:
    """A connection to the event broker; subscriptions are made from it.

    Args:
        hostname: broker host.
        port: broker port.
        username: user name, or None for anonymous.
        password: password (kept out of repr and error messages).
        topic_prefix: the agents' topic prefix (their `mqtt.topic_prefix`).
        identifier: MQTT client id; None lets the broker choose one.
        timeout: seconds to wait for the broker to answer (connect, subscribe).
        tls: connect over TLS, verifying the broker against the system's CAs (True),
            or with this `ssl.SSLContext` as it is.
        ca_file: PEM file of the CA that signed the broker's certificate (implies TLS).
        cert_file: PEM client certificate to present (implies TLS); with `key_file`
            unless the file also holds the private key.
        key_file: PEM private key of `cert_file`.

    Use it as an async context manager; it is reusable (enter it again after it
    exited, e.g. after the broker connection was lost) but not re-entrant.
    """

    def __init__(  # noqa: PLR0913 - connection settings
        self,
        hostname: str = "127.0.0.1",
        port: int = 1883,
        *,
        username: str | None = None,
        password: str | None = None,
        topic_prefix: str = DEFAULT_PREFIX,
        identifier: str | None = None,
        timeout: float = 10.0,
        tls: bool | ssl.SSLContext = False,
        ca_file: str | os.PathLike[str] | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.hostname = hostname
        self.port = port
        self.topic_prefix = topic_prefix
        self._username = username
        self._password = password
        self._identifier = identifier
        self._timeout = timeout
        self._tls = _tls_context(tls, ca_file, cert_file, key_file)
        self._client: aiomqtt.Client | None = None
        self._reader: asyncio.Task[None] | None = None
        self._filters: dict[str, _Filter] = {}  # one broker subscription per filter
        self._routes: dict[int, _Filter] = {}  # subscription identifier -> its filter
        self._ids = itertools.count(1)
        self._failure: BaseException | None = None

    async def __aenter__(self) -> Self:
        if self._client is not None:
            raise RuntimeError("EventSubscriber is reusable but not re-entrant")
        client = aiomqtt.Client(
            self.hostname,
            self.port,
            username=self._username,
            password=self._password,
            identifier=self._identifier,
            protocol=aiomqtt.ProtocolVersion.V5,
            timeout=self._timeout,
            tls_context=self._tls,
        )
        try:
            await client.__aenter__()
        except aiomqtt.MqttCodeError as exc:
            if _code(exc.rc) in _LOGIN_REFUSED:
                raise PermissionDeniedError(
                    "PERMISSION_DENIED",
                    f"event broker {self.hostname}:{self.port} refused the log-in"
                    f"{f' of {self._username!r}' if self._username else ' (anonymous)'}: {exc}",
                ) from None
            raise UnavailableError(
                "UNAVAILABLE", f"event broker {self.hostname}:{self.port}: {exc}"
            ) from exc
        except aiomqtt.MqttError as exc:
            raise UnavailableError(
                "UNAVAILABLE", f"event broker {self.hostname}:{self.port}: {exc}"
            ) from exc
        self._client = client
        self._failure = None
        self._filters.clear()
        self._routes.clear()
        self._reader = asyncio.create_task(self._read(client), name="mqtt-events-reader")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        client, self._client = self._client, None
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for group in self._filters.values():
            for subscription in group.members:
                subscription.joined = 0
                subscription._deliver(_END)  # noqa: SLF001
        self._filters.clear()
        self._routes.clear()
        if client is not None:
            with contextlib.suppress(aiomqtt.MqttError, OSError):
                await client.__aexit__(exc_type, exc, tb)
            _read_disconnect_reason(client)

    # ------------------------------------------------------------------ public
    def completions(
        self, agent_id: str = "+", tenant: str = "+", session: str = "+"
    ) -> Subscription[CompletionEvent]:
        """Completions of matching jobs ("+" matches any agent, tenant or session id)."""
        prefix = self.topic_prefix
        topic_filter = "/".join(
            (
                prefix,
                "agents",
                _level(agent_id, "agent_id"),
                "tenants",
                _level(tenant, "tenant"),
                "sessions",
                _level(session.removeprefix("sessions/"), "session"),
                "jobs",
                "+",
                "completion",
            )
        )
        return Subscription(
            self, topic_filter, lambda m: parse_completion(str(m.topic), _bytes(m), prefix)
        )

    def statuses(self, agent_id: str = "+") -> Subscription[AgentStatus]:
        """Status changes of an agent ("+": of every agent), starting with the retained one."""
        prefix = self.topic_prefix
        topic_filter = f"{prefix}/agents/{_level(agent_id, 'agent_id')}/status"
        return Subscription(
            self,
            topic_filter,
            lambda m: parse_status(str(m.topic), _bytes(m), prefix, retained=m.retain),
        )

    def telemetry(self, agent_id: str = "+") -> Subscription[Telemetry]:
        """Telemetry reports of an agent ("+": of every agent)."""
        prefix = self.topic_prefix
        topic_filter = f"{prefix}/agents/{_level(agent_id, 'agent_id')}/telemetry"
        return Subscription(
            self, topic_filter, lambda m: parse_telemetry(str(m.topic), _bytes(m), prefix)
        )

    async def agent_status(self, agent_id: str, wait: float = 1.0) -> AgentStatus | None:
        """The agent's retained status; None if the broker has none within `wait` s."""
        if agent_id == "+":
            raise InvalidArgumentError("INVALID_ARGUMENT", "agent_status takes one agent id")
        async with self.statuses(agent_id) as statuses:
            try:
                async with asyncio.timeout(wait):
                    return await anext(statuses)
            except TimeoutError:
                return None

    # ------------------------------------------------------------------ internals
    def _connected(self) -> aiomqtt.Client:
        if self._failure is not None:
            raise UnavailableError("UNAVAILABLE", f"event broker connection lost: {self._failure}")
        if self._client is None:
            raise RuntimeError("use EventSubscriber as an async context manager")
        return self._client

    async def _subscribe(self, subscription: Subscription[Any]) -> None:
        client = self._connected()
        if subscription.joined:
            return
        topic_filter = subscription.topic_filter
        group = self._filters.setdefault(topic_filter, _Filter())
        identifier = next(self._ids)
        group.members.append(subscription)
        group.identifiers.append(identifier)
        self._routes[identifier] = group
        subscription.joined = identifier
        properties = Properties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]
        properties.SubscriptionIdentifier = identifier
        try:
            granted = await client.subscribe(topic_filter, qos=1, properties=properties)
        except aiomqtt.MqttError as exc:
            self._leave(subscription)
            raise UnavailableError("UNAVAILABLE", f"subscribe failed: {exc}") from exc
        if any(_code(code) == _NOT_AUTHORIZED for code in granted):
            self._leave(subscription)
            raise PermissionDeniedError(
                "PERMISSION_DENIED", f"the broker's ACL refused {topic_filter!r}: {granted}"
            )
        if any(_refused(code) for code in granted):
            self._leave(subscription)
            raise UnavailableError("UNAVAILABLE", f"the broker refused {topic_filter!r}: {granted}")

    def _leave(self, subscription: Subscription[Any]) -> bool:
        """Forget a subscription; True if it was its filter's last one."""
        subscription.joined = 0
        group = self._filters.get(subscription.topic_filter)
        if group is None or subscription not in group.members:
            return False
        group.members.remove(subscription)
        if group.members:
            return False
        del self._filters[subscription.topic_filter]
        for identifier in group.identifiers:
            self._routes.pop(identifier, None)
        return True

    async def _unsubscribe(self, subscription: Subscription[Any]) -> None:
        if not subscription.joined:
            return
        last = self._leave(subscription)
        subscription._deliver(_END)  # noqa: SLF001
        client = self._client
        if last and client is not None and self._failure is None:
            with contextlib.suppress(aiomqtt.MqttError):
                await client.unsubscribe(subscription.topic_filter)

    async def _read(self, client: aiomqtt.Client) -> None:
        try:
            async for message in client.messages:
                identifiers = getattr(message.properties, "SubscriptionIdentifier", None) or []
                for identifier in identifiers:
                    group = self._routes.get(identifier)
                    if group is not None:
                        group.deliver(message, identifier)
        except aiomqtt.MqttError as exc:
            self._failure = exc
            error = UnavailableError("UNAVAILABLE", f"event broker connection lost: {exc}")
            for group in self._filters.values():
                for subscription in group.members:
                    subscription._deliver(error)  # noqa: SLF001


@dataclasses.dataclass
class _Filter:
    """The local subscriptions sharing one topic filter (one broker subscription)."""

    members: list[Subscription[Any]] = dataclasses.field(default_factory=list)
    identifiers: list[int] = dataclasses.field(default_factory=list)

    def deliver(self, message: aiomqtt.Message, identifier: int) -> None:
        """Pass a message to the members that subscribed for it.

        Live messages go to every member; a retained copy (RETAIN set: MQTT 5 clears
        it on live messages) only to the member whose SUBSCRIBE made the broker send it.
        """
        for subscription in self.members:
            if not message.retain or subscription.joined == identifier:
                subscription._deliver(message)  # noqa: SLF001


def _read_disconnect_reason(client: aiomqtt.Client) -> None:
    """Mark the reason a connection ended as read.

    aiomqtt 2.5 keeps it in a future that its __aexit__ skips when the link is already
    down; unread, asyncio logs "Future exception was never retrieved".
    """
    reason = client._disconnected  # noqa: SLF001 - see above
    if reason.done() and not reason.cancelled():
        reason.exception()


def _bytes(message: aiomqtt.Message) -> bytes:
    return bytes(message.payload)


def _code(code: int | ReasonCode | None) -> int | None:
    return code.value if isinstance(code, ReasonCode) else code


def _refused(code: int | ReasonCode) -> bool:
    """Whether a SUBACK code refuses the subscription (0x80 and up)."""
    value = _code(code)
    return value is not None and value >= 0x80


def _tls_context(
    tls: bool | ssl.SSLContext,  # noqa: FBT001 - one keyword argument of EventSubscriber
    ca_file: str | os.PathLike[str] | None,
    cert_file: str | os.PathLike[str] | None,
    key_file: str | os.PathLike[str] | None,
) -> ssl.SSLContext | None:
    """The TLS context the options ask for; None for a plain TCP connection."""
    if isinstance(tls, ssl.SSLContext):
        if ca_file or cert_file or key_file:
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", "give either an SSLContext or ca_file/cert_file/key_file"
            )
        return tls
    if not (tls or ca_file or cert_file or key_file):
        return None
    if key_file and not cert_file:
        raise InvalidArgumentError("INVALID_ARGUMENT", "key_file needs cert_file")
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise InvalidArgumentError("INVALID_ARGUMENT", f"TLS files: {exc}") from None
    context.sslsocket_class = _ClosingSSLSocket
    return context


class _ClosingSSLSocket(ssl.SSLSocket):
    """Closes itself when the TLS handshake fails.

    paho-mqtt 2.2 drops the socket without closing it when `do_handshake` raises
    (an untrusted broker, say), leaking a file descriptor per failed connection.
    """

    def do_handshake(self, block: bool = False) -> None:  # noqa: FBT001, FBT002 - the base's signature
        try:
            super().do_handshake(block)
        except BaseException:
            self.close()
            raise
