"""Secrets never leave the agent: not in its logs, errors, events, metrics or RPC answers.

A real agent process runs with every secret it can hold in use, for a tenant calling
it over mTLS (its TLS private key) or with a bearer token on loopback:

- an encrypted volume with a key the tenant gave, and one with a key the agent made,
  both sealed under the store's master.key (dpu_agent/storage/keys.py), written and
  read back;
- an AES-GCM key registered for compute jobs (`Session.register_key`), used to encrypt
  and decrypt, and to fail a decryption of tampered data;
- the broker password it logs in to mosquitto with (`[mqtt] password_file`);
- calls that fail *because* of a secret: a volume key and a compute key of the wrong
  size, a duplicate volume with its key, a wrong bearer token.

The agent logs at debug level. Afterwards everything it produced is searched: its
stdout/stderr, every MQTT message an observer subscribed to "#" received (status,
completions, telemetry), the broker's log, every RPC answer and error the test got
(serialized), the completions of the data plane, the text of its /metrics endpoint
and `dpu-agent check-config`'s output. Each secret is looked for raw, in hex (either
case), in base64 (standard and URL-safe, at the three alignments a slice can start
at), as Python escapes it (`repr`, also inside a JSON string), and as any slice of
8 bytes or more in those forms.
The search's own tests plant each form and check that it is found.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiomqtt
import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf import json_format, message

import host_client
from dpu_agent.storage import FileVolumeStore
from dpu_agent.storage.keys import KeySealer
from dpu_wire.v1 import job_pb2, session_pb2
from host_client import _certs
from tests.integration.conftest import AgentProcess, start_agent
from tests.integration.mqtt_broker import HOST, BrokerAuth, running_broker
from tests.integration.pki import make_pki
from tests.integration.test_mqtt_acl import ACL, AGENT_USER, OBSERVER, make_accounts

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

BIN = Path(sys.executable).parent
WAIT = 10.0
MiB = 1 << 20
AGENT_ID = "leak-agent"
TENANT = "acme"
RAW_SLICE = 8  # bytes: the shortest slice of a secret that counts as a leak
HEX_SLICE = 2 * RAW_SLICE
BASE64_SLICE = 12  # characters: 9 bytes
ESCAPED_SLICE = 24  # characters of Python's escaped form (\x9c is 4 for 1 byte)


# ---------------------------------------------------------------------- the search
@dataclasses.dataclass(frozen=True)
class Secret:
    """Bytes that must not appear anywhere, and strings that must not appear verbatim."""

    name: str
    value: bytes
    verbatim: tuple[bytes, ...] = ()


def _slices(form: str, text: bytes, length: int) -> Iterator[tuple[str, bytes]]:
    if len(text) <= length:
        yield form, text
        return
    for start in range(len(text) - length + 1):
        yield form, text[start : start + length]


def needles(secret: Secret) -> list[tuple[str, bytes]]:
    """(form, bytes to look for) of every form and slice of a secret.

    Hex needles are lower-case and are looked for in a lower-cased copy of the text.
    A base64 needle is a run of whole 4-character groups of the encoding of the
    secret from offset 0, 1 or 2: any slice of 9 or more bytes, encoded, contains one.
    """
    value = secret.value
    found = list(_slices("raw", value, RAW_SLICE))
    found += _slices("hex", value.hex().encode(), HEX_SLICE)
    for shift in range(3):
        for form, encode in (
            ("base64", base64.b64encode),
            ("base64url", base64.urlsafe_b64encode),
        ):
            text = encode(value[shift:])
            whole_groups = text[: len(text) // 4 * 4].rstrip(b"=")
            found += _slices(form, whole_groups, BASE64_SLICE)
    escaped = repr(value)[2:-1]
    found += _slices("escaped", escaped.encode(), ESCAPED_SLICE)
    found += _slices("escaped in JSON", json.dumps(escaped)[1:-1].encode(), ESCAPED_SLICE)
    found += [("verbatim", text) for text in secret.verbatim]
    return list(dict.fromkeys(found))  # no duplicates, in order


def find_leaks(secrets: list[Secret], sources: Mapping[str, bytes]) -> list[str]:
    """Where any form of any secret appears in the sources: one line per (secret, form, source)."""
    prepared = [(secret, needles(secret)) for secret in secrets]
    leaks = []
    for source, text in sources.items():
        lowered = text.lower()
        for secret, forms in prepared:
            reported = set()
            for form, needle in forms:
                haystack = lowered if form == "hex" else text
                at = haystack.find(needle)
                if at < 0 or form in reported:
                    continue
                reported.add(form)
                context = text[max(0, at - 40) : at + len(needle) + 40]
                leaks.append(f"{secret.name} ({form}) in {source} at byte {at}: {context!r}")
    return leaks


# ---------------------------------------------------------------------- the search can fail
PLANTED = Secret("planted", bytes(range(7, 71)))  # 64 bytes with every byte value class


def _plant(form: str) -> bytes:
    value = PLANTED.value
    part = value[13:37]  # a slice: 24 bytes starting at an odd offset
    forms = {
        "raw": value,
        "raw slice": part,
        "hex": value.hex().encode(),
        "HEX slice": part.hex().upper().encode(),
        "base64": base64.b64encode(value),
        "base64 slice at +1": base64.b64encode(value[1:30]),
        "base64 slice at +2": base64.b64encode(value[2:30]),
        "base64url slice": base64.urlsafe_b64encode(part),
        "escaped in a log line": json.dumps({"msg": f"key={part!r}"}).encode(),
        "hex in a JSON log line": json.dumps({"key": part.hex()}).encode(),
        "in a protobuf": session_pb2.RegisterKeyRequest(key=part).SerializeToString(),
        "in protobuf JSON": json_format.MessageToJson(
            session_pb2.RegisterKeyRequest(key=part)
        ).encode(),
    }
    return forms[form]


@pytest.mark.parametrize(
    "form",
    [
        "raw",
        "raw slice",
        "hex",
        "HEX slice",
        "base64",
        "base64 slice at +1",
        "base64 slice at +2",
        "base64url slice",
        "escaped in a log line",
        "hex in a JSON log line",
        "in a protobuf",
        "in protobuf JSON",
    ],
)
def test_the_search_finds_a_planted_secret(form):
    noise = os.urandom(4096)
    planted = noise[:1000] + _plant(form) + noise[1000:]
    leaks = find_leaks([PLANTED], {"sample": planted})
    assert leaks, f"the search missed the secret planted as {form}"
    assert all(leak.startswith("planted (") for leak in leaks)


def test_the_search_finds_verbatim_strings_and_passwords():
    password = Secret("password", b"Xq3-kP9_vL2mW8zR")
    pem = Secret("pem", b"\x00" * 8, verbatim=(b"MHcCAQEEIBv0",))
    sample = b'{"msg":"login","user":"dpu-agent","pw":"kP9_vL2mW8"} -----MHcCAQEEIBv0-----'
    leaks = find_leaks([password, pem], {"log": sample})
    assert [leak.split(" in ")[0] for leak in leaks] == ["password (raw)", "pem (verbatim)"]


def test_the_search_does_not_flag_unrelated_data():
    sample = os.urandom(1 << 20) + json.dumps({"key": os.urandom(64).hex()}).encode()
    assert find_leaks([Secret("fresh", os.urandom(64))], {"noise": sample}) == []


# ---------------------------------------------------------------------- what the test got back
class RecordingClient(host_client.Client):
    """A Client that keeps every unary answer and error it got, serialized."""

    def __init__(self, *args: Any, record: list[bytes], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = record

    async def _call(self, method: Any, request: object, *, request_id: str | None = None) -> Any:
        try:
            reply = await super()._call(method, request, request_id=request_id)
        except host_client.DpuError as exc:
            self.record.append(_error_text(exc))
            raise
        if isinstance(reply, message.Message):
            self.record.append(reply.SerializeToString())
            self.record.append(json_format.MessageToJson(reply).encode())
        else:
            self.record.append(repr(reply).encode())
        return reply


def _error_text(exc: BaseException) -> bytes:
    """An SDK error with the gRPC error under it: status, details, trailers, debug text."""
    parts = [repr(exc), str(exc)]
    rpc = exc.__context__
    if isinstance(rpc, grpc.aio.AioRpcError):
        parts += [
            str(rpc.code()),
            str(rpc.details()),
            repr(rpc.trailing_metadata()),
            repr(rpc.initial_metadata()),
            str(rpc.debug_error_string()),
        ]
    return "\n".join(parts).encode()


async def expect_error(record: list[bytes], call: Any, code: str) -> None:
    """Await `call`; it must fail with `code` (the error is recorded as well)."""
    with pytest.raises(host_client.DpuError) as info:
        await call
    record.append(_error_text(info.value))
    assert info.value.code == code, info.value


# ---------------------------------------------------------------------- the agent and its secrets
@dataclasses.dataclass
class Run:
    """An agent with its secrets, and how a tenant calls it."""

    agent: AgentProcess
    store: Path
    env: dict[str, str]
    secrets: list[Secret]
    client_options: dict[str, Any]
    wrong_token: str | None = None


def key_secret(name: str, path: Path) -> Secret:
    """A PEM private key: its private scalar, and its PEM body lines verbatim."""
    pem = path.read_bytes()
    key = serialization.load_pem_private_key(pem, None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    scalar = key.private_numbers().private_value.to_bytes(32, "big")
    body = [line for line in pem.splitlines()[2:-1] if line]  # the lines past the key's type
    return Secret(name, scalar, tuple(body))


def start_run(tmp_path: Path, mode: str, broker_port: int, mqtt_password: str) -> Run:
    store = tmp_path / "store"
    password_file = tmp_path / "mqtt.secret"
    password_file.write_text(mqtt_password + "\n")
    env = {
        "DPU_AGENT_ID": AGENT_ID,
        "DPU_AGENT_STORAGE_DIR": str(store),
        "DPU_AGENT_MQTT_ENABLED": "true",
        "DPU_AGENT_MQTT_PORT": str(broker_port),
        "DPU_AGENT_MQTT_USERNAME": AGENT_USER,
        "DPU_AGENT_MQTT_PASSWORD_FILE": str(password_file),
        "DPU_AGENT_MQTT_TELEMETRY_INTERVAL": "0.2",
        "DPU_AGENT_LOG_LEVEL": "debug",
    }
    secrets = [Secret("the broker password", mqtt_password.encode())]
    client_options: dict[str, Any] = {}
    wrong_token = None
    pki = None
    if mode == "mtls":
        pki = make_pki(tmp_path / "pki")
        tls = pki.client(TENANT)
        assert tls.key is not None
        client_options["tls"] = tls
        secrets += [
            key_secret("the agent's TLS key", pki.directory / "agent.key"),
            key_secret("the tenant's TLS key", Path(tls.key)),
        ]
    else:
        token, entry = _certs.make_token(TENANT)
        wrong_token, _ = _certs.make_token(TENANT)  # never in the tokens file
        tokens_file = tmp_path / "tokens.toml"
        tokens_file.touch(mode=0o600)
        tokens_file.write_text(entry)
        env["DPU_AGENT_AUTH_TOKENS_FILE"] = str(tokens_file)
        env["DPU_AGENT_TLS_PLAINTEXT_LOOPBACK"] = "true"
        client_options["token"] = token
        secrets += [
            Secret("the tenant's bearer token", token.encode()),
            Secret("a wrong bearer token", wrong_token.encode()),
        ]
    agent = start_agent(tmp_path, env=env, pki=pki)
    if pki is not None:
        env |= pki.agent_env()  # for check-config
    return Run(agent, store, env, secrets, client_options, wrong_token)


async def use_every_secret(run: Run, record: list[bytes]) -> list[Secret]:
    """What a tenant does with secrets, including calls that fail because of one."""
    volume_key = os.urandom(64)  # AES-XTS: two keys (the halves differ, but for 2**-256)
    compute_key = os.urandom(32)
    data = os.urandom(64 << 10)
    async with RecordingClient(run.agent.address, record=record, **run.client_options) as client:
        record.append(json_format.MessageToJson(await client.agent_info()).encode())
        await client.create_volume(
            "given-key", 8 * MiB, crc32c=True, encryption="aes-xts-256", key=volume_key
        )
        await client.create_volume("made-key", 8 * MiB, encryption="aes-xts-256")
        await expect_error(
            record,
            client.create_volume("given-key", 8 * MiB, encryption="aes-xts-256", key=volume_key),
            "ALREADY_EXISTS",
        )
        await expect_error(
            record,
            client.create_volume("short", 8 * MiB, encryption="aes-xts-256", key=volume_key[:63]),
            "INVALID_ARGUMENT",
        )
        async with await client.open_session(transport="tcp") as session:
            watch = client.stubs.jobs.WatchCompletions(
                job_pb2.WatchCompletionsRequest(session=session.name)
            )
            watched: list[bytes] = []

            async def read_watch() -> None:
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                    async for completion in watch:
                        watched.append(completion.SerializeToString())
                        watched.append(json_format.MessageToJson(completion).encode())

            reader = asyncio.create_task(read_watch())
            src = await session.alloc(2 * len(data), readable=True)
            mid = await session.alloc(2 * len(data), readable=True, writable=True)
            out = await session.alloc(2 * len(data), writable=True)
            src.view[: len(data)] = data
            plain = src[0 : len(data)]
            for name in ("volumes/given-key", "volumes/made-key"):
                wrote = await session.write_volume(name, 0, plain, fua=True)
                read = await session.read_volume(name, 0, out[0 : len(data)])
                record += [repr(wrote).encode(), repr(read).encode()]
                assert out.view[: len(data)] == data
            handle = await session.register_key(compute_key)
            sealed = await session.compute("encrypt", plain, mid, parameter=handle)
            record.append(repr(sealed).encode())
            size = sealed.bytes_written
            opened = await session.compute("decrypt", mid[0:size], out, parameter=handle)
            record.append(repr(opened).encode())
            assert out.view[: len(data)] == data
            mid.view[100] ^= 0xFF
            await expect_error(
                record,
                session.compute("decrypt", mid[0:size], out, parameter=handle),
                "DATA_LOSS",
            )
            await expect_error(record, session.register_key(compute_key + b"!"), "INVALID_ARGUMENT")
            record += [json_format.MessageToJson(v).encode() for v in await client.list_volumes()]
            record.append(repr(await client.list_sessions()).encode())
            record.append(repr(await client.get_session(session.name)).encode())
            record.append(repr(await client.list_jobs(session.name)).encode())
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            record += watched
            assert watched, "WatchCompletions gave nothing: the search would miss its answers"
    if run.wrong_token is not None:
        options = {**run.client_options, "token": run.wrong_token}
        async with RecordingClient(run.agent.address, record=record, **options) as stranger:
            await expect_error(record, stranger.list_volumes(), "UNAUTHENTICATED")
    return [
        Secret("a volume key the tenant gave", volume_key),
        Secret("an AES-GCM compute key", compute_key),
    ]


def store_secrets(store: Path, given_key: bytes) -> list[Secret]:
    """The master key, and the volume key the agent made, unsealed from the store's metadata."""
    master = (store / "master.key").read_bytes()
    sealer = KeySealer(master)
    with FileVolumeStore(store) as opened:  # the agent has stopped: the store is free
        rows = {v: opened._state.volumes[v].sealed_key or b"" for v in ("given-key", "made-key")}
    assert sealer.unseal("given-key", rows["given-key"]) == given_key  # we read it right
    made = sealer.unseal("made-key", rows["made-key"])
    return [Secret("the store's master key", master), Secret("a volume key the agent made", made)]


