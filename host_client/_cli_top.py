"""`dpuctl top`: a live view of one agent, from its Prometheus metrics endpoint.

Every `--interval` seconds it scrapes the endpoint and shows what changed since the
last scrape: jobs/s and bytes/s by job kind, the latency percentiles of the jobs that
finished in the interval (from the histogram's buckets: "<= bound"), failed jobs, the
sessions and jobs in flight against the queue slots, data-plane errors and the MQTT
backlog. Plain text redrawn with two ANSI codes, so it works over SSH and in tmux;
`--once` prints one interval and exits, `--json` prints it as JSON for scripts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Final

from prometheus_client.parser import text_string_to_metric_families

from host_client._display import printable
from host_client._errors import InvalidArgumentError, UnavailableError

if TYPE_CHECKING:
    import argparse

    from host_client._client import Client

PREFIX: Final = "dpu_agent_"
DEFAULT_METRICS_PORT: Final = 9464
MAX_BODY: Final = 16 << 20  # a metrics page larger than this is not an agent's
QUANTILES: Final = (0.5, 0.9, 0.99)
CLEAR: Final = "\x1b[H\x1b[2J"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `top` command."""
    top = sub.add_parser(
        "top",
        help="live view of the agent: jobs/s, bytes/s, latency, queue, errors, MQTT backlog",
        description="Scrape the agent's Prometheus endpoint every --interval seconds and "
        "show the rates of the last interval. Ctrl-C stops it.",
    )
    top.add_argument(
        "--metrics",
        metavar="URL",
        help=f"the agent's metrics URL (default: http://HOST:{DEFAULT_METRICS_PORT}/metrics, "
        "HOST from --target)",
    )
    top.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    top.add_argument("--once", action="store_true", help="show one interval and exit")
    top.add_argument("--json", dest="top_json", action="store_true", help="JSON (implies --once)")


