"""Shared pieces of the benchmarks: result records, and an agent process to measure."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import collections
import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bench import machine

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterator, Sequence

    import host_client

RESULTS = Path(__file__).resolve().parent / "results"
# DPU_BENCH_QUICK=1: a smoke run (every bench, short durations): checks that the benches
# work, not what they measure. Its results say so, and so does the report.
QUICK_ENV = "DPU_BENCH_QUICK"
QUICK = os.environ.get(QUICK_ENV) == "1"
_T = TypeVar("_T")
# Under TCG on two cores shared with other jobs, the agent has taken over 60 s to start.
AGENT_START_S = 300.0

# How far a figure's ratio may move between two runs of `make bench` on the project's
# machine (2 shared cores; the RDMA and tc benches under QEMU TCG) and still count as
# the same: a factor of 1 + NOISE either way. From the spread of the committed runs
# (git log -p bench/results): throughput and p50 ratios moved by up to x1.4 between
# runs of the same code. That holds while the machine is otherwise quiet: a run whose
# 5-minute load exceeded the cores is marked overloaded (machine.load_average), and its
# ratios moved by up to x20 (the references starve differently). See bench/report.py.
NOISE = 0.5
# p99 latencies are not compared between runs: with two shared cores and TCG, one
# descheduled moment decides them (ib_write_lat's own p99 went from 198 to 4078 us
# between two runs, so our p99 ratio moved x20).
TAIL = None


@functools.cache
def _runner() -> asyncio.Runner:
    runner = asyncio.Runner()
    atexit.register(runner.close)
    return runner


def arun(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run `coro` on this process's one event loop (use it instead of `asyncio.run`).

    grpc.aio binds its completion queue's poller to the first loop that makes a call;
    after a second `asyncio.run` in the same process that poller keeps calling into the
    first, closed loop ("Event loop is closed" tracebacks in the bench's output, grpc
    issue 25364 and its kin). A bench that runs the SDK several times runs it on one loop.
    """
    return _runner().run(coro)


def quick(full: _T, short: _T) -> _T:
    """`full` for a real run, `short` for a smoke run (DPU_BENCH_QUICK=1)."""
    return short if QUICK else full


@dataclasses.dataclass(frozen=True)
class Result:
    """One headline figure: ours against a reference measured in the same run.

    `size` (bytes) and `series` put the figure on a size sweep (the report plots ours
    and the reference against `size` for each series); `tolerance` is how far its ratio
    may move between runs and still be noise (NOISE, or TAIL: not compared); `note`
    says more about the figure in the report.
    """

    name: str
    ours: float
    reference: float
    unit: str
    reference_name: str
    higher_is_better: bool = True
    size: int | None = None
    series: str | None = None
    tolerance: float | None = NOISE
    note: str | None = None  # shown in the report's notes (e.g. how the reference was chosen)

    @property
    def ratio(self) -> float:
        """The ratio ours / reference (inverted for latencies, so > 1 is always better)."""
        if self.higher_is_better:
            return self.ours / self.reference
        return self.reference / self.ours


@dataclasses.dataclass(frozen=True)
class Table:
    """Measurements without a reference of their own (e.g. a job's hops), shown as a table."""

    title: str
    columns: list[str]
    rows: list[list[object]]


def write_results(bench: str, results: list[Result], tables: list[Table] | None = None) -> Path:
    """Write results (and tables) as JSON with the machine they ran on; print them."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{bench}.json"
    doc: dict[str, object] = {
        "bench": bench,
        "machine": machine.describe(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": [{**dataclasses.asdict(r), "ratio": round(r.ratio, 4)} for r in results],
    }
    if tables:
        doc["tables"] = [dataclasses.asdict(t) for t in tables]
    if QUICK:
        doc["quick"] = True
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(
            f"{r.name:<48} ours {r.ours:12.1f} {r.unit:<8} "
            f"{r.reference_name} {r.reference:12.1f}  ratio {r.ratio:.3f}"
        )
    for t in tables or ():
        print(t.title)
        for row in t.rows:
            print("  " + "  ".join(str(cell) for cell in row))
    return path


@contextlib.contextmanager
def agent_process(env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `dpu-agent serve` on a free loopback port; yield its address."""
    with tempfile.TemporaryDirectory() as tmp:
        ready = Path(tmp) / "ready"
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dpu_agent",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--ready-file",
                str(ready),
                "--log-level",
                "warning",
            ],
            env={
                **os.environ,
                "DPU_AGENT_STORAGE_DIR": f"{tmp}/volumes",
                # loopback only, and the references (raw grpc.aio stub, raw sockets) have
                # no TLS either
                "DPU_AGENT_TLS_PLAINTEXT_LOOPBACK": "1",
                **(env or {}),
            },
        )
        try:
            deadline = time.monotonic() + AGENT_START_S
            while not ready.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"agent exited with {proc.returncode} before it was ready")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"agent not ready after {AGENT_START_S:.0f} s")
                time.sleep(0.05)
            yield ready.read_text().strip()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


async def run_jobs(
    session: host_client.Session, requests: Sequence[host_client.JobRequest], seconds: float
) -> tuple[int, float]:
    """(jobs done, seconds) of keeping one job per request in flight for `seconds`.

    Job i is always `requests[i]` (its own buffers). The jobs go out with `submit_many`,
    and so do their successors: after the oldest job completes, every job that
    completed with it is resubmitted in one batch (as an application with a queue of
    work does). Every completion is checked.
    """
    jobs = await session.submit_many(requests)
    in_flight = collections.deque(enumerate(jobs))
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while in_flight:
        slot, job = in_flight.popleft()
        (await job).raise_for_status()
        again = [slot]
        while in_flight and in_flight[0][1].done():
            slot, job = in_flight.popleft()
            (await job).raise_for_status()
            again.append(slot)
        done += len(again)
        if time.perf_counter() < deadline:
            batch = await session.submit_many([requests[i] for i in again])
            in_flight.extend(zip(again, batch, strict=True))
    return done, time.perf_counter() - start


