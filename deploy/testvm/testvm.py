#!/usr/bin/env python3
"""Soft-RoCE test VM: run a command on Debian's kernel, over this machine's own root.

The host kernel has no RDMA (no rdma_rxe), no tc flower and no NVMe target, so the
tests that need them run in a small QEMU guest instead:

* ``fetch`` downloads Debian's ``linux-image-6.1.0-*-amd64`` package with
  ``apt-get download``, unpacks it with ``dpkg -x`` (no install, no initramfs
  generation), runs ``depmod`` on the unpacked tree, decompresses the ELF kernel
  and builds a tiny initramfs (busybox-static and the 9p boot modules).  Cached per
  kernel version under ${DPU_TESTVM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dpu-testvm}.
* ``run -- CMD ARGS...`` boots that kernel under TCG with the host's ``/`` shared
  read-only over 9p, chroots into it (so the host's own Python and the project's
  virtualenv run unchanged), loads rdma_rxe, tc, veth, vxlan, NBD and NVMe-oF modules
  (and mounts configfs),
  creates ``veth0``/``veth1`` and the soft-RoCE device ``rxe0``, runs CMD with the
  checkout as working directory, streams its output, and exits with its exit code.
  ``<checkout>/.testvm/out`` is shared read-write at the same absolute path.
* ``shell`` does the same set-up and gives an interactive shell.

``--arch arm64`` boots an arm64 guest instead (cortex-a72, BlueField-2's core, under
TCG) on Debian's arm64 kernel, over the arm64 Debian root that
deploy/aarch64/run-tests.sh builds (the checkout copied to /src; needs root), with the
same two RDMA nodes, options, output folder and exit codes.

Exit status 125 means the harness itself failed (no boot, timeout, set-up error);
its reason is one line on stderr, followed by the last console lines.
The harness is this command line and five modules beside it: vmarch (the guest
architectures, one row each), vmcommon (paths, errors, host tools), vmkernel (the kernel
cache and the initramfs), vmguest (what runs in the guest) and vmboot (QEMU, the console,
the exit status). See deploy/testvm/README.md.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

from vmarch import ARCHES, DEFAULT_ARCH
from vmboot import boot
from vmcommon import EXIT_INTERRUPTED, HarnessError, harness_failure, say
from vmguest import VMOptions, guest_root
from vmkernel import fetch

DEFAULT_TIMEOUT = 900.0
DEFAULT_MEM_MIB = 2048
DEFAULT_SMP = 2
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Parse repeated --env NAME=VALUE options."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not ENV_NAME_RE.match(name):
            raise HarnessError(f"--env expects NAME=VALUE, got {item!r}")
        pairs.append((name, value))
    return tuple(pairs)


def add_arch_option(parser: argparse.ArgumentParser) -> None:
    """--arch, for every subcommand."""
    parser.add_argument(
        "--arch",
        choices=sorted(ARCHES),
        default=DEFAULT_ARCH,
        help="the guest's architecture: amd64 over this machine's root; arm64 (cortex-a72, "
        "BlueField-2's core) over the arm64 root of deploy/aarch64, the checkout copied to "
        "/src, needs root (default: %(default)s)",
    )


def add_vm_options(parser: argparse.ArgumentParser, timeout: float | None) -> None:
    """Options shared by run and shell."""
    add_arch_option(parser)
    parser.add_argument(
        "--timeout",
        type=float,
        default=timeout,
        metavar="SECONDS",
        help="kill the VM after this long, boot included (default: %(default)s)",
    )
    parser.add_argument(
        "--mem",
        type=int,
        default=DEFAULT_MEM_MIB,
        metavar="MiB",
        help="guest memory (default: %(default)s)",
    )
    parser.add_argument(
        "--smp",
        type=int,
        default=DEFAULT_SMP,
        metavar="N",
        help="guest CPUs (default: %(default)s)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a variable for the command (repeatable)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show the whole console (kernel, init, set-up)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser for all subcommands."""
    parser = argparse.ArgumentParser(
        prog="testvm.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="{fetch,run,shell}")
    fetch_parser = sub.add_parser(
        "fetch",
        help="download and unpack the kernel, build the initramfs (cached, idempotent)",
        description="Cache Debian's kernel and the initramfs under "
        "${DPU_TESTVM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dpu-testvm}.",
    )
    add_arch_option(fetch_parser)
    run = sub.add_parser(
        "run",
        help="boot the VM, run CMD in the checkout, exit with its status",
        description="Boot the VM, bring up rxe0 on veth0, run CMD (cwd: the checkout) and exit "
        "with its exit status; 125 if the VM itself failed. Example: "
        "testvm.py run -- .venv/bin/python -m pytest tests/vm",
    )
    add_vm_options(run, DEFAULT_TIMEOUT)
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command")
    shell = sub.add_parser(
        "shell",
        help="the same VM with an interactive shell",
        description="Boot the VM with rxe0 up and give an interactive bash on its console "
        "(cwd: the checkout). 'exit' powers the VM off; Ctrl-A X kills it.",
    )
    add_vm_options(shell, None)
    return parser


def options_from(args: argparse.Namespace) -> VMOptions:
    """Build VMOptions from parsed run/shell arguments."""
    command: tuple[str, ...] | None = None
    if args.action == "run":
        command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
        if not command:
            raise HarnessError("run needs a command: testvm.py run -- CMD ARGS...")
    if args.mem < 256 or args.smp < 1:
        raise HarnessError("--mem must be at least 256 and --smp at least 1")
    arch = ARCHES[args.arch]
    return VMOptions(
        arch=arch,
        root=guest_root(arch),
        command=command,
        env=parse_env(args.env),
        mem_mib=args.mem,
        smp=args.smp,
        timeout=args.timeout,
        verbose=args.verbose,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    try:
        if args.action == "fetch":
            fetch(ARCHES[args.arch])
            return 0
        return boot(options_from(args))
    except HarnessError as exc:
        return harness_failure(str(exc), [])
    except KeyboardInterrupt:
        say("interrupted")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
