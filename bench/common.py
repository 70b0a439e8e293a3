"""Shared pieces of the benchmarks: result records, and an agent process to measure."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench import machine

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

RESULTS = Path(__file__).resolve().parent / "results"
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


@dataclasses.dataclass(frozen=True)
class Result:
    """One headline figure: ours against a reference measured in the same run.

    `size` (bytes) and `series` put the figure on a size sweep (the report plots ours
    and the reference against `size` for each series); `tolerance` is how far its ratio
    may move between runs and still be noise (NOISE, or TAIL: not compared).
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

    @property
    def ratio(self) -> float:
        """The ratio ours / reference (inverted for latencies, so > 1 is always better)."""
        if self.higher_is_better:
            return self.ours / self.reference
        return self.reference / self.ours


def write_results(bench: str, results: list[Result]) -> Path:
    """Write results as JSON with the machine they ran on; print a table."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{bench}.json"
    doc = {
        "bench": bench,
        "machine": machine.describe(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": [{**dataclasses.asdict(r), "ratio": round(r.ratio, 4)} for r in results],
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    for r in results:
        print(
            f"{r.name:<40} ours {r.ours:12.1f} {r.unit:<8} "
            f"{r.reference_name} {r.reference:12.1f}  ratio {r.ratio:.3f}"
        )
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


CHECKOUT = Path(__file__).resolve().parent.parent
VM_RESULTS = CHECKOUT / ".testvm" / "out" / "bench"


def rdma_unavailable() -> str | None:
    """Why this machine cannot run an RDMA benchmark, or None if it can."""
    from dpu_wire.transport.base import TransportError  # noqa: PLC0415
    from dpu_wire.transport.verbs import find_port  # noqa: PLC0415

    try:
        find_port(os.environ.get("DPU_TEST_RDMA_DEVICE"))
    except TransportError as exc:
        return str(exc)
    return None


def run_rdma_bench(name: str, measure: Callable[[], list[Result]]) -> list[Result]:
    """Measure here when this machine has an RDMA port, else inside the soft-RoCE VM."""
    return run_vm_bench(name, measure, rdma_unavailable)


def run_vm_bench(
    name: str, measure: Callable[[], list[Result]], unavailable: Callable[[], str | None]
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
    results = measure()
    write_results(name, results)
    return results


def _via_vm(name: str) -> list[Result]:
    produced = VM_RESULTS / f"{name}.json"
    produced.unlink(missing_ok=True)
    testvm = [sys.executable, str(CHECKOUT / "deploy" / "testvm" / "testvm.py"), "run", "--"]
    subprocess.run([*testvm, sys.executable, "-m", f"bench.{name}"], cwd=CHECKOUT, check=True)
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
