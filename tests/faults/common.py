"""Helpers the fault and load tests share: bounded waits, the agent's memory, sessions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import host_client

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

MiB = 1 << 20
WAIT = 30.0  # seconds any one awaited condition may take before the test fails


async def until(
    predicate: Callable[[], Awaitable[bool]], what: str, within: float = WAIT, every: float = 0.1
) -> None:
    """Poll an async condition until it holds; fail with `what` after `within` seconds."""
    try:
        async with asyncio.timeout(within):
            while not await predicate():  # noqa: ASYNC110 - polls RPCs: no event to wait on
                await asyncio.sleep(every)
    except TimeoutError:
        raise AssertionError(f"timed out after {within} s waiting for: {what}") from None


def status_bytes(pid: int, field: str) -> int:
    """A memory field of /proc/PID/status (VmRSS, VmHWM, ...), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no {field} line")


def rss_bytes(pid: int) -> int:
    """VmRSS of a process, in bytes."""
    return status_bytes(pid, "VmRSS")


async def session_names(client: host_client.Client) -> set[str]:
    """The names of every session the agent has now."""
    return {s.name for s in await client.list_sessions()}


async def session_state(client: host_client.Client, name: str) -> int | None:
    """A session's state number (dpu.v1.SessionState), or None once the agent forgot it."""
    with contextlib.suppress(host_client.NotFoundError):
        return int((await client.get_session(name)).state)
    return None


def random_blocks(size: int) -> bytes:
    """Incompressible test data."""
    return os.urandom(size)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: str) -> Samples:
    """GET http://ADDRESS/metrics (the agent's Prometheus endpoint) and parse every sample."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 if none)."""
    want = set(labels.items())
    return sum(value for (n, have), value in samples.items() if n == name and want <= have)
