"""What runs inside the guest: its environment and stage 2 (modules, veth, rxe, CMD)."""

from __future__ import annotations

import contextlib
import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

from vmcommon import CHECKOUT

if TYPE_CHECKING:
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
)
GUEST_TMP = "/tmp"  # noqa: S108 - the guest's own fresh tmpfs
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RXE_ADDR = "192.168.77.1/24"
VETH_MTU = 9000  # the veth pair rxe0 sits on: RoCE MTU 4096
START_MARK = b"@@testvm:start@@\n"
END_MARK = b"\n@@testvm:end@@"


@dataclass(frozen=True)
class VMOptions:
    """What the guest is asked to do."""

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
        ("PATH", GUEST_PATH),
        ("HOME", GUEST_TMP),
        ("TMPDIR", GUEST_TMP),
        ("LANG", "C.UTF-8"),
        ("TERM", term),
        ("PYTHONDONTWRITEBYTECODE", "1"),
        # The checkout is read-only in the guest: hypothesis' pytest plugin would warn
        # (an error under filterwarnings=error) that it cannot write .hypothesis/ there.
        ("HYPOTHESIS_STORAGE_DIRECTORY", f"{GUEST_TMP}/.hypothesis"),
        ("DPU_TESTVM", "1"),
        *opts.env,
    ]


def stage2_setup(kc: KernelCache, verbose: bool) -> str:  # noqa: FBT001
    """Shell that loads the modules and brings up veth0/veth1 and rxe0."""
    mods = " ".join(OPTIONAL_MODULES)
    quiet = "" if verbose else "echo '1 4 1 7' > /proc/sys/kernel/printk\n"
    return f"""set -u
fail() {{
    echo "$*" > /run/testvm/error
    echo "testvm: set-up failed: $*" >&2
    dmesg | tail -n 15 >&2
    exit 1
}}
{quiet}hostname testvm
MODROOT={shlex.quote(str(kc.root))}
for m in {" ".join(REQUIRED_MODULES)}; do
    modprobe -d "$MODROOT" "$m" || fail "cannot load kernel module $m"
done
modprobe -a -q -d "$MODROOT" {mods} 2>/dev/null
for m in {mods}; do
    [ -d "/sys/module/$m" ] || echo "$m" >> /run/testvm/missing-modules
done
mount -t configfs configfs /sys/kernel/config 2>/dev/null  # nvmet's interface
ip link set lo up
ip link add veth0 type veth peer name veth1 || fail "cannot create veth0/veth1"
# jumbo frames, as RoCE fabrics run: rxe's active MTU follows the netdev's (4096 here,
# 1024 at 1500), and perftest and the project both use the port's active MTU
ip link set veth0 mtu {VETH_MTU} && ip link set veth1 mtu {VETH_MTU} || fail "cannot set the MTU"
ip addr add {RXE_ADDR} dev veth0 || fail "cannot address veth0"
ip link set veth0 up && ip link set veth1 up || fail "cannot bring veth0/veth1 up"
rdma link add rxe0 type rxe netdev veth0 || fail "rdma link add rxe0 failed"
i=0
until rdma link show rxe0/1 2>/dev/null | grep -q 'state ACTIVE'; do
    i=$((i + 1)); [ "$i" -ge 100 ] && fail "rxe0 port 1 not ACTIVE after 10 s"
    sleep 0.1
done
cd {shlex.quote(str(CHECKOUT))} || fail "cannot enter the checkout"
"""


def terminal_size() -> os.terminal_size:
    """Size of the user's terminal (stdin's, as stdout may be piped), else 80x24."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            return os.get_terminal_size(fd)
    return os.terminal_size((80, 24))


def stage2_script(kc: KernelCache, opts: VMOptions) -> str:
    """The whole stage 2, run by the host's /bin/sh inside the chroot."""
    script = stage2_setup(kc, opts.verbose) + quote_env(guest_env(opts))
    if opts.command is None:
        size = terminal_size()
        return script + (
            f"stty -F /dev/ttyS0 rows {size.lines} cols {size.columns} 2>/dev/null\n"
            "echo 'testvm: rxe0 is up on veth0; exit the shell to power the VM off'\n"
            "export PS1='testvm:\\w# '\n"
            "setsid -c /bin/bash --norc -i <>/dev/ttyS0 >&0 2>&1\n"
            'echo "$?" > /run/testvm/rc\n'
        )
    return script + (
        f"printf '{START_MARK.decode().strip()}\\n'\n"
        f"( {shlex.join(opts.command)} ) </dev/null\n"
        "rc=$?\n"
        'echo "$rc" > /run/testvm/rc\n'
        f"printf '\\n{END_MARK.decode().strip()}\\n'\n"
    )
