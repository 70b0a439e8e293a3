"""An agent started with `reactor_cpus` runs its data-plane thread there, the rest anywhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dpu_agent.config import parse_cpus
from tests.integration.conftest import start_agent


def _allowed(pid: int, tid: int) -> frozenset[int]:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split(":", 1)[1].strip())
    raise AssertionError(f"no Cpus_allowed_list for thread {tid}")


def test_the_agents_reactor_thread_is_pinned(tmp_path):
    allowed = frozenset(os.sched_getaffinity(0))
    cpu = max(allowed)
    agent = start_agent(tmp_path, env={"DPU_AGENT_REACTOR_CPUS": str(cpu)})
    try:
        pid = agent.proc.pid
        tids = [int(entry.name) for entry in Path(f"/proc/{pid}/task").iterdir()]
        threads = {tid: _allowed(pid, tid) for tid in tids}
        pinned = [tid for tid, cpus in threads.items() if cpus == {cpu}]
        assert len(pinned) == 1, threads  # the reactor, and no other thread
        assert threads[pid] == allowed, threads  # the main thread (gRPC) is not pinned
        logged = [json.loads(line) for line in agent.log_path.read_text().splitlines() if line]
        assert any("runs on CPUs" in entry.get("msg", "") for entry in logged), logged[-5:]
    finally:
        assert agent.terminate() == 0, agent.log_path.read_text()
