"""The guest architectures the harness boots: one row per Debian architecture.

amd64 boots over this machine's own root (its Python, its virtualenv).  arm64 is
BlueField's ISA: a cortex-a72 guest (BlueField-2's core) booting Debian's arm64 kernel
over the arm64 Debian root that deploy/aarch64/run-tests.sh builds (python3-pyverbs and
the project's virtualenv in /opt/venv, the checkout copied to /src).
"""

from __future__ import annotations

from dataclasses import dataclass

# Loaded by the initramfs (with their dependencies from modules.dep) before the 9p root.
NINEP_MODULES = ("virtio_pci", "9pnet_virtio", "9p")
# What the data plane needs; the amd64 guest modprobes them from the host's kmod, the
# arm64 root has no kmod, so its initramfs loads them.
RDMA_MODULES = ("crc32_generic", "rdma_rxe", "veth")


# Transparent huge pages off in the guest: a VM suite run deadlocked both vCPUs under
# TCG (soft lockups, khugepaged on one CPU and podman's conmon on the other, for
# minutes, until the run's timeout) while the containerised agent's test loaded its
# image. khugepaged has nothing to do without them.
NO_THP = "transparent_hugepage=never"


@dataclass(frozen=True)
class Arch:
    """How to boot and provision a guest of one architecture."""

    name: str  # Debian's name: the kernel package's suffix and apt's architecture
    qemu: str  # the system emulator
    qemu_package: str  # the Debian package that has it
    machine: tuple[str, ...]  # QEMU options for the board, the CPU and the firmware
    console: str  # the guest's serial console device
    cmdline: str  # extra kernel command line
    initrd_modules: tuple[str, ...]  # insmod'ed by /init
    foreign: bool  # not this machine's architecture: apt under a private config,
    # busybox from that architecture's busybox-static
    # A foreign guest's root: the command (run from the checkout) that builds it and
    # prints its path as its last line, where the checkout is in it, and what to put in
    # front of PATH (its virtualenv). None: this machine's own root, as it is.
    root_builder: tuple[str, ...] | None = None
    root_checkout: str = ""
    root_path_prefix: str = ""

    @property
    def meta_package(self) -> str:
        """The package whose dependency names the current kernel."""
        return f"linux-image-{self.name}"


ARCHES = {
    "amd64": Arch(
        name="amd64",
        qemu="qemu-system-x86_64",
        qemu_package="qemu-system-x86",
        machine=("-accel", "tcg,thread=multi", "-cpu", "max", "-bios", "qboot.rom", "-vga", "none"),
        console="ttyS0",
        cmdline=f"mitigations=off edd=off {NO_THP}",
        initrd_modules=NINEP_MODULES,
        foreign=False,
    ),
    "arm64": Arch(
        name="arm64",
        qemu="qemu-system-aarch64",
        qemu_package="qemu-system-arm",
        # cortex-a72 is BlueField-2's core; `-cpu max` is ~3x slower under TCG
        machine=("-accel", "tcg,thread=multi", "-M", "virt", "-cpu", "cortex-a72"),
        console="ttyAMA0",
        cmdline=f"mitigations=off {NO_THP}",
        initrd_modules=NINEP_MODULES + RDMA_MODULES,
        foreign=True,
        root_builder=("deploy/aarch64/run-tests.sh", "--prepare"),
        root_checkout="/src",
        root_path_prefix="/opt/venv/bin:",
    ),
}
DEFAULT_ARCH = "amd64"