def metrics_url(target: str, given: str | None) -> str:
    """The URL to scrape: the one given, or the default port on the target's host."""
    if given:
        if urllib.parse.urlsplit(given).scheme not in ("http", "https"):
            raise InvalidArgumentError(
                "INVALID_ARGUMENT", f"--metrics must be an http URL: {given}"
            )
        return given
    host = target.rpartition(":")[0] or "127.0.0.1"
    return f"http://{host}:{DEFAULT_METRICS_PORT}/metrics"


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """The agent's samples: (name, sorted labels) -> value."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - http(s) only
            body = reply.read(MAX_BODY + 1)
    except OSError as exc:
        raise UnavailableError(
            "UNAVAILABLE", f"cannot read the agent's metrics at {url}: {exc} (set --metrics URL)"
        ) from None
    if len(body) > MAX_BODY:
        raise UnavailableError("UNAVAILABLE", f"{url} answered more than {MAX_BODY} bytes")
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
        for sample in family.samples:
            if sample.name.startswith(PREFIX):
                key = (sample.name.removeprefix(PREFIX), tuple(sorted(sample.labels.items())))
                samples[key] = sample.value
    return samples


def _sum(samples: Samples, name: str, **match: str) -> dict[str, float]:
    """Values of `name` summed by the label named in `match` ("*": group by it)."""
    (group,) = [k for k, v in match.items() if v == "*"] or [""]
    totals: dict[str, float] = defaultdict(float)
    for (sample, labels), value in samples.items():
        if sample != name:
            continue
        found = dict(labels)
        if all(v == "*" or found.get(k) == v for k, v in match.items()):
            totals[found.get(group, "")] += value
    return dict(totals)


def _delta(new: Samples, old: Samples, name: str, **match: str) -> dict[str, float]:
    after, before = _sum(new, name, **match), _sum(old, name, **match)
    return {k: max(v - before.get(k, 0.0), 0.0) for k, v in after.items()}


def _quantiles(new: Samples, old: Samples, kind: str) -> dict[str, float | None]:
    """Upper bounds (seconds) of the buckets holding p50, p90, p99 of the interval's jobs."""
    buckets: list[tuple[float, float]] = []
    for (sample, labels), value in new.items():
        found = dict(labels)
        if sample == "job_duration_seconds_bucket" and found.get("kind") == kind:
            bound = math.inf if found["le"] == "+Inf" else float(found["le"])
            buckets.append((bound, value - old.get((sample, labels), 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    found_q: dict[str, float | None] = {}
    for q in QUANTILES:
        found_q[f"p{round(q * 100)}"] = next(
            (b for b, count in buckets if total and count >= q * total), None
        )
    return found_q


@dataclasses.dataclass
class View:
    """One interval of the agent, as `top` shows it."""

    url: str
    seconds: float
    kinds: dict[str, dict[str, Any]]
    sessions_open: float
    jobs_in_flight: float
    job_slots: float
    failed_jobs_per_s: float
    dataplane_errors: float
    bytes_read_per_s: float
    bytes_written_per_s: float
    mqtt_backlog: float | None
    mqtt_connected: bool | None

    @classmethod
    def between(cls, url: str, old: Samples, new: Samples, seconds: float) -> View:
        """The view of the interval from `old` to `new`."""
        per_s = 1 / max(seconds, 1e-9)
        jobs = _delta(new, old, "jobs_total", kind="*")
        failed = sum(
            v
            for (name, labels), v in new.items()
            if name == "jobs_total" and dict(labels).get("status") != "OK"
        ) - sum(
            v
            for (name, labels), v in old.items()
            if name == "jobs_total" and dict(labels).get("status") != "OK"
        )
        moved = _delta(new, old, "dataplane_bytes_total", direction="*")
        kind_bytes = _delta(new, old, "job_bytes_total", kind="*")  # read + written
        kinds = {
            kind: {
                "jobs_per_s": count * per_s,
                "bytes_per_s": kind_bytes.get(kind, 0.0) * per_s,
                **_quantiles(new, old, kind),
            }
            for kind, count in sorted(jobs.items())
        }
        backlog = new.get(("mqtt_backlog", ()))
        connected = new.get(("mqtt_connected", ()))
        return cls(
            url=url,
            seconds=seconds,
            kinds=kinds,
            sessions_open=sum(_sum(new, "sessions_open", transport="*").values()),
            jobs_in_flight=new.get(("jobs_in_flight", ()), 0.0),
            job_slots=new.get(("job_slots", ()), 0.0),
            failed_jobs_per_s=max(failed, 0.0) * per_s,
            dataplane_errors=sum(_sum(new, "dataplane_errors_total", transport="*").values()),
            bytes_read_per_s=moved.get("read", 0.0) * per_s,  # the agent READ host memory
            bytes_written_per_s=moved.get("written", 0.0) * per_s,  # ... and WROTE it
            mqtt_backlog=backlog,
            mqtt_connected=None if connected is None else bool(connected),
        )

    def text(self) -> str:
        """The screen."""
        lines = [
            f"dpuctl top  {self.url}  every {self.seconds:.1f} s  {time.strftime('%H:%M:%S')}",
            (
                f"sessions {self.sessions_open:.0f}   jobs in flight {self.jobs_in_flight:.0f}"
                f"/{self.job_slots:.0f} slots   failed jobs/s {self.failed_jobs_per_s:.1f}"
                f"   data-plane errors {self.dataplane_errors:.0f}"
            ),
            (
                f"host memory read {_rate(self.bytes_read_per_s)}   "
                f"written {_rate(self.bytes_written_per_s)}   "
                f"MQTT {_mqtt(self.mqtt_connected, self.mqtt_backlog)}"
            ),
            "",
            f"{'KIND':<14}{'JOBS/S':>10}{'MIB/S':>10}{'P50':>10}{'P90':>10}{'P99':>10}",
        ]
        for kind, row in self.kinds.items():
            if row["jobs_per_s"] == 0:
                continue
            label = printable(kind)  # a label of the agent's metrics
            lines.append(
                f"{label:<14}{row['jobs_per_s']:>10.1f}{row['bytes_per_s'] / (1 << 20):>10.1f}"
                + "".join(f"{_ms(row[q]):>10}" for q in ("p50", "p90", "p99"))
            )
        if all(row["jobs_per_s"] == 0 for row in self.kinds.values()):
            lines.append("(no jobs finished in this interval)")
        return "\n".join(lines)


def _finite(value: Any) -> Any:  # noqa: ANN401 - JSON-shaped data
    """`value` with infinite floats (a latency past the last bucket) as None: valid JSON."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and math.isinf(value):
        return None
    return value


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / (1 << 20):.1f} MiB/s"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return "> max"
    return f"<={seconds * 1000:g}ms"


def _mqtt(connected: bool | None, backlog: float | None) -> str:  # noqa: FBT001 - values
    if connected is None:
        return "off"
    return f"{'connected' if connected else 'DISCONNECTED'}, backlog {backlog or 0:.0f}"


async def run(client: Client, args: argparse.Namespace) -> int:
    """Show the agent until Ctrl-C, or one interval with --once / --json."""
    if not 0.1 <= args.interval <= 3600:
        raise InvalidArgumentError("INVALID_ARGUMENT", "--interval is 0.1 to 3600 seconds")
    url = metrics_url(client.target, args.metrics)
    old = await asyncio.to_thread(scrape, url)
    then = time.monotonic()
    while True:
        await asyncio.sleep(args.interval)
        new = await asyncio.to_thread(scrape, url)
        now = time.monotonic()
        view = View.between(url, old, new, now - then)
        old, then = new, now
        if args.top_json or args.json:
            print(json.dumps(_finite(dataclasses.asdict(view)), sort_keys=True))
            return 0
        if args.once:
            print(view.text())
            return 0
        sys.stdout.write(CLEAR + view.text() + "\n")
        sys.stdout.flush()
