"""A failure in the middle of creating a function leaves nothing behind.

Each test makes functions with the linux backend for real, makes one step fail, and
then lists the kernel's state: namespaces, representors, NVMe-oF subsystems and
ports, NBD devices in use, NVMe controllers.
"""

from __future__ import annotations

import os

import pytest

from dpu_agent.errors import FailedPrecondition
from dpu_agent.storage import DataServices, MemoryVolumeStore
from dpu_agent.virtualization import nvmet
from dpu_agent.virtualization.commands import CommandFailed, SubprocessRunner
from dpu_agent.virtualization.linux_backend import LinuxFunctionBackend, LinuxSettings
from dpu_agent.virtualization.model import FunctionSpec, FunctionType, Provisioned
from tests.vm.virtualization.conftest import (
    EMPTY,
    NVMF_ADDRESS,
    NVMF_HOST_ADDRESS,
    PREFIX,
    kernel_state,
)

pytestmark = pytest.mark.tc


class FailAt:
    """The real runner, except that the n-th changing command fails (queries never do)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.changes = 0
        self.real = SubprocessRunner()

    def __call__(self, argv, *, input_text=None):
        if "-j" not in argv:
            self.changes += 1
            if self.changes == self.n:
                raise CommandFailed(argv, 1, "injected failure")
        return self.real(argv, input_text=input_text)


def backend(runner=None, volumes=None, address=NVMF_ADDRESS) -> LinuxFunctionBackend:
    settings = LinuxSettings(
        dpu_netns="dpuv",
        host_netns_prefix=PREFIX,
        nvmf_address=address,
        nvmf_host_address=NVMF_HOST_ADDRESS,
    )
    return LinuxFunctionBackend(settings, volumes=volumes, runner=runner)


SPEC = FunctionSpec(
    function_id="rb", type=FunctionType.VF, vlan_id=42, rate_limit_bps=10**7, spoof_check=True
)


@pytest.mark.usefixtures("clean_kernel")
def test_a_network_function_failing_at_any_step_leaves_nothing():
    counting = FailAt(0)
    made = backend(counting).create(SPEC)
    steps = counting.changes
    assert kernel_state()["netns"] == [f"{PREFIX}rb"]
    backend().delete(SPEC, made)
    assert kernel_state() == EMPTY
    assert steps >= 4
    for n in range(1, steps + 1):
        with pytest.raises(CommandFailed, match="injected"):
            backend(FailAt(n)).create(SPEC)
        assert kernel_state() == EMPTY, f"left behind after a failure at step {n} of {steps}"


class DieAt(FailAt):
    """The real runner, except that the process dies at the n-th change (no undo runs)."""

    def __call__(self, argv, *, input_text=None):
        if "-j" not in argv:
            self.changes += 1
            if self.changes == self.n:
                os._exit(3)
        return self.real(argv, input_text=input_text)


@pytest.mark.usefixtures("clean_kernel")
def test_a_crash_mid_create_is_cleaned_up_from_the_function_id_alone():
    pid = os.fork()
    if pid == 0:  # the "agent" that dies half-way through a create
        backend(DieAt(3)).create(SPEC)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert kernel_state()["netns"] == [f"{PREFIX}rb"], "the crash left nothing to clean"
    backend().delete(SPEC, Provisioned("", ""))  # what FunctionManager.start() does
    assert kernel_state() == EMPTY


@pytest.fixture
def volumes():
    store = MemoryVolumeStore()
    store.create("rbv", 8 << 20, 4096, DataServices())
    return store


@pytest.mark.usefixtures("block_ready", "clean_kernel")
def test_a_block_function_failing_after_its_export_started_leaves_nothing(volumes, monkeypatch):
    spec = FunctionSpec(function_id="rbd", type=FunctionType.NVME, volume_id="rbv")
    # a real failure: the target cannot listen on an address no interface has
    with pytest.raises(FailedPrecondition, match="listen"):
        backend(volumes=volumes, address="192.168.213.1").create(spec)
    assert kernel_state() == EMPTY

    # an injected one: the host-side connect fails after the target is up
    def refuse(*_args):
        raise FailedPrecondition("injected connect failure")

    monkeypatch.setattr(nvmet, "connect", refuse)
    with pytest.raises(FailedPrecondition, match="injected"):
        backend(volumes=volumes).create(spec)
    assert kernel_state() == EMPTY
    monkeypatch.undo()
    # and when nothing fails, the same backend makes it, then deletes it cleanly
    b = backend(volumes=volumes)
    made = b.create(spec)
    assert made.host_device.startswith("/dev/nvme")
    state = kernel_state()
    assert len(state["subsystems"]) == 1
    assert len(state["nbd"]) == 1
    assert len(state["nvme"]) == 1
    b.delete(spec, made)
    b.close()
    assert kernel_state() == EMPTY
