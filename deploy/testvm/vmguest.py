"""What runs inside the guest: its environment and stage 2 (modules, veth, rxe, CMD)."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vmcommon import CHECKOUT, OUT_DIR, HarnessError, say

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vmarch import Arch
    from vmkernel import KernelCache

REQUIRED_MODULES = ("crc32_generic", "rdma_rxe")
OPTIONAL_MODULES = (
    "sch_ingress",
    "cls_flower",
    "act_gact",
    "act_mirred",
    "act_police",
    "act_vlan",
    "act_tunnel_key",
    "act_csum",
    "veth",
    "vxlan",
    "8021q",
    "nvme_fabrics",
    "nvme_rdma",
    "nvmet",
    "nvmet_rdma",
    "nbd",
    "cls_matchall",
    "ext4",
    "overlay",  # podman's storage for the containerised agent (tests/vm/test_container_verbs.py)
)
GUEST_TMP = "/tmp"  # noqa: S108 - the guest's own fresh tmpfs
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Two RDMA nodes on one veth pair: the DPU's rxe0 on veth0, the host's rxe1 on veth1.
RXE_ADDR = "192.168.77.1/24"  # veth0: the agent's side
HOST_RXE_ADDR = "192.168.77.2/24"  # veth1: the SDK's side
AGENT_DEVICE = "rxe0"
HOST_DEVICE = "rxe1"
VETH_MTU = 9000  # the veth pair rxe0 sits on: RoCE MTU 4096
START_MARK = b"@@testvm:start@@\n"
END_MARK = b"\n@@testvm:end@@"


@dataclass(frozen=True)
class GuestRoot:
    """The root the guest chroots into, and where the checkout and the output are in it."""

    host_dir: Path  # shared read-only as the guest's /
    checkout: Path  # the command's working directory, as the guest sees it
    out: Path  # where the guest mounts <checkout>/.testvm/out (read-write)
    path_prefix: str = ""  # put in front of PATH


def guest_root(arch: Arch) -> GuestRoot:
    """This machine's root for its own architecture; else build the foreign root first.

    The builder (deploy/aarch64/run-tests.sh --prepare) refreshes the checkout's copy
    in that root and prints the root's path as its last line of output.
    """
    if arch.root_builder is None:
        return GuestRoot(Path("/"), CHECKOUT, OUT_DIR)
    say(f"preparing the {arch.name} root: {' '.join(arch.root_builder)}")
    proc = subprocess.run(
        arch.root_builder, cwd=CHECKOUT, stdout=subprocess.PIPE, text=True, check=False
    )
    lines = proc.stdout.strip().splitlines()
    host_dir = Path(lines[-1]) if lines else Path()
    if proc.returncode != 0 or not host_dir.is_absolute() or not host_dir.is_dir():
        raise HarnessError(
            f"{' '.join(arch.root_builder)} exited {proc.returncode} without a root "
            "(its messages are above)"
        )
    checkout = Path(arch.root_checkout)
    out = checkout / OUT_DIR.relative_to(CHECKOUT)
    (host_dir / out.relative_to("/")).mkdir(parents=True, exist_ok=True)  # the mount point
    return GuestRoot(host_dir, checkout, out, arch.root_path_prefix)


@dataclass(frozen=True)
class VMOptions:
    """What the guest is asked to do."""

    arch: Arch
    root: GuestRoot
    command: tuple[str, ...] | None  # None: interactive shell
    env: tuple[tuple[str, str], ...]
    mem_mib: int
    smp: int
    timeout: float | None
    verbose: bool


def quote_env(pairs: Sequence[tuple[str, str]]) -> str:
    """Shell lines that export the given variables."""
    return "".join(f"export {name}={shlex.quote(value)}\n" for name, value in pairs)


def guest_env(opts: VMOptions) -> list[tuple[str, str]]:
    """Environment of the command in the guest (user --env entries last, so they win)."""
    term = os.environ.get("TERM", "vt100") if opts.command is None else "dumb"
    return [
        ("PATH", opts.root.path_prefix + GUEST_PATH),
        ("HOME", GUEST_TMP),
        ("TMPDIR", GUEST_TMP),
        ("LANG", "C.UTF-8"),
        ("TERM", term),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        # The checkout is read-only in the guest: hypothesis' pytest plugin would warn
        # (an error under filterwarnings=error) that it cannot write .hypothesis/ there.
        ("HYPOTHESIS_STORAGE_DIRECTORY", f"{GUEST_TMP}/.hypothesis"),
        ("DPU_TESTVM", "1"),
        # the two nodes: the agent binds rxe0, the SDK (and test hosts) rxe1
        ("DPU_TEST_RDMA_DEVICE", AGENT_DEVICE),
        ("DPU_TEST_HOST_RDMA_DEVICE", HOST_DEVICE),
        ("DPU_RDMA_DEVICE", HOST_DEVICE),
        *opts.env,
    ]


def load_modules(kc: KernelCache) -> str:
    """Shell that loads the kernel modules, or checks those the initramfs loaded."""
    if "rdma_rxe" in kc.arch.initrd_modules:  # a root without kmod
        return f"""for m in {" ".join(REQUIRED_MODULES)}; do
    [ -d "/sys/module/$m" ] || fail "kernel module $m was not loaded by the initramfs"
