"""Where a 4 KiB copy job's time goes: a per-hop timeline of both processes, same run.

    python -m bench.hops [--transport verbs|tcp] [--jobs N] [--poll-mode MODE]

Starts an agent whose data-plane methods are wrapped to stamp `time.perf_counter_ns()`
(CLOCK_MONOTONIC, comparable across processes on one machine), runs N sequential copy
jobs from an SDK session wrapped the same way, and prints the median and p90 of each
hop:

    host   submit     the SDK encodes the SUBMIT and posts it        H0 -> H1
    wire   capsule    until the agent's reactor hands it over        H1 -> A0
    agent  admit      decode, admission, staging, READ posted        A0 -> A1
    wire   READ       the RDMA READ of 4 KiB, until its completion   A1 -> A2
    agent  complete   WRITE and COMPLETION posted                    A2 -> A3
    wire   completion until the SDK's link hands the capsule over    A3 -> H2
    host   wake       the awaiting task runs again                   H2 -> H3

The SDK sends a 4 KiB source inside the SUBMIT (docs/data-plane.md 2.8; both
transports): there is no READ, and the agent's rows are its whole job (A0 -> A3) and
`admit (Python)`; `--no-inline` measures the READ path instead. On verbs with the
native core (`dpu_wire/transport/native.py`) the agent runs an inline copy in C and its
pipeline never sees it: A0 and A3 are then the COMPLETION's own `submit_ns` and
`end_ns` (CLOCK_REALTIME, moved to the monotonic clock by the offset between the two
clocks read once), and the agent's `admit` row is absent.

and, per side, the time inside the job's span spent in posting (verbs: the
`ibv_post_send` of a prepared work request; tcp: the `sendmsg` of the queued frames),
in polling (verbs: the CQs; tcp: `recv` and frame parsing; empty polls included, the
callbacks they made excluded) and in the callbacks (the agent's pipeline, the SDK's
completion handler: the job logic, their posts included). A wire hop is everything
between the two stamps: the device or the kernel, and the receiving side's loop
until it looks (its wake-up, or the rest of a poll pass). Last, the CPU time each
thread of either process used per job during the run (from /proc), so a thread that
competes with the data plane for the GIL or the CPUs shows.

Nothing here changes the product: the wrappers are installed by this module only
(each costs a Python call and a clock read, a few microseconds under TCG, counted in
the hops they wrap). Needs an RDMA device for verbs: run it in the test VM
(`python3 deploy/testvm/testvm.py run -- .venv/bin/python -m bench.hops`).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

STAMPS_ENV: Final = "DPU_HOPS_FILE"
SWITCH_ENV: Final = "DPU_HOPS_SWITCH_INTERVAL"
HOPS: Final = (
    ("host", "submit", "H0", "H1"),
    ("wire", "capsule", "H1", "A0"),
    ("agent", "admit", "A0", "A1"),
    ("wire", "READ", "A1", "A2"),
    ("agent", "complete", "A2", "A3"),
    ("wire", "completion", "A3", "H2"),
    ("host", "wake", "H2", "H3"),
)

_stamps: list[tuple[str, int]] = []
_completed: list[tuple[int, int]] = []  # per job: the COMPLETION's (submit_ns, end_ns)


def _stamp(name: str) -> None:
    _stamps.append((name, time.perf_counter_ns()))


def _wrap(cls: Any, method: str, before: str | None, after: str | None) -> None:  # noqa: ANN401
    original = getattr(cls, method)

    def wrapped(self: object, *args: object, **kwargs: object) -> object:
        if before is not None:
            _stamp(before)
        result = original(self, *args, **kwargs)
        if after is not None:
            _stamp(after)
        return result

    setattr(cls, method, wrapped)


def _accumulate(cls: Any, method: str, key: str) -> None:  # noqa: ANN401
    """Stamp the time spent inside `method` as (key, ns) entries."""
    original = getattr(cls, method)

    def wrapped(self: object, *args: object, **kwargs: object) -> object:
        start = time.perf_counter_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            _stamps.append((key, time.perf_counter_ns() - start))

    setattr(cls, method, wrapped)


def _install_timers() -> None:
    """Time spent in posts and polls (both transports) and in the links' callbacks."""
    from dpu_wire.transport import tcp  # noqa: PLC0415

    _accumulate(tcp.FrameStream, "flush", "post")  # the sendmsg of what was queued
    _accumulate(tcp.FrameStream, "receive", "poll")
    try:
        from dpu_wire.transport.verbs import _QueuePair  # noqa: PLC0415
    except ImportError:
        return
    _accumulate(_QueuePair, "_post", "post")  # ibv_post_send of a prepared work request
    _accumulate(_QueuePair, "_native_chain", "post")  # the same through the native core
    _accumulate(_QueuePair, "_native_copy_send", "post")
    _accumulate(_QueuePair, "poll", "poll")


