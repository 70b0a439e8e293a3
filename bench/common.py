"""Shared pieces of the benchmarks: result records, and an agent process to measure."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

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
def agent_process() -> Iterator[str]:
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
        )
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("agent did not start")
                time.sleep(0.05)
            yield ready.read_text().strip()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
