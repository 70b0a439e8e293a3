"""The agent's container image, run with podman on this machine (`make test-container`).

`make test-container` builds the image (deploy/container/build.sh) and runs this suite
with $DPU_CONTAINER_IMAGE set to it. Without it every test here skips with the reason,
and the make target's JUnit check turns a skip into a failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.mqtt_broker import MosquittoBroker, free_port, mosquitto_binary
from tests.integration.pki import LabPki, make_pki

if TYPE_CHECKING:
    from collections.abc import Iterator

PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs")
# The default rlimits cannot be raised on these machines (see deploy/container/build.sh).
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
AGENT_UID = 10001  # the image's dpu-agent user (deploy/container/Containerfile)
START_TIMEOUT = 180.0  # the arm64 image's agent starts under qemu-user emulation
CONFIG = """\
[agent]
id = "container-agent"
listen = "127.0.0.1:{port}"
grace_period = 10.0

[log]
format = "json"

[dataplane]
transports = "tcp"

[storage]
backend = "file"

[network]
backend = "none"

[mqtt]
enabled = true
host = "127.0.0.1"
port = {broker}

[metrics]
listen = "127.0.0.1:{metrics}"

[tls]
cert = "/etc/dpu-agent/tls/agent.pem"
key = "/etc/dpu-agent/tls/agent.key"
client_ca = "/etc/dpu-agent/tls/ca.pem"
"""


def podman(
    *args: str, check: bool = True, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run podman (runc, cgroupfs: what these machines need) and return its result."""
    return subprocess.run(
        [*PODMAN, *args], capture_output=True, text=True, check=check, timeout=timeout
    )


@dataclasses.dataclass
class AgentContainer:
    """The agent in a container: host network, mTLS certificates and state mounted."""

    image: str
    name: str
    state: Path  # mounted at /var/lib/dpu-agent: the volume store, the ready file
    pki: LabPki  # mounted read-only at /etc/dpu-agent/tls
    config: Path  # mounted read-only at /etc/dpu-agent/agent.toml
    port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ready_file(self) -> Path:
        return self.state / "ready"

    def run(self) -> None:
        """Start the container and wait until the agent serves."""
        self.ready_file.unlink(missing_ok=True)
        podman(
            *("run", "--detach", "--name", self.name, "--network", "host", *LIMITS),
            *("-v", f"{self.state}:/var/lib/dpu-agent"),
            *("-v", f"{self.pki.directory}:/etc/dpu-agent/tls:ro"),
            *("-v", f"{self.config}:/etc/dpu-agent/agent.toml:ro"),
            self.image,
            *("serve", "--config", "/etc/dpu-agent/agent.toml"),
            *("--ready-file", "/var/lib/dpu-agent/ready"),
        )
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready_file.exists():
            if self.state_of("Running") != "true":
                raise RuntimeError(f"the agent's container stopped:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not start in {START_TIMEOUT} s:\n{self.logs()}")
            time.sleep(0.1)

    def restart(self) -> None:
        """`podman restart`: SIGTERM, then the same container starts again."""
        self.ready_file.unlink(missing_ok=True)
        podman("restart", "--time", "30", self.name)
        self.wait_ready()

    def stop_and_wait(self) -> int:
        """`podman stop`: SIGTERM, up to 30 s to drain; the agent's exit code."""
        podman("stop", "--time", "30", self.name, timeout=60)
        return int(self.state_of("ExitCode"))

    def state_of(self, field: str) -> str:
        return podman("inspect", "--format", f"{{{{.State.{field}}}}}", self.name).stdout.strip()

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def log_entries(self) -> list[dict[str, object]]:
        entries = []
        for line in self.logs().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return entries

    def exec(self, *command: str) -> str:
        return podman("exec", self.name, *command).stdout

    def remove(self) -> None:
        podman("rm", "--force", "--time", "5", self.name, check=False)


@pytest.fixture(scope="session")
def image() -> str:
    """The image `make test-container` built."""
    name = os.environ.get("DPU_CONTAINER_IMAGE", "")
    if not name:
        pytest.skip(
            "no $DPU_CONTAINER_IMAGE: `make test-container` builds the image and runs these"
        )
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed (deploy/container/build.sh installs it)")
    return name


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    """mosquitto beside the container, on the host's loopback."""
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed (Debian package mosquitto)")
    server = MosquittoBroker(tmp_path_factory.mktemp("broker"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def arm64_image() -> str:
    """The arm64 image `make test-container` built (run under qemu-user binfmt)."""
    name = os.environ.get("DPU_CONTAINER_IMAGE_ARM64", "")
    if not name:
        pytest.skip("no $DPU_CONTAINER_IMAGE_ARM64: `make test-container` builds it, runs these")
    return name


@pytest.fixture(scope="module")
def container(
    image: str, broker: MosquittoBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentContainer]:
    """The agent in its container for the module's tests; removed afterwards."""
    yield from agent_container(image, broker, tmp_path_factory)


@pytest.fixture(scope="module")
def arm64_container(
    arm64_image: str, broker: MosquittoBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentContainer]:
    """The arm64 image's agent, emulated; removed afterwards."""
    yield from agent_container(arm64_image, broker, tmp_path_factory)


def agent_container(
    image: str, broker: MosquittoBroker, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AgentContainer]:
    """Start the agent from `image` with its own state, PKI and config; remove it after."""
    base = tmp_path_factory.mktemp("container")
    state, tls = base / "state", base / "tls"
    state.mkdir()
    pki = make_pki(tls)
    pki.client("acme")
    for path in (state, tls, *tls.iterdir()):  # the agent's user owns what it reads and writes
        os.chown(path, AGENT_UID, AGENT_UID)
    config = base / "agent.toml"
    agent = AgentContainer(
        image, f"dpu-test-{uuid.uuid4().hex[:8]}", state, pki, config, free_port(), free_port()
    )
    config.write_text(
        CONFIG.format(port=agent.port, broker=broker.port, metrics=agent.metrics_port)
    )
    config.chmod(0o644)
    agent.run()
    yield agent
    agent.remove()
