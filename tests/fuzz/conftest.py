"""Fixtures of the fuzz suite: one agent process, one event loop, the world.

The agent runs as a subprocess (tests/integration/conftest.py `start_agent`) with
the memory network and virtualization backends (so NetworkService and
VirtualizationService are served and nothing on this machine changes), the memory
volume store, a short orphan timeout, a session cap and quotas, so what fuzzed
requests create stays bounded: sessions are reaped within seconds, at most 256
volumes and 256 flow rules exist, volumes are sparse and in memory (no disk), and
every write is at most one of our 64 KiB host buffers.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import host_client
from tests.fuzz import capsules, rpcs
from tests.fuzz.stats import MIN_CASES, STATS
from tests.fuzz.world import Loop, Sink, World
from tests.integration.conftest import start_agent

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.integration.conftest import AgentProcess

AGENT_ENV = {
    "DPU_AGENT_NETWORK_BACKEND": "memory",
    "DPU_AGENT_STORAGE_BACKEND": "memory",
    "DPU_AGENT_TRANSPORTS": "tcp",
    "DPU_AGENT_MAX_SESSIONS": "32",
    "DPU_AGENT_MAX_SESSIONS_PER_CONNECTION": "32",  # one fuzzing channel: as many as the agent
    "DPU_AGENT_QUOTA_MAX_SESSIONS": "32",
    "DPU_AGENT_ORPHAN_TIMEOUT": "1",
    "DPU_AGENT_LOG_LEVEL": "warning",
    "DPU_AGENT_GRACE_PERIOD": "2",
    "DPU_AGENT_TLS_PLAINTEXT_LOOPBACK": "1",  # loopback only: plaintext is allowed
    "DPU_AGENT_VIRT_BACKEND": "memory",  # functions kept in memory: nothing on the host changes
    "DPU_AGENT_CHUNK_SIZE": "65536",  # staging per session: queue depth x 64 KiB
    "DPU_AGENT_QUOTA_MAX_VOLUMES": "256",
    "DPU_AGENT_QUOTA_MAX_VOLUME_BYTES": str(16 << 30),  # sparse, in memory: only writes use RAM
    "DPU_AGENT_QUOTA_MAX_FLOW_RULES": "256",
}


def pytest_configure(config: pytest.Config) -> None:
    with contextlib.suppress(ValueError):
        seed = config.getoption("hypothesis_seed")
        if seed is not None:
            STATS.seed = int(seed)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not STATS.total:
        return
    write = terminalreporter.write_line
    terminalreporter.section("fuzz")
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(STATS.cases.items()))
    write(f"fuzz cases: {STATS.total} ({kinds}); seed {STATS.seed}")
    write(
        f"  from the first case: wall {time.monotonic() - STATS.started:.1f} s, CPU of this "
        f"process {time.process_time() - STATS.cpu_started:.1f} s; the agent's CPU "
        f"{STATS.agent_cpu_s:.1f} s"
    )
    write(f"  reproduce: DPU_FUZZ_SEED={STATS.seed} (or --hypothesis-seed={STATS.seed})")
    missing = STATS.missing(all_targets())
    if missing:
        write(f"  floor of {MIN_CASES} not checked: {len(missing)} fuzz targets did not run")
    else:
        write(f"  floor: {MIN_CASES} cases per full run")
    by_target: dict[str, list[str]] = {}
    for (target, outcome), n in sorted(STATS.outcomes.items()):
        by_target.setdefault(target, []).append(f"{outcome}={n}")
    for target, outcomes in by_target.items():
        write(f"  {target}: {' '.join(outcomes)}")
    for note in STATS.notes:
        write(f"  {note}")


@pytest.fixture(scope="session")
def fuzz_loop() -> Iterator[Loop]:
    """The event loop the gRPC client and data-plane sessions live on."""
    runner = Loop()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def fuzz_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    """The agent under fuzz; afterwards it must still serve and exit 0 on SIGTERM."""
    agent = start_agent(tmp_path_factory.mktemp("fuzz-agent"), env=AGENT_ENV)
    yield agent
    STATS.agent_cpu_s = _cpu_seconds(agent.proc.pid)
    alive = agent.proc.poll() is None
    code = agent.terminate()
    assert alive, f"the agent died during the fuzz run:\n{agent.log_path.read_text()[-4000:]}"
    assert code == 0, agent.log_path.read_text()[-4000:]


@pytest.fixture(scope="session")
def channel(fuzz_loop: Loop, fuzz_agent: AgentProcess) -> Iterator[grpc.aio.Channel]:
    """A raw channel to the agent for fuzzed calls."""

    async def make() -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(
            fuzz_agent.address,
            options=[("grpc.max_receive_message_length", 16 << 20)],
        )

    chan = fuzz_loop.run(make())
    yield chan
    fuzz_loop.run(chan.close(None))


@pytest.fixture(scope="session")
def client(fuzz_loop: Loop, fuzz_agent: AgentProcess) -> Iterator[host_client.Client]:
    """The SDK client the world's objects are made with."""
    sdk = host_client.Client(fuzz_agent.address, timeout=30)
    fuzz_loop.run(sdk.__aenter__())
    yield sdk
    fuzz_loop.run(sdk.__aexit__(None, None, None))


@pytest.fixture(scope="session")
def world(fuzz_loop: Loop, fuzz_agent: AgentProcess, client: host_client.Client) -> Iterator[World]:
    """Real objects on the agent for near-valid requests, and a safe sink to dial."""
    sink = Sink()
    fuzz_loop.run(sink.start())
    agent_port = int(fuzz_agent.address.rpartition(":")[2])
    made = World(client, sink, agent_port)
    fuzz_loop.run(made.setup())
    yield made
    fuzz_loop.run(made.close())
    fuzz_loop.run(sink.stop())


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a running process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def all_targets() -> set[str]:
    """Every fuzz target of the suite: each RPC, and each kind of capsule."""
    return {str(rpc) for rpc in rpcs.all_rpcs()} | set(capsules.TARGETS)


def check_alive(agent: AgentProcess) -> None:
    """Fail at once, with the log tail, if the agent process is gone."""
    if agent.proc.poll() is not None:
        tail = agent.log_path.read_text()[-4000:]
        pytest.fail(f"the agent exited with {agent.proc.returncode}:\n{tail}")


async def serving(chan: grpc.aio.Channel) -> str:
    """The agent's overall health status name."""
    stub = health_pb2_grpc.HealthStub(chan)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def internal_errors(agent: AgentProcess) -> list[str]:
    """Error-level log entries (every one is a bug: unmapped exceptions, crashed tasks)."""
    found = []
    for line in agent.log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if "Traceback" in line or "Error" in line:
                found.append(line[:2000])
            continue
        if isinstance(entry, dict) and entry.get("level") in {"error", "critical"}:
            found.append(f"{entry.get('msg')}\n{entry.get('exc', '')}"[:4000])
    return found
