"""The event plane's access control: a real mosquitto running deploy/mosquitto/dpu.acl.

Accounts are made with deploy/mosquitto/mqtt_users.py: the agents' account
(`dpu-agent`, the only writer), an observer (`dpu-observer`, reads everything) and
tenants, whose user name is their tenant id. Each test that says a tenant receives
*nothing* of another tenant's also shows that the same subscription does receive that
tenant's own events, published after the others, so that "nothing" means something.

`test_a_real_agent_completions_reach_only_their_tenant` runs an agent process logged
in as `dpu-agent`, with two tenants calling it with bearer tokens: their sessions'
jobs produce the completions. The other tests, about the broker's rules rather than
the agent, publish with `PublisherSource`: the agent's own event publisher
(`MqttEventPublisher`, in this process, logged in as `dpu-agent`) with sessions of
several tenants, which is quicker and lets a test interleave tenants freely.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import getpass
import importlib.util
import json
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import aiomqtt
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

import host_client
from dpu_agent.dataplane.jobs import JobRecord, Origin
from dpu_agent.events import MqttEventPublisher, MqttSettings
from dpu_wire import events as payloads
from dpu_wire import names
from dpu_wire.capsule import JobKind, Span, State
from host_client import EventSubscriber, PermissionDeniedError, UnavailableError
from tests.integration.conftest import AgentProcess, start_agent, tokens_file
from tests.integration.mqtt_broker import (
    HOST,
    BrokerAuth,
    BrokerTls,
    MosquittoBroker,
    free_port,
    running_broker,
)
from tests.integration.pki import LabPki, make_pki

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
ACL = ROOT / "deploy/mosquitto/dpu.acl"
USERS_TOOL = ROOT / "deploy/mosquitto/mqtt_users.py"
SECURE_CONF = ROOT / "deploy/mosquitto/mosquitto-secure.conf"
BIN = Path(sys.executable).parent
AGENT_USER = "dpu-agent"
OBSERVER = "dpu-observer"
TENANTS = ("acme", "globex", "default")
AGENT = "dpu-0"  # the in-process publisher's agent id
REAL_AGENT = "acl-agent"  # the agent process's
PREFIX = payloads.DEFAULT_PREFIX
WAIT = 10.0  # seconds any one condition may take before the test fails
NOT_AUTHORIZED = 135  # MQTT 5 PUBACK / CONNACK reason code
MARKER = 1_000_000  # job id of the last completion a test publishes for a tenant


# ---------------------------------------------------------------------- accounts
def users_tool(
    passwd: Path, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run deploy/mosquitto/mqtt_users.py on a password file, with the shipped ACL."""
    return subprocess.run(
        [sys.executable, str(USERS_TOOL), "--passwd", str(passwd), "--acl", str(ACL), *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def _load_users_tool() -> Any:
    spec = importlib.util.spec_from_file_location("mqtt_users", USERS_TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


USERS = _load_users_tool()  # its functions, for fixtures (the tests below run the command)


@dataclasses.dataclass
class Accounts:
    """A password file made by the users tool and the passwords it made."""

    passwd: Path
    passwords: dict[str, str]

    def add(self, name: str, *, service: bool = False) -> str:
        password = USERS.add(self.passwd, ACL, name, service=service)
        assert isinstance(password, str)
        assert len(password) >= 32, "the tool should make a fresh password"
        self.passwords[name] = password
        return password


def make_accounts(directory: Path) -> Accounts:
    accounts = Accounts(directory / "passwd", {})
    accounts.add(AGENT_USER, service=True)
    accounts.add(OBSERVER, service=True)
    for tenant in TENANTS:
        accounts.add(tenant)
    return accounts


@dataclasses.dataclass
class SecureBroker:
    """A broker that requires log-ins and applies the shipped ACL."""

    broker: MosquittoBroker
    accounts: Accounts

    @property
    def port(self) -> int:
        return self.broker.port

    def password(self, user: str) -> str:
        return self.accounts.passwords[user]

    def subscriber(self, user: str, **options: Any) -> EventSubscriber:
        options.setdefault("port", self.port)
        return EventSubscriber(
            HOST, username=user, password=self.password(user), timeout=WAIT, **options
        )

    def client(self, user: str, **options: Any) -> aiomqtt.Client:
        """A raw MQTT 5 client logged in as `user`."""
        return aiomqtt.Client(
            HOST,
            options.pop("port", self.port),
            username=user,
            password=self.password(user),
            protocol=aiomqtt.ProtocolVersion.V5,
            timeout=WAIT,
            **options,
        )


@pytest.fixture
def secure(tmp_path) -> Iterator[SecureBroker]:
    accounts = make_accounts(tmp_path)
    auth = BrokerAuth(accounts.passwd, ACL)
    with running_broker(tmp_path, auth=auth) as broker:
        yield SecureBroker(broker, accounts)


# ---------------------------------------------------------------------- sources of completions
def session_of(tenant: str) -> types.SimpleNamespace:
    """What the publisher reads of a session: its tenant and id."""
    return types.SimpleNamespace(session_id=f"s-{tenant}", tenant=tenant)


def finished_job(job_id: int) -> JobRecord:
    job = JobRecord(job_id, JobKind.CRC32C, Span(0x1000, 512, 1), Span(), Origin.CAPSULE, 0.0)
    job.start()
    job.bytes_read = 512
    job.result = job_id
    job.finish(State.SUCCEEDED)
    return job


def job_name(tenant: str, job_id: int) -> str:
    return f"sessions/s-{tenant}/jobs/{job_id}"


class PublisherSource:
    """Tenants' completions from the agent's event publisher, logged in as the agents.

    Stands in for an agent with sessions of several tenants (see the module docstring).
    """

    def __init__(self, secure: SecureBroker, agent_id: str = AGENT, **settings: Any) -> None:
        self.publisher = MqttEventPublisher(
            MqttSettings(
                port=settings.pop("port", secure.port),
                username=AGENT_USER,
                password=secure.password(AGENT_USER),
                client_id=f"test-publisher-{agent_id}",
                telemetry_interval=0.0,
                reconnect_min=0.05,
                reconnect_max=0.2,
                **settings,
            ),
            agent_id,
        )
        self.sessions = {tenant: session_of(tenant) for tenant in TENANTS}

    async def __aenter__(self) -> Self:
        await self.publisher.__aenter__()
        async with asyncio.timeout(WAIT):
            await self.publisher.wait_connected()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.publisher.__aexit__(None, None, None)

    def complete(self, tenant: str, job_ids: range | list[int]) -> list[str]:
        """Publish completions of these jobs of `tenant`'s session; their job names."""
        for job_id in job_ids:
            self.publisher.publish_completion(self.sessions[tenant], finished_job(job_id))
        return [job_name(tenant, job_id) for job_id in job_ids]


# ---------------------------------------------------------------------- helpers
async def collect(iterator: Any, last: Callable[[Any], bool], within: float = WAIT) -> list[Any]:
    """Items of an async iterator up to and including the first for which `last` is true."""
    items: list[Any] = []
    try:
        async with asyncio.timeout(within):
            async for item in iterator:
                items.append(item)
                if last(item):
                    return items
    except TimeoutError:
        pytest.fail(f"timed out after {within} s; received so far: {items}")
    pytest.fail(f"the stream ended early; received: {items}")


async def take(iterator: Any, count: int, within: float = WAIT) -> list[Any]:
    """The next `count` items of an async iterator."""
    seen = 0

    def last(_item: object) -> bool:
        nonlocal seen
        seen += 1
        return seen == count

    return await collect(iterator, last, within)


def is_marker(tenant: str) -> Callable[[Any], bool]:
    """For `collect`: the tenant's marker completion (an event or a raw message)."""
    suffix = f"/tenants/{tenant}/sessions/s-{tenant}/jobs/{MARKER}/completion"

    def last(item: Any) -> bool:
        if isinstance(item, aiomqtt.Message):
            return str(item.topic).endswith(suffix)
        return bool(item.tenant == tenant and item.job_id == MARKER)

    return last


def publish_as(
    port: int, user: str, password: str, messages: list[tuple[str, bytes, bool]]
) -> list[int]:
    """Publish (topic, payload, retain) at QoS 1 as `user` over MQTT 5 with paho.

    Returns each PUBACK's reason code: 0 when the broker took the message, 135 when
    its ACL refused it (aiomqtt does not show PUBACK codes).
    """
    acks: dict[int, int] = {}
    connected = threading.Event()
    done = threading.Condition()
    client = paho.Client(
        CallbackAPIVersion.VERSION2, client_id=f"writer-{user}", protocol=paho.MQTTv5
    )
    client.username_pw_set(user, password)

    def on_connect(*_args: Any) -> None:
        connected.set()

    def on_publish(_c: Any, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        with done:
            acks[mid] = int(reason.value)
            done.notify_all()

    client.on_connect = on_connect
    client.on_publish = on_publish
    client.connect(HOST, port)
    client.loop_start()
    try:
        assert connected.wait(WAIT), f"{user} could not connect"
        mids = [client.publish(t, p, qos=1, retain=r).mid for t, p, r in messages]
        with done:
            assert done.wait_for(lambda: all(m in acks for m in mids), WAIT), "no PUBACK"
        return [acks[m] for m in mids]
    finally:
        client.disconnect()
        client.loop_stop()


# ---------------------------------------------------------------------- tenant isolation
@pytest.mark.asyncio
async def test_each_tenant_receives_only_its_own_completions(secure):
    count = 20
    async with (
        secure.client(OBSERVER) as observer,
        secure.client("globex") as globex_raw,
        secure.subscriber("acme") as acme,
        secure.subscriber("globex") as globex,
        acme.completions() as acme_stream,  # every tenant: the broker filters
        globex.completions() as globex_stream,
        globex.completions(tenant="acme") as globex_spying,  # acme's topics, by name
        PublisherSource(secure) as source,
    ):
        await observer.subscribe("#", qos=1)
        await globex_raw.subscribe("#", qos=1)
        sent: dict[str, list[str]] = {"acme": [], "globex": []}
        for first in range(0, count, 5):  # interleaved
            for tenant in sent:
                sent[tenant] += source.complete(tenant, range(first, first + 5))
        # The observer sees everything, acme's completions too: they were published.
        seen = await collect(
            observer.messages, lambda m: str(m.topic).endswith(f"/jobs/{count - 1}/completion")
        )
        # Telemetry (every tenant's figures) goes out before the last completions.
        async with secure.client(AGENT_USER, identifier="test-telemetry") as agent:
            await agent.publish(
                payloads.telemetry_topic(PREFIX, AGENT), b'{"agent":"dpu-0"}', qos=1
            )
        for tenant in sent:
            sent[tenant] += source.complete(tenant, [MARKER])

        acme_got = await collect(acme_stream, is_marker("acme"))
        globex_got = await collect(globex_stream, is_marker("globex"))
        globex_all = await collect(globex_raw.messages, is_marker("globex"))
        await collect(observer.messages, is_marker("globex"))
        # globex's marker came after every acme completion; a filter on acme's topics
        # would have delivered them by now. Close it and look at what it holds.
    spied = [item async for item in globex_spying]

    assert [e.job for e in acme_got] == sent["acme"]
    assert {e.tenant for e in acme_got} == {"acme"}
    assert [e.job for e in globex_got] == sent["globex"]
    assert spied == []
    topics = [str(m.topic) for m in globex_all]
    assert all("/tenants/globex/" in t or t.endswith("/status") for t in topics), topics
    assert payloads.status_topic(PREFIX, AGENT) in topics  # status is for everyone
    assert len([t for t in topics if "/tenants/" in t]) == count + 1
    observed = {str(m.topic) for m in seen}
    assert any("/tenants/acme/" in t for t in observed)


def start_tenants_agent(
    secure: SecureBroker, tmp_path: Path
) -> tuple[AgentProcess, dict[str, str]]:
    """An agent logged in to the broker as the agents' account, serving loopback with
    a bearer token per tenant (`[auth] tokens_file`); returns it and the tokens."""
    password_file = tmp_path / "agent.secret"
    password_file.write_text(secure.password(AGENT_USER) + "\n")
    path, tokens = tokens_file(tmp_path, "acme", "globex")
    agent = start_agent(
        tmp_path,
        env={
            "DPU_AGENT_ID": REAL_AGENT,
            "DPU_AGENT_MQTT_ENABLED": "true",
            "DPU_AGENT_MQTT_PORT": str(secure.port),
            "DPU_AGENT_MQTT_USERNAME": AGENT_USER,
            "DPU_AGENT_MQTT_PASSWORD_FILE": str(password_file),
            "DPU_AGENT_MQTT_TELEMETRY_INTERVAL": "0",
            "DPU_AGENT_AUTH_TOKENS_FILE": str(path),
        },
    )
    return agent, tokens


async def run_jobs(agent: AgentProcess, token: str, count: int) -> list[str]:
    """Run CRC32C jobs in a new session as the token's tenant; the jobs' names."""
    async with (
        host_client.Client(agent.address, token=token) as client,
        await client.open_session(transport="tcp") as session,
    ):
        src = await session.alloc(4096, readable=True)
        jobs = [await session.submit_crc32c(src) for _ in range(count)]
        for job in jobs:
            (await job).raise_for_status()
        return [f"{session.name}/jobs/{job.job_id}" for job in jobs]


@pytest.mark.asyncio
async def test_a_real_agent_completions_reach_only_their_tenant(secure, tmp_path):
    agent, tokens = start_tenants_agent(secure, tmp_path)
    count = 3
    try:
        async with (
            secure.client("globex") as globex_raw,
            secure.subscriber("acme") as acme,
            secure.subscriber("globex") as globex,
            acme.completions() as acme_stream,
            globex.completions() as globex_stream,
            globex.completions(tenant="acme") as globex_spying,
        ):
            await globex_raw.subscribe("#", qos=1)
            status = await globex.agent_status(REAL_AGENT, wait=WAIT)  # tenants see status
            assert status is not None
            assert status.online
            acme_jobs = await run_jobs(agent, tokens["acme"], count)
            acme_got = await take(acme_stream, count)  # so the broker has published them
            globex_jobs = await run_jobs(agent, tokens["globex"], count)
            globex_got = await take(globex_stream, count)
            last = f"/tenants/globex/{globex_jobs[-1]}/completion"
            globex_all = await collect(globex_raw.messages, lambda m: str(m.topic).endswith(last))
        spied = [item async for item in globex_spying]
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()

    assert [e.job for e in acme_got] == acme_jobs
    assert {(e.tenant, e.agent_id) for e in acme_got} == {("acme", REAL_AGENT)}
    assert [e.job for e in globex_got] == globex_jobs
    assert {e.tenant for e in globex_got} == {"globex"}
    assert spied == []
    topics = [str(m.topic) for m in globex_all]
    assert [t for t in topics if "/tenants/" in t and "/tenants/globex/" not in t] == [], topics
    assert payloads.status_topic(PREFIX, REAL_AGENT) in topics
    assert "not authorized" not in agent.log_path.read_text().lower()


# ---------------------------------------------------------------------- log-ins
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("user", "password"),
    [
        (None, None),  # anonymous
        ("acme", "wrong"),
        ("nobody", "whatever"),
        ("acme", ("globex",)),  # another account's password
        (AGENT_USER, ""),
    ],
)
async def test_log_ins_without_the_right_password_are_refused(secure, user, password):
    if isinstance(password, tuple):
        password = secure.password(*password)
    subscriber = EventSubscriber(HOST, secure.port, username=user, password=password)
    with pytest.raises(PermissionDeniedError, match="refused the log-in") as info:
        async with subscriber:
            pass
    if password:
        assert password not in info.value.message


@pytest.mark.asyncio
async def test_anonymous_mqtt_3_clients_are_refused_too(secure):
    client = aiomqtt.Client(HOST, secure.port, protocol=aiomqtt.ProtocolVersion.V311)
    with pytest.raises(aiomqtt.MqttCodeError) as info:
        async with client:
            pass
    assert "Not authorized" in str(info.value)  # CONNACK 5, which paho names as MQTT 5's 135


# ---------------------------------------------------------------------- writers
@pytest.mark.asyncio
@pytest.mark.parametrize("writer", ["acme", "globex", OBSERVER])
async def test_only_the_agents_may_publish(secure, writer):
    fake_status = payloads.status_payload("offline", AGENT, "6.6.6", 1, "shutdown")
    fake_completion = b'{"job":"sessions/s-acme/jobs/7","job_id":7,"state":"FAILED"}'
    fakes = [
        (payloads.status_topic(PREFIX, AGENT), fake_status, True),
        (payloads.completion_topic(PREFIX, AGENT, "acme", "s-acme", 7), fake_completion, False),
        (payloads.completion_topic(PREFIX, AGENT, "globex", "s-globex", 7), fake_completion, False),
        (payloads.telemetry_topic(PREFIX, AGENT), b"{}", False),
        (f"{PREFIX}/agents/{AGENT}/commands", b"{}", False),
        ("elsewhere/entirely", b"{}", False),
    ]
    async with (
        secure.client(OBSERVER) as observer,
        secure.subscriber("acme") as acme,
        acme.completions() as acme_stream,
        PublisherSource(secure) as source,
    ):
        await observer.subscribe("#", qos=1)
        await collect(observer.messages, lambda m: m.retain)  # the genuine status, retained
        codes = await asyncio.to_thread(
            publish_as, secure.port, writer, secure.password(writer), fakes
        )
        assert codes == [NOT_AUTHORIZED] * len(fakes)
        # Published after the fakes were refused: had one got through, it came first.
        source.complete("acme", [MARKER])
        got = await collect(observer.messages, is_marker("acme"))
        acme_got = await collect(acme_stream, is_marker("acme"))
        assert [str(m.topic) for m in got] == [str(got[-1].topic)]
        assert [e.job_id for e in acme_got] == [MARKER]
        status = await acme.agent_status(AGENT, wait=WAIT)
    assert status is not None
    assert status.state == "online"
    assert status.version != "6.6.6"


@pytest.mark.asyncio
async def test_the_agents_account_may_publish(secure):
    topic = payloads.completion_topic(PREFIX, AGENT, "acme", "s-acme", 1)
    codes = await asyncio.to_thread(
        publish_as, secure.port, AGENT_USER, secure.password(AGENT_USER), [(topic, b"{}", False)]
    )
    assert codes[0] < 0x80  # 16, "no matching subscribers": taken. 135 above is the ACL


# ---------------------------------------------------------------------- the users tool
@pytest.mark.parametrize("name", ["+", "#", "a/b", "Acme", "", "-acme", "acme-", "a" * 64, "ac me"])
def test_users_tool_takes_only_tenant_ids(tmp_path, name):
    passwd = tmp_path / "passwd"
    proc = users_tool(passwd, "add", "--", name)
    assert proc.returncode == 1
    assert "lowercase DNS label" in proc.stderr
    assert not passwd.exists()


def test_users_tool_keeps_tenants_and_service_accounts_apart(tmp_path):
    passwd = tmp_path / "passwd"
    refused = users_tool(passwd, "add", AGENT_USER)
    assert refused.returncode == 1
    assert "--service" in refused.stderr
    refused = users_tool(passwd, "add", "acme", "--service")
    assert refused.returncode == 1
    assert "no `user acme` block" in refused.stderr
    added = users_tool(passwd, "add", "acme")
    assert added.returncode == 0, added.stderr
    assert len(added.stdout.split()) == 1  # the new password, alone on stdout
    assert len(added.stdout.strip()) == 32
    again = users_tool(passwd, "add", "acme")
    assert again.returncode == 1
    assert "--replace" in again.stderr
    given = users_tool(passwd, "add", "acme", "--replace", "--password-file", "-", stdin="s3cret\n")
    assert given.returncode == 0, given.stderr
    assert given.stdout == ""  # a given password is not echoed
    assert users_tool(passwd, "add", AGENT_USER, "--service").returncode == 0
    listing = users_tool(passwd, "list")
    assert listing.stdout.splitlines() == ["acme\ttenant", f"{AGENT_USER}\tservice"]
    assert "s3cret" not in passwd.read_text()  # hashed
    assert passwd.stat().st_mode & 0o077 == 0
    assert users_tool(passwd, "remove", "acme").returncode == 0
    assert users_tool(passwd, "list").stdout.splitlines() == [f"{AGENT_USER}\tservice"]
    assert users_tool(passwd, "remove", "acme").returncode == 1


def test_users_tool_names_are_the_api_ids():
    assert USERS.NAME_PATTERN == names.ID_PATTERN


@pytest.mark.asyncio
async def test_a_tenant_added_or_removed_counts_after_a_broker_reload(secure):
    async def logs_in(user: str, password: str) -> bool:
        try:
            async with EventSubscriber(HOST, secure.port, username=user, password=password):
                return True
        except PermissionDeniedError:
            return False

    async def after_reload(user: str, password: str, *, expected: bool) -> None:
        assert secure.broker.proc is not None
        secure.broker.proc.send_signal(signal.SIGHUP)
        async with asyncio.timeout(WAIT):
            while await logs_in(user, password) != expected:  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.05)

    password = secure.accounts.add("initech")
    assert not await logs_in("initech", password)  # not yet: the broker has the old file
    await after_reload("initech", password, expected=True)
    assert users_tool(secure.accounts.passwd, "remove", "initech").returncode == 0
    await after_reload("initech", password, expected=False)


# ---------------------------------------------------------------------- TLS
def broker_certificate(pki: LabPki) -> tuple[Path, Path]:
    """The broker's certificate and key: the lab PKI's server certificate for 127.0.0.1."""
    return pki.directory / "agent.pem", pki.directory / "agent.key"


def client_files(tls: host_client.TlsConfig) -> dict[str, Any]:
    """EventSubscriber's TLS options for a client certificate of the lab PKI."""
    return {"ca_file": tls.ca, "cert_file": tls.cert, "key_file": tls.key}


def tls_listener(pki: LabPki, **options: bool) -> BrokerTls:
    cert, key = broker_certificate(pki)
    return BrokerTls(free_port(), pki.ca, cert, key, **options)


@contextlib.contextmanager
def tls_broker(tmp_path: Path, **options: bool) -> Iterator[tuple[SecureBroker, LabPki, int]]:
    accounts = make_accounts(tmp_path)
    pki = make_pki(tmp_path / "pki")
    tls = tls_listener(pki, **options)
    auth = BrokerAuth(accounts.passwd, ACL)
    # Subscriptions are logged too, for `wait_for_subscription`.
    broker = MosquittoBroker(tmp_path, auth=auth, tls=tls, extra_config="log_type subscribe")
    broker.start()
    try:
        yield SecureBroker(broker, accounts), pki, tls.port
    finally:
        broker.stop()


@pytest.mark.asyncio
async def test_tls_with_a_password_and_a_verified_broker(tmp_path):
    with tls_broker(tmp_path) as (secure, pki, tls_port):
        async with (
            secure.subscriber("acme", port=tls_port, ca_file=pki.ca) as acme,
            acme.completions() as stream,
            PublisherSource(secure) as source,
        ):
            source.complete("globex", range(3))
            source.complete("acme", [MARKER])
            got = await collect(stream, is_marker("acme"))
        assert [e.job for e in got] == [job_name("acme", MARKER)]
        # The system's CAs do not know the test CA: the broker is not trusted.
        with pytest.raises(UnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
            async with secure.subscriber("acme", port=tls_port, tls=True):
                pass
        with pytest.raises(PermissionDeniedError):
            async with EventSubscriber(HOST, tls_port, ca_file=pki.ca):  # anonymous
                pass


@pytest.mark.asyncio
async def test_a_client_certificate_names_the_tenant(tmp_path):
    with tls_broker(tmp_path, use_identity_as_username=True) as (secure, pki, tls_port):
        async with (
            EventSubscriber(HOST, tls_port, **client_files(pki.client("acme"))) as acme,
            acme.completions() as stream,
            PublisherSource(secure) as source,
        ):
            source.complete("globex", range(3))
            source.complete("acme", [MARKER])
            got = await collect(stream, is_marker("acme"))
        assert [e.job for e in got] == [job_name("acme", MARKER)]
        # A certificate for acme from a CA the broker does not know, and none at all.
        # The broker drops the TLS connection; aiomqtt waits for a CONNACK until its
        # timeout (short here), so the broker's log tells why.
        rogue = make_pki(tmp_path / "rogue").client("acme")
        refused = [{**client_files(rogue), "ca_file": pki.ca}, {"ca_file": pki.ca}]
        for options in refused:
            with pytest.raises(UnavailableError):
                async with EventSubscriber(HOST, tls_port, timeout=2.0, **options):
                    pass
        log = secure.broker.log()
        assert "certificate verify failed" in log
        assert "peer did not return a certificate" in log


def test_tls_options_are_checked_before_connecting(tmp_path):
    with pytest.raises(host_client.InvalidArgumentError, match="key_file needs cert_file"):
        EventSubscriber(key_file=tmp_path / "x.key")
    with pytest.raises(host_client.InvalidArgumentError, match="TLS files"):
        EventSubscriber(ca_file=tmp_path / "missing.pem")


# ---------------------------------------------------------------------- the shipped config
def adapt_shipped_config(
    text: str, listeners: list[str], files: dict[str, Path], workdir: Path
) -> str:
    """deploy/mosquitto/mosquitto-secure.conf with test addresses and paths.

    Only addresses, file locations and the log destination change; every other line
    (access, limits) is the shipped one.
    """
    ports = iter(listeners)
    lines = []
    for line in text.splitlines():
        key = line.split(maxsplit=1)[0] if line.strip() else ""
        if key == "listener":
            lines.append(f"listener {next(ports)}")
        elif key in files:
            lines.append(f"{key} {files[key]}")
        elif key == "persistence_location":
            lines.append(f"persistence_location {workdir}/")
        elif key == "log_dest":
            lines.append("log_dest stderr")
        else:
            lines.append(line)
    assert next(ports, None) is None, "the shipped config has fewer listeners than expected"
    return "\n".join([*lines, f"user {getpass.getuser()}"]) + "\n"


@pytest.mark.asyncio
async def test_the_shipped_secure_config_works_as_documented(tmp_path):
    accounts = make_accounts(tmp_path)
    pki = make_pki(tmp_path / "pki")
    cert, key = broker_certificate(pki)
    plain, tls_port = free_port(), free_port()
    text = adapt_shipped_config(
        SECURE_CONF.read_text(),
        [f"{plain} {HOST}", f"{tls_port} {HOST}"],
        {
            "password_file": accounts.passwd,
            "acl_file": ACL,
            "certfile": cert,
            "keyfile": key,
            "cafile": pki.ca,
        },
        tmp_path,
    )
    broker = MosquittoBroker(tmp_path, port=plain, config_text=text)
    broker.start()
    try:
        secure = SecureBroker(broker, accounts)
        async with (
            PublisherSource(secure) as source,  # the agent: plain TCP, password
            secure.subscriber("acme", port=tls_port, ca_file=pki.ca) as acme,  # a host: TLS
            acme.completions() as stream,
        ):
            source.complete("globex", range(3))
            source.complete("acme", [MARKER])
            got = await collect(stream, is_marker("acme"))
        assert [e.job for e in got] == [job_name("acme", MARKER)]
        tries: list[tuple[int, dict[str, Any]]] = [(plain, {}), (tls_port, {"ca_file": pki.ca})]
        for port, options in tries:
            with pytest.raises(PermissionDeniedError):
                async with EventSubscriber(HOST, port, **options):  # anonymous
                    pass
    finally:
        broker.stop()
    assert "Error" not in broker.log(), broker.log()


# ---------------------------------------------------------------------- dpuctl events
@pytest.mark.asyncio
async def test_dpuctl_events_logs_in_and_sees_what_its_tenant_may(tmp_path):
    with tls_broker(tmp_path) as (secure, pki, tls_port):
        secret = tmp_path / "acme.secret"
        secret.write_text(secure.password("acme") + "\n")
        login = [
            "--broker", f"{HOST}:{tls_port}", "--username", "acme",
            "--password-file", str(secret), "--ca-file", str(pki.ca),
        ]  # fmt: skip
        async with PublisherSource(secure) as source:
            status = await run_dpuctl("events", *login)
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout) == {"agent": AGENT, "state": "online"}

            follower = await asyncio.create_subprocess_exec(
                str(BIN / "dpuctl"), "events", *login, "--follow", "--count", "2",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                await wait_for_subscription(secure.broker, "acme", "/completion")
                source.complete("globex", range(3))  # first: a leak would be printed first
                source.complete("acme", [1, MARKER])
                out, err = await asyncio.wait_for(follower.communicate(), WAIT)
            finally:
                if follower.returncode is None:
                    follower.kill()
                    await follower.wait()
            assert follower.returncode == 0, err
            jobs = [json.loads(line)["job"] for line in out.decode().splitlines()]
            assert jobs == [job_name("acme", 1), job_name("acme", MARKER)]

        secret.write_text("wrong\n")
        refused = await run_dpuctl("events", *login)
        assert refused.returncode != 0
        assert "PERMISSION_DENIED" in refused.stderr
        assert "wrong" not in refused.stderr


async def run_dpuctl(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "dpuctl"), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


async def wait_for_subscription(broker: MosquittoBroker, user: str, ending: str) -> None:
    """Wait until a client logged in as `user` subscribed to a filter with this ending.

    The broker logs "New client connected ... u'<user>'" with the client id, and with
    `log_type subscribe` each subscription as "<client id> <qos> <filter>".
    """
    async with asyncio.timeout(WAIT):
        while True:
            log = broker.log()
            clients = [
                line.split(" as ", 1)[1].split(" ", 1)[0]
                for line in log.splitlines()
                if "New client connected" in line and f"u'{user}'" in line
            ]
            subscribed = [
                line
                for line in log.splitlines()
                for c in clients
                if f" {c} 1 {PREFIX}/" in line and line.endswith(ending)
            ]
            if subscribed:
                return
            await asyncio.sleep(0.05)