async def job_latencies_us(
    session: host_client.Session, request: host_client.JobRequest, count: int, warm_up: int = 50
) -> list[float]:
    """Submit-to-completion times of `count` jobs of `request`, one at a time (sorted).

    Each is `session.run(request)`: the SDK's call for one job awaited alone.
    """
    for _ in range(warm_up):
        (await session.run(request)).raise_for_status()
    samples = []
    for _ in range(count):
        start = time.perf_counter_ns()
        (await session.run(request)).raise_for_status()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return sorted(samples)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank)."""
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def run_module(module: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `python -m module args...`; its last output line, parsed as JSON."""
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    lines = done.stdout.strip().splitlines()
    print("\n".join(lines[:-1]))
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


def hops_tables(transport: str, jobs: int) -> list[Table]:
    """`bench.hops` in a subprocess: its per-hop p50 and p90, and the CPU per thread."""
    found = run_module("bench.hops", "--transport", transport, "--jobs", str(jobs))
    return [
        Table(
            f"Where one 4 KiB copy job's time goes, {transport} (bench.hops, {jobs} jobs)",
            ["side", "hop", "p50 us", "p90 us"],
            [[row["side"], row["hop"], row["p50_us"], row["p90_us"]] for row in found["hops"]],
        ),
        Table(
            f"CPU per thread during those jobs, {transport}",
            ["process", "thread", "CPU us per job", "share of wall time"],
            [
                [row["side"], row["thread"], row["cpu_us_per_job"], row["cpu_share"]]
                for row in found.get("cpu", [])
            ],
        ),
    ]


CHECKOUT = Path(__file__).resolve().parent.parent
VM_RESULTS = CHECKOUT / ".testvm" / "out" / "bench"


def find_port() -> tuple[str, int, int]:
    """(device, port, GID index) of the RDMA port to measure (DPU_TEST_RDMA_DEVICE or the first)."""
    from dpu_wire.transport.verbs import find_port as find  # noqa: PLC0415

    return find(os.environ.get("DPU_TEST_RDMA_DEVICE"))


def host_port() -> tuple[str, int, int]:
    """(device, port, GID index) of the host's side of a verbs figure.

    DPU_TEST_HOST_RDMA_DEVICE (the VM's rxe1, a second node), else the agent's port.
    """
    device = os.environ.get("DPU_TEST_HOST_RDMA_DEVICE")
    if not device:
        return find_port()
    from dpu_wire.transport.verbs import find_port as find  # noqa: PLC0415

    return find(device)


def size_label(size: int) -> str:
    """`4 KiB`, `1024 KiB` (KiB up to and including 1 MiB, as the figure names have them)."""
    return f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} B"


def rdma_unavailable() -> str | None:
    """Why this machine cannot run an RDMA benchmark, or None if it can."""
    from dpu_wire.transport.base import TransportError  # noqa: PLC0415
    from dpu_wire.transport.verbs import find_port  # noqa: PLC0415

    try:
        find_port(os.environ.get("DPU_TEST_RDMA_DEVICE"))
    except TransportError as exc:
        return str(exc)
    return None


Measured = list[Result] | tuple[list[Result], list[Table]]


def run_rdma_bench(name: str, measure: Callable[[], Measured]) -> list[Result]:
    """Measure here when this machine has an RDMA port, else inside the soft-RoCE VM."""
    return run_vm_bench(name, measure, rdma_unavailable)


def run_vm_bench(
    name: str, measure: Callable[[], Measured], unavailable: Callable[[], str | None]
) -> list[Result]:
    """Measure here when `unavailable()` says nothing, else inside the test VM.

    In the VM the checkout is read-only, so the guest writes its JSON under
    .testvm/out/bench/ and the host copies it to bench/results/.
    """
    if unavailable() is not None:
        return _via_vm(name)
    global RESULTS  # noqa: PLW0603 - the one switch of the output folder
    if not os.access(RESULTS.parent, os.W_OK):
        RESULTS = VM_RESULTS
    measured = measure()
    results, tables = measured if isinstance(measured, tuple) else (measured, [])
    write_results(name, results, tables)
    return results


def _via_vm(name: str) -> list[Result]:
    produced = VM_RESULTS / f"{name}.json"
    produced.unlink(missing_ok=True)
    testvm = [sys.executable, str(CHECKOUT / "deploy" / "testvm" / "testvm.py"), "run"]
    for variable in (QUICK_ENV, "DPU_TEST_RDMA_DEVICE", "DPU_TEST_HOST_RDMA_DEVICE"):
        if os.environ.get(variable):
            testvm += ["--env", f"{variable}={os.environ[variable]}"]
    command = [*testvm, "--", sys.executable, "-m", f"bench.{name}"]
    subprocess.run(command, cwd=CHECKOUT, check=True)
    RESULTS.mkdir(exist_ok=True)
    target = RESULTS / f"{name}.json"
    doc = json.loads(produced.read_text())
    # the guest's machine is what measured; the host's load says what else ran meanwhile
    doc["machine"]["host"] = {
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "cpus": os.cpu_count(),
    }
    target.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results: {target}")
    fields = {field.name for field in dataclasses.fields(Result)}
    return [Result(**{k: v for k, v in row.items() if k in fields}) for row in doc["results"]]


def command_line(doc: str | None) -> None:
    """Parse a bench module's command line: it takes no options, `--help` prints `doc`.

    Without it, `python -m bench.<name> --help` would run the bench and overwrite its
    results file.
    """
    argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
