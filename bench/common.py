"""Shared pieces of the benchmarks: result records, and an agent process to measure."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

RESULTS = Path(__file__).resolve().parent / "results"


@dataclasses.dataclass(frozen=True)
class Result:
    """One headline figure: ours against a reference measured in the same run."""

    name: str
    ours: float
    reference: float
    unit: str
    reference_name: str
    higher_is_better: bool = True

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
        "machine": {
            "node": platform.node(),
            "machine": platform.machine(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
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
            env={**os.environ, "DPU_AGENT_STORAGE_DIR": f"{tmp}/volumes", **(env or {})},
        )
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("agent did not start")
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
    shutil.copyfile(produced, target)
    print(f"results: {target}")
    fields = {field.name for field in dataclasses.fields(Result)}
    return [
        Result(**{k: v for k, v in row.items() if k in fields})
        for row in json.loads(target.read_text())["results"]
    ]