def _install_agent() -> None:
    from dpu_agent.dataplane.pipeline import Pipeline  # noqa: PLC0415
    from dpu_wire.transport import tcp  # noqa: PLC0415

    links: list[Any] = [tcp.TcpAgentLink]
    try:
        from dpu_wire.transport.verbs import VerbsAgentLink  # noqa: PLC0415

        links.append(VerbsAgentLink)
    except ImportError:
        pass
    _install_timers()
    _wrap(Pipeline, "on_capsule", "A0", None)
    _wrap(Pipeline, "_perform", "Ap", None)
    _wrap(Pipeline, "on_done", "A2", None)
    _accumulate(Pipeline, "on_capsule", "callbacks")
    _accumulate(Pipeline, "on_done", "callbacks")
    for link in links:
        _wrap(link, "post_read", None, "A1")
        _wrap(link, "post_send", None, "A3")


def _install_host() -> None:
    from dpu_wire.transport import tcp  # noqa: PLC0415
    from host_client._session import Session  # noqa: PLC0415

    links: list[Any] = [tcp.TcpHostLink]
    try:
        from dpu_wire.transport.verbs import VerbsHostLink  # noqa: PLC0415

        links.append(VerbsHostLink)
    except ImportError:
        pass
    _install_timers()
    for link in links:
        _wrap(link, "send", None, "H1")
    _wrap(Session, "_on_capsule", "H2", None)
    _accumulate(Session, "_on_capsule", "callbacks")


def _dump(path: str) -> None:
    Path(path).write_text(json.dumps(_stamps))