done
"""
    mods = " ".join(OPTIONAL_MODULES)
    return f"""MODROOT={shlex.quote(str(kc.root))}
for m in {" ".join(REQUIRED_MODULES)}; do
    modprobe -d "$MODROOT" "$m" || fail "cannot load kernel module $m"
done
modprobe -a -q -d "$MODROOT" {mods} 2>/dev/null
for m in {mods}; do
    [ -d "/sys/module/$m" ] || echo "$m" >> /run/testvm/missing-modules
done
"""


def cpu_mask(cpus: int) -> str:
    """The sysfs cpumask of CPUs 0..cpus-1: hex, in comma-separated 32-bit words."""
    mask = (1 << cpus) - 1
    words = []  # least significant first
    while True:
        words.append(mask & 0xFFFFFFFF)
        mask >>= 32
        if not mask:
            break
    top, *rest = reversed(words)
    return ",".join([f"{top:x}", *(f"{word:08x}" for word in rest)])


def stage2_setup(kc: KernelCache, opts: VMOptions) -> str:
    """Shell that loads the modules and brings up two RDMA nodes: rxe0/veth0, rxe1/veth1."""
    agent_ip, host_ip = RXE_ADDR.split("/", maxsplit=1)[0], HOST_RXE_ADDR.split("/", maxsplit=1)[0]
    quiet = "" if opts.verbose else "echo '1 4 1 7' > /proc/sys/kernel/printk\n"
    rps_mask = cpu_mask(opts.smp)  # every CPU of the guest
    return f"""set -u
fail() {{
    echo "$*" > /run/testvm/error
    echo "testvm: set-up failed: $*" >&2
    dmesg | tail -n 15 >&2
    exit 1
}}
{quiet}hostname testvm
{load_modules(kc)}mount -t configfs configfs /sys/kernel/config 2>/dev/null  # nvmet's interface
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null  # podman's runc needs a cgroup mount
ip link set lo up
ip link add veth0 type veth peer name veth1 || fail "cannot create veth0/veth1"
# jumbo frames, as RoCE fabrics run: rxe's active MTU follows the netdev's (4096 here,
# 1024 at 1500), and perftest and the project both use the port's active MTU
ip link set veth0 mtu {VETH_MTU} && ip link set veth1 mtu {VETH_MTU} || fail "cannot set the MTU"
ip addr add {RXE_ADDR} dev veth0 || fail "cannot address veth0"
ip addr add {HOST_RXE_ADDR} dev veth1 || fail "cannot address veth1"
ip link set veth0 up && ip link set veth1 up || fail "cannot bring veth0/veth1 up"
# Receive packet steering on both ends. veth hands a packet to the backlog of the CPU that
# sent it, and rxe sends a QP's packets from whichever CPU runs its requester, so two
# CPUs' backlogs delivered one QP's packets out of order. rxe answers a gap with a
# sequence NAK, counts the retransmission against the QP's retry budget, and a stream of
# 1 MiB WRITEs spent it: IBV_WC_RETRY_EXC_ERR with both peers alive and no packet lost.
# RPS hashes each flow (one QP's UDP port pair) to one CPU, so each QP's packets stay
# in order (docs/performance-history.md, "Out-of-order packets on the test bed's veth
# pair").
for dev in veth0 veth1; do
    echo {rps_mask} > /sys/class/net/$dev/queues/rx-0/rps_cpus || fail "cannot set RPS on $dev"
