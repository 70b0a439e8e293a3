"""Booting QEMU: its command line, the control share, the console relay and the exit status."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

from vmcommon import CONSOLE_TAIL_LINES, OUT_DIR, harness_failure, need_tool, say
from vmguest import END_MARK, GUEST_PATH, START_MARK, GuestRoot, VMOptions, quote_env, stage2_script
from vmkernel import KernelCache, ensure_cache

ANSI_ESCAPE_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[^\[])")
CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
COMPILE_EXCLUDE = (
    r"/(\.git|\.venv|venv|\.testvm|\.tox|\.nox|\.mypy_cache|\.ruff_cache|\.pytest_cache"
    r"|\.hypothesis|node_modules|build)(/|$)"
)


def qemu_share(path: Path, tag: str, extra: str = "") -> list[str]:
    """A -virtfs option for one 9p share (commas in the path doubled for QEMU)."""
    escaped = str(path).replace(",", ",,")
    return [
        "-virtfs",
        f"local,path={escaped},mount_tag={tag},security_model=none,multidevs=remap{extra}",
    ]


def qemu_argv(kc: KernelCache, opts: VMOptions, ctl: Path) -> list[str]:
    """The QEMU command line (TCG: KVM hangs in early boot on these machines)."""
    arch = opts.arch
    console = "" if opts.verbose else " quiet loglevel=3"
    append = (
        f"console={arch.console} rdinit=/init panic=-1 {arch.cmdline}{console} "
        f"TESTVM_VERBOSE={int(opts.verbose)}"
    )
    return [
        need_tool(arch.qemu, arch.qemu_package),
        *arch.machine,
        *("-m", str(opts.mem_mib), "-smp", str(opts.smp)),
        *("-nographic", "-no-reboot", "-net", "none"),
        *("-kernel", str(kc.boot_image), "-initrd", str(kc.initrd), "-append", append),
        *qemu_share(opts.root.host_dir, "testvm_root", ",readonly=on"),
        *qemu_share(ctl, "testvm_ctl"),
        *qemu_share(OUT_DIR, "testvm_out"),
    ]


def write_control(ctl: Path, kc: KernelCache, opts: VMOptions) -> None:
    """Write the files the guest reads from the control share."""
    term = os.environ.get("TERM", "vt100") if opts.command is None else "dumb"
    config = quote_env(
        [
            ("TESTVM_CHECKOUT", str(opts.root.checkout)),
            ("TESTVM_OUT", str(opts.root.out)),
            ("TESTVM_PATH", opts.root.path_prefix + GUEST_PATH),
            ("TESTVM_TERM", term),
        ]
    )
    (ctl / "config.sh").write_text(config)
    (ctl / "stage2.sh").write_text(stage2_script(kc, opts))


def precompile(root: GuestRoot) -> None:
    """Byte-compile the checkout on the host: the guest's root is read-only and slow.

    The bytecode records the paths the guest sees (the checkout under a foreign root).
    """
    python = "/usr/bin/python3" if Path("/usr/bin/python3").is_file() else sys.executable
    here = root.host_dir / root.checkout.relative_to("/")
    argv = [python, "-m", "compileall", "-q", "-j", "0", "-x", COMPILE_EXCLUDE]
    argv += [*(("-d", str(root.checkout)) if here != root.checkout else ()), str(here)]
    proc = subprocess.run(argv, stdout=sys.stderr, check=False)
    if proc.returncode != 0:
        say("warning: compileall reported errors (see above); continuing")


class ConsoleRelay:
    """Filters the serial console: boot noise is kept for diagnostics, CMD's output streams.

    With verbose, the console before and after the command is shown too (with the
    firmware's terminal escapes removed); the command's own output is never altered
    except for the tty's CR LF line ends.
    """

    def __init__(self, sink: IO[bytes], verbose: bool) -> None:  # noqa: FBT001
        self._sink = sink
        self._verbose = verbose
        self._held = b""  # undecided bytes (a possible marker prefix or a lone \r)
        self._streaming = False
        self._done = False
        self._tail = bytearray()

    def feed(self, data: bytes) -> None:
        """Take a chunk of console output."""
        buf = self._held + data
        self._held = b""
        if buf.endswith(b"\r"):
            buf, self._held = buf[:-1], b"\r"
        buf = buf.replace(b"\r\n", b"\n")
        self._tail += data
        del self._tail[: max(0, len(self._tail) - 16384)]
        self._route(buf)

    def _route(self, buf: bytes) -> None:
        if self._done:
            self._noise(buf)
            return
        if not self._streaming:
            index = buf.find(START_MARK)
            if index < 0:
                keep = keep_marker_prefix(buf, START_MARK)
                self._noise(buf[: len(buf) - len(keep)])
                self._held = keep + self._held
                return
            self._noise(buf[:index])
            self._streaming = True
            buf = buf[index + len(START_MARK) :]
        index = buf.find(END_MARK)
        if index >= 0:
            self._emit(buf[:index])
            self._done = True
            self._noise(buf[index + len(END_MARK) :])
            return
        keep = keep_marker_prefix(buf, END_MARK)
        self._emit(buf[: len(buf) - len(keep)])
        self._held = keep + self._held

    def close(self) -> None:
        """Flush what was held back when the console ends without an end marker."""
        if self._streaming and not self._done:
            self._emit(self._held.replace(b"\r", b""))
        self._held = b""

    def _noise(self, data: bytes) -> None:
        """Console output around the command: shown only with verbose."""
        if self._verbose:
            self._emit(sanitize(data).encode())

    def _emit(self, data: bytes) -> None:
        if data:
            self._sink.write(data)
            self._sink.flush()

    @property
    def started(self) -> bool:
        """True once the command has been started in the guest."""
        return self._streaming

    def tail(self, lines: int = CONSOLE_TAIL_LINES) -> list[str]:
        """The last lines of the console, for a failure report."""
        text = sanitize(bytes(self._tail))
        return [line for line in text.splitlines() if line.strip()][-lines:]


def sanitize(data: bytes) -> str:
    """Console bytes as text without terminal escapes or control characters."""
    text = ANSI_ESCAPE_RE.sub("", data.decode("utf-8", "replace"))
    return CONTROL_RE.sub("", text.replace("\r\n", "\n"))


def keep_marker_prefix(buf: bytes, marker: bytes) -> bytes:
    """The longest suffix of buf that is a proper prefix of marker (to hold back)."""
    for size in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-size:]):
            return buf[-size:]
    return b""


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate QEMU, killing it if it does not go."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pump(proc: subprocess.Popen[bytes], relay: ConsoleRelay, timeout: float | None) -> bool:
    """Relay QEMU's output until it exits; False if the timeout ran out first."""
    assert proc.stdout is not None  # noqa: S101 - set by Popen(stdout=PIPE)
    fd = proc.stdout.fileno()
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        if wait <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], wait)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                proc.wait()
                return True
            relay.feed(data)


