"""The agent's container image serving a verbs session over rxe0, in the test VM.

`make test-vm` names the image `deploy/container/build.sh` built in $DPU_CONTAINER_IMAGE
and the host's podman storage in $DPU_CONTAINER_STORE. The guest sees the host's root
read-only, so its podman (runc, its own storage on the guest's tmpfs, overlay) takes the
host's storage as an additional, read-only image store and runs the very image the host
built, with no copy: loading a saved archive instead took 100-160 s of the suite under TCG.
It runs the agent with the agent's node only: `--device` of rxe0's uverbs node and an
unlimited memlock limit, as deploy/README.md tells users. The SDK, outside the container
on the host's node (rxe1), opens a verbs session and checks every byte.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import host_client
from tests.integration.mqtt_broker import free_port

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.vm.conftest import RdmaPort

pytestmark = [pytest.mark.rdma, pytest.mark.asyncio]

STORE = "/tmp/containers"  # noqa: S108 - the guest's own tmpfs
RUNROOT = "/run/containers"
PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs")
STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "{store}"
runroot = "{runroot}"
[storage.options]
additionalimagestores = ["{images}"]
"""
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
CONFIG = """\
[agent]
listen = "127.0.0.1:{port}"
grace_period = 10.0
[dataplane]
transports = "verbs"
rdma_device = "{device}"
[storage]
backend = "file"
[network]
backend = "none"
[mqtt]
enabled = false
[metrics]
listen = ""
[tls]
plaintext_loopback = true
"""


def podman_env() -> dict[str, str]:
    """The environment of every podman here: a storage.conf naming the host's image store."""
    conf = Path(f"{STORE}.conf")
    if not conf.exists():
        images = os.environ.get("DPU_CONTAINER_STORE", "")
        conf.write_text(STORAGE_CONF.format(store=STORE, runroot=RUNROOT, images=images))
    return {**os.environ, "CONTAINERS_STORAGE_CONF": str(conf)}


def podman(
    *args: str, timeout: float = 600.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*PODMAN, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=podman_env(),
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:2])} failed: {result.stderr[-2000:]}")
    return result


def uverbs_node(device: str) -> str:
    """The /dev/infiniband/uverbsN of an RDMA device."""
    for node in Path("/sys/class/infiniband_verbs").glob("uverbs*"):
        if (node / "ibdev").read_text().strip() == device:
            return f"/dev/infiniband/{node.name}"
    raise AssertionError(f"no uverbs node for {device}")


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The image, in the host's storage that the guest's podman reads."""
    store = os.environ.get("DPU_CONTAINER_STORE", "")
    name = os.environ.get("DPU_CONTAINER_IMAGE", "")
    if not store or not name:
        pytest.skip("no $DPU_CONTAINER_STORE/$DPU_CONTAINER_IMAGE: `make test-vm` sets them")
    found = podman("images", "--format", "{{.Repository}}:{{.Tag}}", name).stdout.split()
    assert name in found, f"{name} is not in the image store {store}: {found}"
    yield name
    settle()


@pytest.fixture
def agent_in_container(
    image: str, rdma_port: RdmaPort, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The containerised agent on the agent's node; yields its gRPC address."""
    base = tmp_path_factory.mktemp("container")
    state = base / "state"
    state.mkdir()
    os.chown(state, 10001, 10001)
    port = free_port()
    config = base / "agent.toml"
    config.write_text(CONFIG.format(port=port, device=rdma_port.device))
    config.chmod(0o644)
    name = f"dpu-vm-{uuid.uuid4().hex[:8]}"
    podman(
        *("run", "--detach", "--name", name, "--network", "host", *LIMITS),
        *("--device", uverbs_node(rdma_port.device), "--ulimit", "memlock=-1:-1"),
        *("-v", f"{state}:/var/lib/dpu-agent", "-v", f"{config}:/etc/dpu-agent/agent.toml:ro"),
        image,
        *("serve", "--config", "/etc/dpu-agent/agent.toml"),
        *("--ready-file", "/var/lib/dpu-agent/ready"),
    )
    deadline = time.monotonic() + 180
    while not (state / "ready").exists():
        logs = podman("logs", name, check=False).stdout
        running = podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        assert running == "true", f"the agent's container stopped:\n{logs}"
        assert time.monotonic() < deadline, f"the agent did not start:\n{logs}"
        time.sleep(0.5)
    try:
        yield f"127.0.0.1:{port}"
        podman("stop", "--time", "30", name)
        code = podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", podman("logs", name).stdout
    finally:
        podman("rm", "--force", name, check=False)
        settle()


def settle(timeout: float = 60.0) -> None:
    """Wait for podman's clean-up processes (conmon runs one after a container exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = subprocess.run(["pgrep", "-x", "conmon|podman"], capture_output=True, check=False)
        if busy.returncode != 0:
            return
        time.sleep(0.5)


async def test_a_verbs_session_into_the_containerised_agent(agent_in_container, host_port):
    async with host_client.Client(agent_in_container, timeout=60) as client:
        info = await client.agent_info()
        assert list(info.transports) == [1]  # verbs only
        async with await client.open_session(
            transport="verbs", rdma_device=host_port.device
        ) as session:
            size = 1 << 20
            src = await session.alloc(size, readable=True)
            dst = await session.alloc(size, writable=True)
            src.view[:] = os.urandom(size)
            for offset in range(0, size, 256 << 10):
                job = await session.submit_copy(
                    src[offset : offset + (256 << 10)], dst[offset : offset + (256 << 10)]
                )
                assert (await job).ok
            assert bytes(dst.view) == bytes(src.view)