done
# Both addresses are local, so the kernel would deliver rxe1 -> rxe0 over lo (and 6.1's
# rxe is not namespace-aware): route each by its output device across the pair instead.
for dev in all default veth0 veth1; do
    echo 1 > /proc/sys/net/ipv4/conf/$dev/accept_local \
        && echo 0 > /proc/sys/net/ipv4/conf/$dev/rp_filter \
        || fail "cannot set accept_local/rp_filter on $dev"
done
ip rule add pref 10 oif veth1 lookup 101 && ip rule add pref 11 oif veth0 lookup 100 \
    && ip rule add pref 1000 lookup local && ip rule del pref 0 lookup local \
    || fail "cannot add the policy rules that send the pair's traffic across it"
ip route add {host_ip}/32 dev veth0 src {agent_ip} table 100 \
    && ip route add {agent_ip}/32 dev veth1 src {host_ip} table 101 \
    || fail "cannot add the routes across the pair"
rdma link add {AGENT_DEVICE} type rxe netdev veth0 || fail "rdma link add {AGENT_DEVICE} failed"
rdma link add {HOST_DEVICE} type rxe netdev veth1 || fail "rdma link add {HOST_DEVICE} failed"
for dev in {AGENT_DEVICE} {HOST_DEVICE}; do
    i=0
    until rdma link show $dev/1 2>/dev/null | grep -q 'state ACTIVE'; do
        i=$((i + 1)); [ "$i" -ge 100 ] && fail "$dev port 1 not ACTIVE after 10 s"
        sleep 0.1
    done
done
cd {shlex.quote(str(opts.root.checkout))} || fail "cannot enter the checkout"
"""


def terminal_size() -> os.terminal_size:
    """Size of the user's terminal (stdin's, as stdout may be piped), else 80x24."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            return os.get_terminal_size(fd)
    return os.terminal_size((80, 24))


def stage2_script(kc: KernelCache, opts: VMOptions) -> str:
    """The whole stage 2, run by the host's /bin/sh inside the chroot."""
    script = stage2_setup(kc, opts) + quote_env(guest_env(opts))
    if opts.command is None:
        size = terminal_size()
        tty = f"/dev/{opts.arch.console}"
        return script + (
            f"stty -F {tty} rows {size.lines} cols {size.columns} 2>/dev/null\n"
            "echo 'testvm: rxe0 (agent) on veth0 and rxe1 (host) on veth1 are up;"
            " exit the shell to power the VM off'\n"
            "export PS1='testvm:\\w# '\n"
            f"setsid -c /bin/bash --norc -i <>{tty} >&0 2>&1\n"
            'echo "$?" > /run/testvm/rc\n'
        )
    return script + (
        f"printf '{START_MARK.decode().strip()}\\n'\n"
        f"( {shlex.join(opts.command)} ) </dev/null\n"
        "rc=$?\n"
        'echo "$rc" > /run/testvm/rc\n'
        f"printf '\\n{END_MARK.decode().strip()}\\n'\n"
    )