def boot_piped(argv: Sequence[str], opts: VMOptions) -> tuple[bool, ConsoleRelay]:
    """Run QEMU with its console relayed to stdout; returns (finished, relay)."""
    relay = ConsoleRelay(sys.stdout.buffer, opts.verbose)
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        finished = pump(proc, relay, opts.timeout)
    finally:
        stop(proc)
        relay.close()
    return finished, relay


def boot_interactive(argv: Sequence[str], opts: VMOptions) -> bool:
    """Run QEMU on the user's terminal; returns False on timeout."""
    say("booting; Ctrl-A X kills the VM, 'exit' powers it off")
    proc = subprocess.Popen(argv)
    try:
        proc.wait(timeout=opts.timeout)
    except subprocess.TimeoutExpired:
        return False
    finally:
        stop(proc)
    return True


def read_status(ctl: Path) -> tuple[int | None, str | None]:
    """The exit code the guest recorded, and its set-up error if any."""
    rc_file, err_file = ctl / "rc", ctl / "error"
    error = err_file.read_text().strip() if err_file.is_file() else None
    if rc_file.is_file():
        with contextlib.suppress(ValueError):
            return int(rc_file.read_text().strip()), error
    return None, error


def boot(opts: VMOptions) -> int:
    """Boot the VM for one command (or a shell) and return the exit code to use."""
    kc = ensure_cache(opts.arch)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    precompile(opts.root)
    with tempfile.TemporaryDirectory(prefix="testvm-ctl-") as tmp:
        ctl = Path(tmp)
        write_control(ctl, kc, opts)
        argv = qemu_argv(kc, opts, ctl)
        if opts.verbose:
            say(shlex.join(argv))
        where = f"{opts.mem_mib} MiB, {opts.smp} CPUs, root {opts.root.host_dir}"
        say(f"booting {kc.version} (TCG, {where})")
        console: list[str] = []
        started = True
        if opts.command is None:
            finished = boot_interactive(argv, opts)
        else:
            finished, relay = boot_piped(argv, opts)
            console, started = relay.tail(), relay.started
        rc, error = read_status(ctl)
        if (ctl / "missing-modules").is_file():
            missing = (ctl / "missing-modules").read_text().split()
            say(f"optional modules not loaded: {' '.join(missing)}")
    if not finished:
        during = "while the command ran" if started else "before the command started"
        return harness_failure(f"timed out after {opts.timeout:.0f} s {during}", console)
    if error is not None:
        return harness_failure(f"VM set-up failed: {error}", console)
    if rc is None:
        return harness_failure("the VM stopped without recording an exit code", console)
    return rc