def metrics_text(run: Run) -> bytes:
    with urllib.request.urlopen(run.agent.metrics_url(), timeout=WAIT) as reply:  # noqa: S310
        return bytes(reply.read())


def telemetry_after_last_job(messages: list[bytes]) -> bool:
    """Whether a telemetry report came after the DATA_LOSS completion (gRPC code 15)."""
    last = [i for i, m in enumerate(messages) if b"/completion" in m and b'"code":15' in m]
    return bool(last) and any(b"/telemetry" in m for m in messages[last[0] :])


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["mtls", "tokens"])
async def test_no_secret_leaves_the_agent(tmp_path, mode):
    accounts = make_accounts(tmp_path)
    auth = BrokerAuth(accounts.passwd, ACL)
    with running_broker(tmp_path, auth=auth) as broker:
        run = start_run(tmp_path, mode, broker.port, accounts.passwords[AGENT_USER])
        record: list[bytes] = []
        messages: list[bytes] = []
        metrics = b""
        try:
            async with aiomqtt.Client(
                HOST,
                broker.port,
                username=OBSERVER,
                password=accounts.passwords[OBSERVER],
                timeout=WAIT,
            ) as observer:
                await observer.subscribe("#", qos=1)

                async def listen() -> None:
                    async for m in observer.messages:
                        messages.append(  # noqa: PERF401 - runs until cancelled
                            f"{m.topic} {m.retain}\n".encode() + bytes(m.payload)
                        )

                listener = asyncio.create_task(listen())
                used = await use_every_secret(run, record)
                metrics = await asyncio.to_thread(metrics_text, run)
                # Wait for the failed decryption's completion (the last job), then for
                # a telemetry report made after it.
                async with asyncio.timeout(WAIT):
                    while not telemetry_after_last_job(messages):  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listener
        finally:
            code = run.agent.terminate()
        assert code == 0, run.agent.log_path.read_text()
        broker_log = broker.log()
    secrets = used + run.secrets + store_secrets(run.store, used[0].value)
    check = await asyncio.to_thread(
        subprocess.run,
        [str(BIN / "dpu-agent"), "check-config"],
        env={**os.environ, **run.env},
        capture_output=True,
        check=False,
        timeout=60,
    )
    sources = {
        "the agent's log": run.agent.log_path.read_bytes(),
        "the MQTT messages": b"\n".join(messages),
        "the broker's log": broker_log.encode(),
        "the RPC answers": b"\n".join(record),
        "the metrics": metrics,
        "check-config": check.stdout + check.stderr,
    }
    # Each source holds what it should, so finding nothing in it means something.
    log = sources["the agent's log"].decode()
    assert '"level": "debug"' in log, "the agent logged no debug lines"
    assert sum(b"/completion" in m for m in messages) >= 6
    assert b"dpu_agent_jobs_total" in metrics
    assert b"ALREADY_EXISTS" in sources["the RPC answers"]
    assert check.returncode == 0, check.stderr
    assert len(secrets) >= 6

    leaks = find_leaks(secrets, sources)
    assert leaks == [], "\n".join(leaks)
