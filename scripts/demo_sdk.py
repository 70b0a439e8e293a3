"""The SDK part of `make demo`: the product's story, each step with what it proves.

    demo_sdk.py TARGET --broker-port P --metrics-url URL --workdir DIR \
        --other-cert PEM --other-key PEM [--transport auto|tcp|verbs]

The caller's TLS files come from $DPU_TLS_CA, $DPU_TLS_CERT, $DPU_TLS_KEY (tenant
"demo"); --other-cert/--other-key are a second tenant's. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zstandard
from prometheus_client.parser import text_string_to_metric_families

import host_client

if TYPE_CHECKING:
    from host_client import Buffer, Session

MiB = 1 << 20
FILE_BYTES = 16 * MiB
CHUNK = MiB
VOLUME = "volumes/demo-vol"
BAR = 30
METRIC_FAMILIES = (
    "dpu_agent_jobs_total",
    "dpu_agent_dataplane_bytes_total",
    "dpu_agent_mqtt_events_published_total",
    "dpu_agent_volume_bytes_total",
)


class DemoFailedError(Exception):
    """A check of the demo did not hold."""


def step(title: str, proves: str) -> float:
    """Print a step's title and what it proves; return its start time."""
    print(f"\n== {title}\n   proves: {proves}")
    return time.monotonic()


def done(start: float, text: str) -> None:
    """Print the outcome of a step and how long it took."""
    print(f"   {text}  [{time.monotonic() - start:.2f} s]")


def check(condition: bool, what: str) -> None:  # noqa: FBT001 - reads as a sentence
    """Fail the demo unless `condition` holds."""
    if not condition:
        raise DemoFailedError(what)


def progress(label: str, done_bytes: int, total: int, started: float) -> None:
    """A one-line progress bar, redrawn in place."""
    if done_bytes < total and not sys.stdout.isatty():
        return  # a log gets the final line only
    filled = BAR * done_bytes // total
    rate = done_bytes / MiB / max(time.monotonic() - started, 1e-6)
    end = "\n" if done_bytes >= total else ""
    bar = "#" * filled + "." * (BAR - filled)
    mib = f"{done_bytes / MiB:5.1f}/{total / MiB:.0f} MiB"
    print(f"\r   {label} [{bar}] {mib} {rate:6.1f} MiB/s", end=end, flush=True)


