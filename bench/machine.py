"""What a benchmark ran on: the machine, its kernel, and the versions that decide the figures.

Every result file carries `describe()` of the machine that measured it: for the benches
that `make bench` runs in the soft-RoCE test VM that is the guest (its kernel is the
guest's `uname -r`, its CPU QEMU's), since `deploy/testvm/testvm.py` sets DPU_TESTVM=1
there. The report adds `git_state()` of the checkout.

`python_loop_s` is how fast Python runs on the machine right now: the seconds of a
10**7-step loop, measured when the results are written. On the project's shared
machine it moves by 2-3x over hours (and is ~7x slower in the TCG VM than on the host),
so absolute figures from different runs do not compare; only same-run ratios do, and
this number tells two runs' machines apart.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import time
from pathlib import Path

# Debian packages whose versions matter to the figures (pyverbs has no Python metadata:
# it is rdma-core's own build, see README).
DEBIAN_PACKAGES = ("python3-pyverbs", "rdma-core", "perftest", "iproute2")
PYTHON_PACKAGES = ("grpcio", "protobuf")
LOOP_STEPS = 10**7


def describe() -> dict[str, object]:
    """This machine: where (host or test VM), CPU, memory, kernel, OS and versions."""
    in_vm = os.environ.get("DPU_TESTVM") == "1"
    return {
        "where": "test VM (QEMU TCG)" if in_vm else "host",
        "node": platform.node(),
        "machine": platform.machine(),
        "kernel": platform.release(),  # uname -r
        "os": _os_release(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_mib": _memory_mib(),
        # 1, 5 and 15 minute load averages when the results were written: above `cpus`,
        # other work shared the CPUs during the run and its figures are not comparable
        "load_average": [round(load, 2) for load in os.getloadavg()],
        "python": platform.python_version(),
        "rdma_topology": rdma_topology(),
        "python_loop_s": round(python_loop_s(), 3),
        "versions": {
            **{name: _python_version(name) for name in PYTHON_PACKAGES},
            **{name: _debian_version(name) for name in DEBIAN_PACKAGES},
        },
    }


def rdma_topology() -> str:
    """Which RDMA devices the agent's side and the host's side of a verbs figure used.

    The test VM has two nodes (deploy/testvm/vmguest.py): the agent's rxe0 on veth0 and
    the host's rxe1 on veth1, their traffic routed across the pair.
    """
    agent = os.environ.get("DPU_TEST_RDMA_DEVICE", "")
    host = os.environ.get("DPU_TEST_HOST_RDMA_DEVICE", "") or agent
    if not agent:
        return ""  # not set: a host bench (tcp) or a machine's first ACTIVE port, both sides
    if host == agent:
        return f"one device: {agent} to itself (loopback)"
    return f"two nodes: agent {agent}, host {host}, across a veth pair"


def python_loop_s(steps: int = LOOP_STEPS) -> float:
    """Seconds of `for _ in range(steps): pass`: the speed of Python on this machine now."""
    start = time.perf_counter()
    for _ in range(steps):
        pass
    return time.perf_counter() - start


def git_state(checkout: Path) -> dict[str, object]:
    """The commit of `checkout`, and whether files other than bench output differ from it."""
    commit = _git(checkout, "rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git(
        checkout,
        "status",
        "--porcelain",
        "--",
        ".",
        ":(exclude)bench/results",
        ":(exclude)bench/REPORT.md",
    )
    return {"commit": commit, "dirty": bool(status)}


def _git(checkout: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(checkout), *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _proc_field(path: str, field: str) -> str | None:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, sep, value = line.partition(":")
        if sep and key.strip() == field:
            return value.strip()
    return None


def _cpu_model() -> str | None:
    return _proc_field("/proc/cpuinfo", "model name")


def _memory_mib() -> int | None:
    total = _proc_field("/proc/meminfo", "MemTotal")  # "24684096 kB"
    if total is None or not total.endswith(" kB"):
        return None
    return int(total.removesuffix(" kB")) // 1024


def _os_release() -> str | None:
    try:
        return platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        return None


def _python_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _debian_version(name: str) -> str | None:
    try:
        done = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", name],
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except OSError:
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
