"""The test VM harness's architectures: what each boots and runs (no QEMU started here).

The harness itself runs in `make test-vm` (amd64) and `make test-aarch64-rdma` (arm64);
these check the parts that decide the guest without booting one.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[2] / "deploy" / "testvm"
sys.path.insert(0, str(HARNESS))

import vmboot  # noqa: E402
import vmguest  # noqa: E402
import vmkernel  # noqa: E402
from vmarch import ARCHES, DEFAULT_ARCH  # noqa: E402

ARM64 = ARCHES["arm64"]
AMD64 = ARCHES["amd64"]


def options(arch_name: str, root: vmguest.GuestRoot, command: tuple[str, ...] | None = ("true",)):
    return vmguest.VMOptions(
        arch=ARCHES[arch_name],
        root=root,
        command=command,
        env=(),
        mem_mib=2048,
        smp=2,
        timeout=60.0,
        verbose=False,
    )


NATIVE_ROOT = vmguest.GuestRoot(
    Path("/"), Path("/work/checkout"), Path("/work/checkout/.testvm/out")
)
ARM_ROOT = vmguest.GuestRoot(
    Path("/cache/rootfs-x"), Path("/src"), Path("/src/.testvm/out"), "/opt/venv/bin:"
)


def kernel(arch_name: str, tmp_path: Path) -> vmkernel.KernelCache:
    return vmkernel.KernelCache(ARCHES[arch_name], f"6.1.0-1-{arch_name}", tmp_path)


def test_amd64_is_the_default_and_arm64_is_a_cortex_a72_with_its_own_console():
    assert DEFAULT_ARCH == "amd64"
    assert not AMD64.foreign
    assert ARM64.foreign
    assert "cortex-a72" in ARM64.machine
    assert ARM64.console == "ttyAMA0"
    assert ARM64.meta_package == "linux-image-arm64"


def test_the_arm64_initramfs_loads_the_rdma_modules_because_its_root_has_no_kmod():
    for module in ("crc32_generic", "rdma_rxe", "veth"):
        assert module in ARM64.initrd_modules
        assert module not in AMD64.initrd_modules


@pytest.mark.parametrize("arch_name", ["amd64", "arm64"])
def test_stage2_loads_modules_the_way_its_root_allows(arch_name, tmp_path):
    root = ARM_ROOT if arch_name == "arm64" else NATIVE_ROOT
    script = vmguest.stage2_script(kernel(arch_name, tmp_path), options(arch_name, root))
    if arch_name == "arm64":
        assert "modprobe" not in script
        assert "/sys/module/$m" in script
        assert "cd /src " in script
    else:
        assert 'modprobe -d "$MODROOT" "$m"' in script
        assert "cd /work/checkout " in script
    # both set the routing knobs without sysctl(8), which the arm64 root lacks
    assert "sysctl" not in script
    assert "rdma link add rxe0 type rxe netdev veth0" in script
    assert "rdma link add rxe1 type rxe netdev veth1" in script


def test_the_arm64_command_finds_the_roots_virtualenv_first():
    env = dict(vmguest.guest_env(options("arm64", ARM_ROOT)))
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert env["DPU_TEST_RDMA_DEVICE"] == "rxe0"
    assert env["DPU_TEST_HOST_RDMA_DEVICE"] == "rxe1"


def test_an_interactive_arm64_shell_uses_its_console(tmp_path):
    script = vmguest.stage2_script(kernel("arm64", tmp_path), options("arm64", ARM_ROOT, None))
    assert "<>/dev/ttyAMA0" in script
    assert "ttyS0" not in script


def test_qemu_boots_the_arm64_root_as_an_aarch64_virt_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(vmboot, "need_tool", lambda name, _package: f"/usr/bin/{name}")
    argv = vmboot.qemu_argv(kernel("arm64", tmp_path), options("arm64", ARM_ROOT), tmp_path)
    assert argv[0] == "/usr/bin/qemu-system-aarch64"
    assert argv[argv.index("-M") + 1] == "virt"
    assert argv[argv.index("-cpu") + 1] == "cortex-a72"
    assert "qboot.rom" not in argv
    append = argv[argv.index("-append") + 1]
    assert "console=ttyAMA0" in append
    assert "edd=off" not in append
    assert any(a.startswith("local,path=/cache/rootfs-x,mount_tag=testvm_root") for a in argv)


def test_a_foreign_architecture_gets_a_private_apt_configuration(tmp_path, monkeypatch):
    monkeypatch.setenv("DPU_TESTVM_CACHE", str(tmp_path))
    assert vmkernel.apt_options(AMD64) == []
    opts = vmkernel.apt_options(ARM64)
    pairs = dict(opt.split("=", 1) for opt in opts[1::2])
    assert pairs["APT::Architecture"] == "arm64"
    assert pairs["Dir::State::Lists"].startswith(str(tmp_path))
    assert pairs["Dir::State::status"].startswith(str(tmp_path))
    assert (tmp_path / "apt-arm64" / "status").is_file()


def test_cached_kernels_are_kept_apart_by_architecture(tmp_path):
    for version in ("6.1.0-9-amd64", "6.1.0-10-amd64", "6.1.0-10-arm64"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "kernel.ok").write_text("x\n")
    assert [kc.version for kc in vmkernel.cached_kernels(tmp_path, AMD64)] == [
        "6.1.0-9-amd64",
        "6.1.0-10-amd64",
    ]
    assert [kc.version for kc in vmkernel.cached_kernels(tmp_path, ARM64)] == ["6.1.0-10-arm64"]


def test_the_arm64_busybox_is_its_own_not_the_hosts(tmp_path):
    assert kernel("arm64", tmp_path).busybox == tmp_path / "busybox"
    assert kernel("amd64", tmp_path).busybox == Path("/bin/busybox")


@pytest.mark.parametrize(
    ("cpus", "mask"),
    [(1, "1"), (2, "3"), (32, "ffffffff"), (33, "1,ffffffff"), (70, "3f,ffffffff,ffffffff")],
)
def test_stage2_steers_each_flow_to_one_of_every_guest_cpu(cpus, mask, tmp_path):
    """RPS on both veth ends, its mask in sysfs's 32-bit words (one long word is refused)."""
    opts = dataclasses.replace(options("amd64", NATIVE_ROOT), smp=cpus)
    script = vmguest.stage2_script(kernel("amd64", tmp_path), opts)
    assert f"echo {mask} > /sys/class/net/$dev/queues/rx-0/rps_cpus" in script
    assert "for dev in veth0 veth1; do\n    echo " in script