def make_input(path: Path) -> bytes:
    """A host file worth compressing: half log-like text, half random bytes."""
    text = b"".join(
        f"{i:08d} sensor={i % 97:02d} reading={(i * 7919) % 10007:05d} ok\n".encode()
        for i in range(FILE_BYTES // 2 // 40 + 1)
    )[: FILE_BYTES // 2]
    data = text + os.urandom(FILE_BYTES - len(text))
    path.write_bytes(data)
    return data


async def write_file(session: Session, src: Buffer, path: Path) -> None:
    """The host file onto the volume, chunk by chunk, through the data plane."""
    started = time.monotonic()
    with path.open("rb") as f:
        offset = 0
        while chunk := f.read(CHUNK):
            src.view[: len(chunk)] = chunk
            await session.write_volume(VOLUME, offset, src[0 : len(chunk)])
            offset += len(chunk)
            progress("write", offset, FILE_BYTES, started)
    await (await session.submit_volume_flush(VOLUME))


async def read_file(session: Session, dst: Buffer, path: Path) -> None:
    """The volume back into a host file, chunk by chunk, through the data plane."""
    started = time.monotonic()
    with path.open("wb") as f:
        for offset in range(0, FILE_BYTES, CHUNK):
            await session.read_volume(VOLUME, offset, dst[0:CHUNK])
            f.write(dst.view[:CHUNK])
            progress("read ", offset + CHUNK, FILE_BYTES, started)


def metrics(url: str) -> dict[str, float]:
    """The agent's Prometheus samples, "name{labels}" -> value."""
    with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - the agent's http URL
        text = reply.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


class Watchers:
    """Completion events of one session, from MQTT and from the gRPC stream."""

    def __init__(self) -> None:
        self.mqtt: set[int] = set()
        self.grpc: set[int] = set()
        self.changed = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def start(
        self, client: host_client.Client, stream: host_client.Subscription[Any], session: str
    ) -> None:
        """Read both streams in the background."""

        async def grpc() -> None:
            async for completion in client.watch_completions(session):
                self.grpc.add(completion.job_id)
                self.changed.set()

        async def mqtt() -> None:
            async for event in stream:
                self.mqtt.add(event.job_id)
                self.changed.set()

        self.tasks = [asyncio.create_task(grpc()), asyncio.create_task(mqtt())]
        await asyncio.sleep(0.2)  # both streams open before the first job

    async def wait_for(self, jobs: set[int], timeout: float) -> None:  # noqa: ASYNC109
        """Until both streams saw `jobs` (or `timeout` passed), then stop reading."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not (jobs <= self.mqtt and jobs <= self.grpc):
                    self.changed.clear()
                    await self.changed.wait()
        for task in self.tasks:
            if task.done() and task.exception() is not None:
                raise DemoFailedError(f"an event stream failed: {task.exception()!r}")
            task.cancel()


async def connect(client: host_client.Client, events: host_client.EventSubscriber) -> None:
    """Step: who we are and who the agent is."""
    t = step(
        "connect as tenant demo over mTLS",
        "the client certificate's CN is the tenant; the agent serves only mTLS here",
    )
    await client.wait_ready(10)
    info = await client.agent_info()
    done(t, f"{info.name} {info.version} on {info.hostname}, health {await client.health()}")
    status = await events.agent_status(info.name.removeprefix("agents/"), wait=10)
    check(status is not None and status.online, "the agent's status on MQTT")
    print("   MQTT: the agent's retained status message says it is online")


async def volume_round_trip(
    client: host_client.Client, session: Session, src: Buffer, dst: Buffer, work: Path
) -> bytes:
    """Steps: the volume with its data services, a host file written and read back."""
    t = step(
        "a volume with CRC32C + zstd compression + AES-XTS-256 encryption",
        "the data services run on the DPU: the host writes plain bytes",
    )
    await client.create_volume(
        "demo-vol", FILE_BYTES, crc32c=True, compression="zstd", encryption="aes-xts-256"
    )
    done(t, f"{VOLUME}: {FILE_BYTES // MiB} MiB, its key generated and sealed by the agent")
    t = step(
        f"write a {FILE_BYTES // MiB} MiB host file to it, read it back into another",
        "the data plane moves the bytes; each block is checksummed, compressed and "
        "encrypted on the way in, checked and decrypted on the way out",
    )
    original = make_input(work / "input.bin")
    await write_file(session, src, work / "input.bin")
    await read_file(session, dst, work / "output.bin")
    back = (work / "output.bin").read_bytes()
    check(back == original, "the file read back differs from the one written")
    stats = (await client.get_volume(VOLUME)).stats
    done(
        t,
        f"{work / 'output.bin'} is byte for byte {work / 'input.bin'} "
        f"(sha256 {hashlib.sha256(back).hexdigest()[:16]}...); {stats.write_ops} writes, "
        f"{stats.read_ops} reads counted by the volume",
    )
    return original


async def compute(session: Session, src: Buffer, dst: Buffer, data: bytes) -> int:
    """Step: a compute job checked against the library; returns its job id."""
    t = step(
        "a compute job: zstd-compress 1 MiB of the file on the DPU",
        "the result is a standard zstd frame: the zstandard library decompresses it",
    )
    src.view[:] = data[:CHUNK]
    packed = await session.compute("compress", src, dst, parameter="zstd")
    frame = bytes(dst.view[: packed.bytes_written])
    check(zstandard.decompress(frame) == data[:CHUNK], "the library's zstd round trip")
    done(t, f"{CHUNK} bytes -> {packed.bytes_written} bytes; the library gets the input back")
    return packed.job_id


def show_metrics(url: str) -> None:
    """Step: the agent's own counters."""
    t = step("the metrics that counted them", "Prometheus /metrics on the agent")
    for name, value in sorted(metrics(url).items()):
        if name.startswith(METRIC_FAMILIES) and value:
            print(f"   {name} {int(value)}")
    done(t, f"scraped {url}")


async def other_tenant(target: str, cert: str, key: str) -> None:
    """Step: the second tenant sees nothing of the first."""
    t = step("a second tenant (other) is refused", "tenants are isolated on one agent")
    tls = host_client.TlsConfig(ca=os.environ["DPU_TLS_CA"], cert=cert, key=key)
    async with host_client.Client(target, tls=tls) as other:
        check(await other.list_volumes() == [], "tenant other sees volumes")
        print("   as other: list_volumes() -> []")
        try:
            await other.get_volume(VOLUME)
        except host_client.NotFoundError as exc:
            print(f"   as other: get_volume({VOLUME!r}) -> {exc.code}: {exc.message}")
        else:
            raise DemoFailedError("tenant other read tenant demo's volume")
    done(t, "refused")


async def story(args: argparse.Namespace) -> None:
    """Each step of the demo, in order."""
    transport = args.transport
    async with (
        host_client.Client(args.target) as client,
        host_client.EventSubscriber("127.0.0.1", args.broker_port) as events,
    ):
        await connect(client, events)
        t = step("open a data-plane session", "the host's buffers are registered with the DPU")
        async with (
            await client.open_session(transport=transport, label="demo") as session,
            events.completions(session=session.name) as stream,
        ):
            done(t, f"{session.name} over {session.transport}")
            watchers = Watchers()
            await watchers.start(client, stream, session.name)
            src = await session.alloc(CHUNK, readable=True)
            dst = await session.alloc(CHUNK, writable=True)
            data = await volume_round_trip(client, session, src, dst, Path(args.workdir))
            last = await compute(session, src, dst, data)
            t = step(
                "the completion events: on MQTT and on the gRPC stream",
                "each job's completion arrives once on each, with the same job ids",
            )
            jobs = set(range(1, last + 1))  # a session numbers its jobs 1, 2, ...
            await watchers.wait_for(jobs, timeout=10)
            check(
                watchers.mqtt == watchers.grpc == jobs,
                f"completion events: jobs {sorted(jobs)}, on MQTT {sorted(watchers.mqtt)}, "
                f"on gRPC {sorted(watchers.grpc)}",
            )
            done(t, f"{len(jobs)} jobs: {len(watchers.mqtt)} on MQTT, {len(watchers.grpc)} on gRPC")
        show_metrics(args.metrics_url)
    await other_tenant(args.target, args.other_cert, args.other_key)


def main() -> int:
    """Parse the arguments and tell the story."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target")
    parser.add_argument("--broker-port", type=int, required=True)
    parser.add_argument("--metrics-url", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--other-cert", required=True)
    parser.add_argument("--other-key", required=True)
    parser.add_argument(
        "--transport", default="auto", choices=["auto", "tcp", "verbs"], help="the session's"
    )
    args = parser.parse_args()
    try:
        asyncio.run(story(args))
    except (DemoFailedError, host_client.DpuError) as exc:
        print(f"\ndemo: FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