def agent_main() -> None:
    """The agent, wrapped (run as `python -m bench.hops agent ARGS...`)."""
    _install_agent()
    if os.environ.get(SWITCH_ENV):
        sys.setswitchinterval(float(os.environ[SWITCH_ENV]))
    atexit.register(_dump, os.environ[STAMPS_ENV])
    from dpu_agent.cli import main  # noqa: PLC0415

    sys.argv = ["dpu-agent", *sys.argv[2:]]
    code = main()
    _dump(os.environ[STAMPS_ENV])
    raise SystemExit(code)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) each thread of process `pid` used so far (from /proc).

    Keyed "main" for the main thread, else "<comm> <tid>" (Python threads are all named
    after the program there; gRPC's own threads have their own names).
    """
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        name = "main" if task.name == str(pid) else f"{comm} {task.name}"
        fields = stat[stat.rindex(")") + 2 :].split()
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return found


def cpu_rows(
    side: str, before: dict[str, float], after: dict[str, float], jobs: int, wall_s: float
) -> list[dict[str, Any]]:
    """Per thread of a process: CPU microseconds per job and share of the wall time."""
    rows = []
    for name in sorted(after, key=lambda n: before.get(n, 0.0) - after[n]):
        used = after[name] - before.get(name, 0.0)
        if used > 0:
            rows.append(
                {
                    "side": side,
                    "thread": name,
                    "cpu_us_per_job": round(used / jobs * 1e6, 1),
                    "cpu_share": round(used / wall_s, 3),
                }
            )
    return rows


_cpu: list[dict[str, Any]] = []


async def _client(target: str, transport: str, jobs: int, agent_pid: int, *, inline: bool) -> None:
    import host_client  # noqa: PLC0415

    async with (
        host_client.Client(target, timeout=60) as client,
        await client.open_session(transport=transport, queue_depth=4, inline=inline) as session,
    ):
        src = await session.alloc(4096, readable=True)
        dst = await session.alloc(4096, writable=True)
        request = session.copy_request(src, dst)
        for _ in range(50):  # warm up
            await (await session.submit(request))
        _stamps.clear()
        agent0, host0, start = thread_cpu(agent_pid), thread_cpu(os.getpid()), time.monotonic()
        for _ in range(jobs):
            _stamp("H0")
            job = await session.submit(request)
            done = await job
            _stamp("H3")
            _completed.append((done.submit_ns, done.end_ns))
        wall = time.monotonic() - start
        agent1, host1 = thread_cpu(agent_pid), thread_cpu(os.getpid())
        _cpu[:] = cpu_rows("agent", agent0, agent1, jobs, wall)
        _cpu.extend(cpu_rows("host", host0, host1, jobs, wall))


_TIMERS: Final = ("post", "poll", "callbacks")


def _jobs(stamps: list[tuple[str, int]], names: tuple[str, ...]) -> list[dict[str, int]]:
    """Group a process's stamps into jobs: each job starts at `names[0]`.

    The time spent in the timed verbs calls is summed per job (keys in `_TIMERS`,
    counted only between the job's first and last stamp).
    """
    jobs: list[dict[str, int]] = []
    for name, ns in stamps:
        if name == names[0]:
            jobs.append(dict.fromkeys(_TIMERS, 0))
        if not jobs:
            continue
        job = jobs[-1]
        if name in _TIMERS:
            if names[-1] not in job:
                job[name] += ns
        elif name in names and name not in job:
            job[name] = ns
    # the first and last stamps make a whole job; a job with no READ (an inline source)
    # has none of the READ's stamps
    return [job for job in jobs if names[0] in job and names[-1] in job]


def _drop_stray_reads(agent_jobs: list[dict[str, int]]) -> None:
    """A job with no READ (an inline source): an `on_done` in it is another operation's."""
    for job in agent_jobs:
        if "A1" not in job:
            job.pop("A2", None)


def report(
    host: list[tuple[str, int]],
    agent: list[tuple[str, int]],
    completed: list[tuple[int, int]] | None = None,
    realtime_offset: int = 0,
) -> list[dict[str, Any]]:
    """Per-hop median and p90 in microseconds over the jobs both sides recorded whole.

    `completed`: each host job's COMPLETION (submit_ns, end_ns), the agent's stamps of a
    job its pipeline never saw (the native core's), `realtime_offset` ns ahead of the
    monotonic clock.
    """
    host_jobs = [
        {f"host {k}" if k in _TIMERS else k: v for k, v in job.items()}
        for job in _jobs(host, ("H0", "H1", "H2", "H3"))
    ]
    agent_jobs = [
        {f"agent {k}" if k in _TIMERS else k: v for k, v in job.items()}
        for job in _jobs(agent, ("A0", "Ap", "A1", "A2", "A3"))
    ]
    _drop_stray_reads(agent_jobs)
    # agent jobs after the warm-up: match each host job to the agent job inside it
    merged: list[dict[str, int]] = []
    index = 0
    for number, job in enumerate(host_jobs):
        while index < len(agent_jobs) and agent_jobs[index]["A0"] < job["H1"]:
            index += 1
        if index < len(agent_jobs) and agent_jobs[index]["A3"] < job["H2"]:
            merged.append({**job, **agent_jobs[index]})
            index += 1
        elif completed and number < len(completed):  # the native core ran it
            submit_ns, end_ns = completed[number]
            times = {"A0": submit_ns - realtime_offset, "A3": end_ns - realtime_offset}
            merged.append({**job, **times, "agent post": 0, "agent poll": 0, "agent callbacks": 0})
    rows = []
    spans = [*HOPS, ("agent", "whole job", "A0", "A3"), ("total", "job", "H0", "H3")]
    spans += [("agent", "admit (Python)", "A0", "Ap"), ("agent", "post READ", "Ap", "A1")]
    for job in merged:  # a poll's time includes the callbacks it made: take them out
        for side in ("host", "agent"):
            job[f"{side} poll"] -= job[f"{side} callbacks"]
    for side in ("host", "agent"):
        spans += [
            (side, "in post", f"{side} post", ""),
            (side, "in poll", f"{side} poll", ""),
            (side, "in callbacks", f"{side} callbacks", ""),
        ]
    for side, hop, start, end in spans:
        values = sorted(
            ((job[end] - job[start]) if end else job[start]) / 1000
            for job in merged
            if start in job and (not end or end in job)
        )
        if not values:  # no READ hop: the SDK sends a 4 KiB source inline
            continue
        rows.append(
            {
                "side": side,
                "hop": hop,
                "p50_us": round(statistics.median(values), 1),
                "p90_us": round(values[int(len(values) * 0.9)], 1),
            }
        )
    return rows


def main() -> None:
    """Start the wrapped agent, run the wrapped client, print the hops."""
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        agent_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="verbs", choices=("verbs", "tcp"))
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--poll-mode", default="adaptive")
    parser.add_argument(
        "--no-inline", action="store_true", help="READ the source (no inline SUBMIT)"
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="the agent's sys.setswitchinterval in seconds (Python's default: 0.005), "
        "to see what the GIL's hand-offs between its threads cost",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        stamps = Path(tmp) / "agent.json"
        env = {
            **os.environ,
            STAMPS_ENV: str(stamps),
            "DPU_AGENT_STORAGE_DIR": f"{tmp}/volumes",
            "DPU_AGENT_TLS_PLAINTEXT_LOOPBACK": "1",
            "DPU_AGENT_TRANSPORTS": args.transport,
            # the agent's node (the VM's rxe0); the SDK binds $DPU_RDMA_DEVICE (rxe1)
            "DPU_AGENT_RDMA_DEVICE": os.environ.get("DPU_TEST_RDMA_DEVICE", ""),
            "DPU_AGENT_POLL_MODE": args.poll_mode,
        }
        if args.switch_interval is not None:
            env[SWITCH_ENV] = str(args.switch_interval)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.hops", "agent", "serve", "--listen", "127.0.0.1:0",
             "--ready-file", str(ready), "--log-level", "warning"],
            env=env,
        )  # fmt: skip
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    raise SystemExit("the agent exited before it was ready")
                time.sleep(0.05)
            _install_host()
            target = ready.read_text().strip()
            inline = not args.no_inline
            asyncio.run(_client(target, args.transport, args.jobs, proc.pid, inline=inline))
        finally:
            proc.terminate()
            proc.wait(30)
        offset = time.time_ns() - time.perf_counter_ns()
        agent_stamps = [tuple(s) for s in json.loads(stamps.read_text())]
        rows = report(list(_stamps), agent_stamps, _completed, offset)
    for row in rows:
        side, hop, p50, p90 = row["side"], row["hop"], row["p50_us"], row["p90_us"]
        print(f"{side:<6} {hop:<15} p50 {p50:8.1f} us   p90 {p90:8.1f} us")
    for cpu in _cpu:
        print(
            f"{cpu['side']:<6} thread {cpu['thread']:<22} CPU {cpu['cpu_us_per_job']:8.1f} us/job"
            f"   {cpu['cpu_share'] * 100:5.1f} % of the wall time"
        )
    print(json.dumps({"transport": args.transport, "hops": rows, "cpu": _cpu}))


if __name__ == "__main__":
    main()
