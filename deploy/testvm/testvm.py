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

Exit status 125 means the harness itself failed (no boot, timeout, set-up error);
its reason is one line on stderr, followed by the last console lines.
See deploy/testvm/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import lzma
import os
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

PROG = "testvm"
EXIT_HARNESS = 125
EXIT_INTERRUPTED = 130
CHECKOUT = Path(__file__).resolve().parents[2]
OUT_DIR = CHECKOUT / ".testvm" / "out"

META_PACKAGE = "linux-image-amd64"
KERNEL_PACKAGE_RE = re.compile(r"^\s*Depends:\s*(linux-image-(\d[\w.+-]*-amd64))\s*$", re.MULTILINE)
# Loaded (with their dependencies from modules.dep) by the initramfs before the 9p root.
BOOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p")
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
BUSYBOX = Path("/bin/busybox")
GUEST_TMP = "/tmp"  # noqa: S108 - the guest's own fresh tmpfs
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RXE_ADDR = "192.168.77.1/24"
VETH_MTU = 9000  # the veth pair rxe0 sits on: RoCE MTU 4096
DEFAULT_TIMEOUT = 900.0
DEFAULT_MEM_MIB = 2048
DEFAULT_SMP = 2
CONSOLE_TAIL_LINES = 30
START_MARK = b"@@testvm:start@@\n"
END_MARK = b"\n@@testvm:end@@"
ANSI_ESCAPE_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[^\[])")
CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
COMPILE_EXCLUDE = (
    r"/(\.git|\.venv|venv|\.testvm|\.tox|\.nox|\.mypy_cache|\.ruff_cache|\.pytest_cache"
    r"|\.hypothesis|node_modules|build)(/|$)"
)

# PID 1 of the guest: busybox sh from the initramfs.  Mounts the 9p root and the
# shares, chroots into the host's root for stage 2, then powers the guest off.
INIT_SCRIPT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
log() { [ "${TESTVM_VERBOSE:-0}" = 1 ] && echo "testvm-init: $*"; }
die() {
    echo "testvm-init: $*"
    [ -d /ctl ] && echo "$*" > /ctl/error 2>/dev/null
    sync; poweroff -f; sleep 10
}
mount9p() {  # mount9p TAG DIR OPTIONS
    n=0
    until mount -t 9p -o "trans=virtio,version=9p2000.L,msize=262144,$3" "$1" "$2" 2>/dev/null; do
        n=$((n + 1)); [ "$n" -ge 50 ] && return 1
        sleep 0.1
    done
}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in /modules/*.ko; do
    log "insmod $m"
    insmod "$m" || die "insmod $m failed"
done
mount9p testvm_ctl /ctl cache=none || die "cannot mount the control share"
. /ctl/config.sh
R=/newroot
mount9p testvm_root "$R" ro,cache=loose || die "cannot mount the host root over 9p"
mount -t proc proc "$R/proc" || die "cannot mount /proc"
mount -t sysfs sysfs "$R/sys" || die "cannot mount /sys"
mount -t devtmpfs devtmpfs "$R/dev" || die "cannot mount /dev"
mkdir -p "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666 devpts "$R/dev/pts"
mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm"
ln -sf /proc/self/fd "$R/dev/fd"
ln -sf /proc/self/fd/0 "$R/dev/stdin"
ln -sf /proc/self/fd/1 "$R/dev/stdout"
ln -sf /proc/self/fd/2 "$R/dev/stderr"
# The checkout may live under /tmp or /run (a CI clone), which the tmpfs mounts below
# would hide: keep a bind of it and put it back on top afterwards.
mkdir -p /keep
mount -o bind "$R$TESTVM_CHECKOUT" /keep || die "cannot bind the checkout $TESTVM_CHECKOUT"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp" || die "cannot mount /tmp"
mount -t tmpfs -o mode=0755 tmpfs "$R/run" || die "cannot mount /run"
if [ ! -d "$R$TESTVM_CHECKOUT" ]; then
    mkdir -p "$R$TESTVM_CHECKOUT" && mount -o bind /keep "$R$TESTVM_CHECKOUT" \
        || die "cannot restore the checkout at $TESTVM_CHECKOUT"
fi
mkdir -p "$R/run/testvm"
mount -o bind /ctl "$R/run/testvm" || die "cannot bind the control share"
mount9p testvm_out "$R$TESTVM_OUT" cache=none || die "cannot mount the output share at $TESTVM_OUT"
log "entering the host root"
env -i PATH="$TESTVM_PATH" HOME=/tmp TERM="${TESTVM_TERM:-dumb}" \
    chroot "$R" /bin/sh /run/testvm/stage2.sh
kill -9 -1 2>/dev/null
sync
umount "$R$TESTVM_OUT" 2>/dev/null
poweroff -f
sleep 10
"""


class HarnessError(Exception):
    """The harness failed (as opposed to the command it runs)."""


def say(msg: str) -> None:
    """Print a progress line of the harness on stderr."""
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """Return the cache directory: $DPU_TESTVM_CACHE, else $XDG_CACHE_HOME or ~/.cache."""
    explicit = os.environ.get("DPU_TESTVM_CACHE")
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base).expanduser() / "dpu-testvm").resolve()


def need_tool(name: str, package: str) -> str:
    """Return the path of a host tool or fail naming the Debian package that has it."""
    for candidate in (shutil.which(name), f"/usr/sbin/{name}", f"/sbin/{name}"):
        if candidate and Path(candidate).is_file():
            return candidate
    raise HarnessError(
        f"'{name}' not found: apt-get install {package} (see deploy/testvm/apt-packages.txt)"
    )


def run_tool(argv: Sequence[str], what: str, cwd: Path | None = None) -> str:
    """Run a host tool, returning its stdout; raise HarnessError with its stderr on failure."""
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise HarnessError(f"{what} failed ({shlex.join(argv)}): {' / '.join(detail)}")
    return proc.stdout


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock file while fetching, so parallel runs do not race."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ------------------------------------------------------------------ kernel cache


@dataclass(frozen=True)
class KernelCache:
    """One unpacked kernel (by version) and its initramfs in the cache."""

    version: str
    base: Path

    @property
    def root(self) -> Path:
        """Directory the kernel package was unpacked into (the modprobe -d root)."""
        return self.base / "root"

    @property
    def vmlinuz(self) -> Path:
        """The kernel image."""
        return self.root / "boot" / f"vmlinuz-{self.version}"

    @property
    def vmlinux(self) -> Path:
        """The decompressed ELF kernel (booted via PVH: no emulated decompression)."""
        return self.base / "vmlinux"

    @property
    def boot_image(self) -> Path:
        """What QEMU boots: the ELF kernel if it could be extracted, else the bzImage."""
        return self.vmlinux if self.vmlinux.is_file() else self.vmlinuz

    @property
    def moddir(self) -> Path:
        """The kernel's module tree."""
        return self.root / "lib" / "modules" / self.version

    @property
    def initrd(self) -> Path:
        """The harness's own initramfs."""
        return self.base / "initrd.img"

    @property
    def kernel_stamp(self) -> Path:
        """Exists once the kernel is unpacked and depmod has run."""
        return self.base / "kernel.ok"

    @property
    def initrd_stamp(self) -> Path:
        """Holds the digest of the inputs the current initramfs was built from."""
        return self.base / "initrd.sha256"


def resolve_kernel_package() -> tuple[str, str]:
    """Return (package, kernel version) that linux-image-amd64 currently depends on."""
    out = run_tool(
        [need_tool("apt-cache", "apt"), "depends", META_PACKAGE],
        f"apt-cache depends {META_PACKAGE}",
    )
    match = KERNEL_PACKAGE_RE.search(out)
    if not match:
        raise HarnessError(
            f"cannot resolve the kernel package from '{META_PACKAGE}' (run 'apt-get update' first?)"
        )
    return match.group(1), match.group(2)


def apt_download(package: str, dest: Path) -> Path:
    """Download one .deb into dest with apt-get download and return its path."""
    argv = [need_tool("apt-get", "apt"), "-q", "download", package]
    if os.geteuid() == 0:
        argv[2:2] = ["-o", "APT::Sandbox::User=root"]  # _apt cannot write into our dir
    run_tool(argv, f"apt-get download {package}", cwd=dest)
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise HarnessError(f"apt-get download {package} produced no .deb in {dest}")
    return debs[-1]


def unpack_kernel(package: str, version: str, dest: Path) -> None:
    """Download, dpkg -x and depmod the kernel package into dest/root."""
    say(f"downloading {package} (apt-get download) ...")
    deb = apt_download(package, dest)
    say(f"unpacking {deb.name} (dpkg -x, no install) ...")
    root = dest / "root"
    run_tool([need_tool("dpkg", "dpkg"), "-x", str(deb), str(root)], "dpkg -x")
    deb.unlink()
    staged = KernelCache(version, dest)
    if not staged.vmlinuz.is_file() or not staged.moddir.is_dir():
        raise HarnessError(f"{package} has no {staged.vmlinuz.name} or modules/{version}")
    say(f"depmod -b {root} {version} ...")
    run_tool([need_tool("depmod", "kmod"), "-b", str(root), version], "depmod")


def ensure_kernel(kc: KernelCache, package: str) -> None:
    """Unpack the kernel into the cache unless it is already there (atomically)."""
    if kc.kernel_stamp.is_file():
        say(f"kernel {kc.version} already cached in {kc.base}")
        return
    staging = Path(tempfile.mkdtemp(prefix=f".{kc.version}.", dir=kc.base.parent))
    try:
        unpack_kernel(package, kc.version, staging)
        (staging / "kernel.ok").write_text(f"{package}\n")
        if kc.base.exists():
            shutil.rmtree(kc.base)
        staging.rename(kc.base)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def cached_kernels(root: Path) -> list[KernelCache]:
    """Complete kernels in the cache, newest version last."""
    found = [KernelCache(stamp.parent.name, stamp.parent) for stamp in root.glob("*/kernel.ok")]
    return sorted(found, key=lambda kc: version_key(kc.version))


def version_key(version: str) -> list[tuple[int, str]]:
    """Sort key that orders 6.1.0-9 before 6.1.0-10."""
    return [
        (int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"[.-]", version)
    ]


def extract_vmlinux(vmlinuz: Path, dest: Path) -> bool:
    """Decompress the ELF kernel out of an xz-compressed bzImage into dest.

    Under TCG the kernel's own decompressor takes about 3.5 s of every boot; QEMU
    boots the ELF directly through its PVH entry point (Debian's kernel has CONFIG_PVH).
    """
    data = vmlinuz.read_bytes()
    start = data.find(b"\xfd7zXZ\x00")
    if start < 0:
        return False
    try:
        elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[start:])
    except lzma.LZMAError:
        return False
    if elf[:4] != b"\x7fELF":
        return False
    tmp = dest.with_suffix(".tmp")
    tmp.write_bytes(elf)
    tmp.rename(dest)
    return True


def ensure_vmlinux(kc: KernelCache) -> None:
    """Extract the ELF kernel once (falls back to booting the bzImage)."""
    if kc.vmlinux.is_file():
        return
    say(f"decompressing {kc.vmlinuz.name} to {kc.vmlinux} ...")
    if not extract_vmlinux(kc.vmlinuz, kc.vmlinux):
        say("no xz payload found: booting the bzImage (slower)")


# ------------------------------------------------------------------ initramfs


def module_name(relpath: str) -> str:
    """Return the module name of a modules.dep path (dashes become underscores)."""
    base = re.sub(r"\.ko(\.(xz|gz))?$", "", relpath.rsplit("/", 1)[-1])
    return base.replace("-", "_")


def read_modules_dep(moddir: Path) -> dict[str, tuple[str, list[str]]]:
    """Parse modules.dep into name -> (path, [dependency paths])."""
    table: dict[str, tuple[str, list[str]]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        path, _, deps = line.partition(":")
        table[module_name(path)] = (path, deps.split())
    return table


def boot_module_paths(moddir: Path, wanted: Sequence[str]) -> list[Path]:
    """Module files to insmod, dependencies first, skipping built-in modules."""
    table = read_modules_dep(moddir)
    builtin = {module_name(p) for p in (moddir / "modules.builtin").read_text().split()}
    by_path = dict(table.values())
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        for dep in by_path.get(path, []):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name in table:
            visit(table[name][0])
        elif name not in builtin:
            raise HarnessError(f"kernel module {name} is neither in modules.dep nor built in")
    return [moddir / path for path in order]


def module_bytes(path: Path) -> bytes:
    """Return a module file's contents, decompressed if needed."""
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix == ".gz":
        return gzip.decompress(data)
    return data


def is_static_elf(path: Path) -> bool:
    """True if path is an ELF executable without a PT_INTERP (dynamic loader) header."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    pt_interp = 3
    return all(
        struct.unpack_from("<I", data, phoff + i * phentsize)[0] != pt_interp for i in range(phnum)
    )


class CpioWriter:
    """Minimal writer of a cpio 'newc' archive (what the kernel unpacks as initramfs)."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._ino = 0

    def _put(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        pad = -self._size % 4
        if pad:
            self._chunks.append(b"\0" * pad)
            self._size += pad

    def entry(
        self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
    ) -> None:
        """Add one entry owned by root with the given mode (including the file type)."""
        self._ino += 1
        raw_name = name.encode() + b"\0"
        nlink = 2 if mode & 0o170000 == 0o040000 else 1
        fields = (self._ino, mode, 0, 0, nlink, 0, len(data), 0, 0, *rdev, len(raw_name), 0)
        header = b"070701" + b"".join(f"{value:08X}".encode() for value in fields)
        self._put(header + raw_name)
        if data:
            self._put(data)

    def directory(self, name: str) -> None:
        """Add a directory."""
        self.entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Add a regular file."""
        self.entry(name, 0o100000 | mode, data)

    def chardev(self, name: str, major: int, minor: int) -> None:
        """Add a character device node."""
        self.entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        """Return the archive with its trailer."""
        self.entry("TRAILER!!!", 0)
        return b"".join(self._chunks)


def initrd_digest(modules: Sequence[Path]) -> str:
    """Digest of everything the initramfs is made of, to know when to rebuild it."""
    digest = hashlib.sha256(INIT_SCRIPT.encode())
    digest.update(BUSYBOX.read_bytes())
    for module in modules:
        digest.update(module.name.encode())
    return digest.hexdigest()


def build_initrd(kc: KernelCache, modules: Sequence[Path]) -> bytes:
    """Return a gzip'd cpio with busybox, /init and the 9p boot modules."""
    cpio = CpioWriter()
    for directory in ("bin", "dev", "proc", "sys", "newroot", "ctl", "modules"):
        cpio.directory(directory)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", BUSYBOX.read_bytes(), 0o755)
    cpio.file("init", INIT_SCRIPT.encode(), 0o755)
    for index, module in enumerate(modules):
        cpio.file(f"modules/{index:02d}-{module_name(module.name)}.ko", module_bytes(module))
    say(f"initramfs for {kc.version}: busybox + {len(modules)} modules")
    return gzip.compress(cpio.finish(), compresslevel=6, mtime=0)


def ensure_initrd(kc: KernelCache) -> None:
    """(Re)build the initramfs if it is missing or its inputs changed."""
    if not BUSYBOX.is_file() or not is_static_elf(BUSYBOX):
        raise HarnessError(f"{BUSYBOX} is missing or not static: apt-get install busybox-static")
    modules = boot_module_paths(kc.moddir, BOOT_MODULES)
    digest = initrd_digest(modules)
    stamp = kc.initrd_stamp
    if kc.initrd.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return
    say(f"building initramfs {kc.initrd} ...")
    tmp = kc.initrd.with_suffix(".tmp")
    tmp.write_bytes(build_initrd(kc, modules))
    tmp.rename(kc.initrd)
    kc.initrd_stamp.write_text(digest + "\n")


def fetch() -> KernelCache:
    """Make sure the newest kernel that apt knows of and its initramfs are cached."""
    root = cache_root()
    say("resolving the kernel package with apt-cache ...")
    package, version = resolve_kernel_package()
    say(f"kernel package: {package}")
    kc = KernelCache(version, root / version)
    with locked(root / ".lock"):
        ensure_kernel(kc, package)
        ensure_vmlinux(kc)
        ensure_initrd(kc)
    say(f"ready: {kc.boot_image} + {kc.initrd.name} in {kc.base}")
    return kc


def ensure_cache() -> KernelCache:
    """Return the newest cached kernel, fetching one if the cache is empty."""
    root = cache_root()
    kernels = cached_kernels(root) if root.is_dir() else []
    if not kernels:
        say(f"no kernel cached in {root}: fetching one (once) ...")
        return fetch()
    kc = kernels[-1]
    with locked(root / ".lock"):
        ensure_vmlinux(kc)
        ensure_initrd(kc)
    return kc


# ------------------------------------------------------------------ the VM


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


def qemu_share(path: Path, tag: str, extra: str = "") -> list[str]:
    """A -virtfs option for one 9p share (commas in the path doubled for QEMU)."""
    escaped = str(path).replace(",", ",,")
    return [
        "-virtfs",
        f"local,path={escaped},mount_tag={tag},security_model=none,multidevs=remap{extra}",
    ]


def qemu_argv(kc: KernelCache, opts: VMOptions, ctl: Path) -> list[str]:
    """The QEMU command line (TCG: KVM hangs in early boot on these machines)."""
    console = "" if opts.verbose else " quiet loglevel=3"
    append = (
        f"console=ttyS0 rdinit=/init panic=-1 mitigations=off edd=off{console} "
        f"TESTVM_VERBOSE={int(opts.verbose)}"
    )
    return [
        need_tool("qemu-system-x86_64", "qemu-system-x86"),
        *("-accel", "tcg,thread=multi", "-cpu", "max"),
        *("-m", str(opts.mem_mib), "-smp", str(opts.smp)),
        *("-nographic", "-vga", "none", "-no-reboot", "-net", "none", "-bios", "qboot.rom"),
        *("-kernel", str(kc.boot_image), "-initrd", str(kc.initrd), "-append", append),
        *qemu_share(Path("/"), "testvm_root", ",readonly=on"),
        *qemu_share(ctl, "testvm_ctl"),
        *qemu_share(OUT_DIR, "testvm_out"),
    ]


def write_control(ctl: Path, kc: KernelCache, opts: VMOptions) -> None:
    """Write the files the guest reads from the control share."""
    term = os.environ.get("TERM", "vt100") if opts.command is None else "dumb"
    config = quote_env(
        [
            ("TESTVM_CHECKOUT", str(CHECKOUT)),
            ("TESTVM_OUT", str(OUT_DIR)),
            ("TESTVM_PATH", GUEST_PATH),
            ("TESTVM_TERM", term),
        ]
    )
    (ctl / "config.sh").write_text(config)
    (ctl / "stage2.sh").write_text(stage2_script(kc, opts))


def precompile() -> None:
    """Byte-compile the checkout on the host: the guest's root is read-only and slow."""
    python = "/usr/bin/python3" if Path("/usr/bin/python3").is_file() else sys.executable
    argv = [python, "-m", "compileall", "-q", "-j", "0", "-x", COMPILE_EXCLUDE, str(CHECKOUT)]
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


def harness_failure(reason: str, console: Sequence[str]) -> int:
    """Report a failure of the harness (one line, then the console tail) and return 125."""
    print(f"{PROG}: error: {reason}", file=sys.stderr)
    if console:
        print(f"{PROG}: last console lines:", file=sys.stderr)
        for line in console:
            print(f"    {line}", file=sys.stderr)
    sys.stderr.flush()
    return EXIT_HARNESS


def boot(opts: VMOptions) -> int:
    """Boot the VM for one command (or a shell) and return the exit code to use."""
    kc = ensure_cache()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    precompile()
    with tempfile.TemporaryDirectory(prefix="testvm-ctl-") as tmp:
        ctl = Path(tmp)
        write_control(ctl, kc, opts)
        argv = qemu_argv(kc, opts, ctl)
        if opts.verbose:
            say(shlex.join(argv))
        say(f"booting {kc.version} (TCG, {opts.mem_mib} MiB, {opts.smp} CPUs)")
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


# ------------------------------------------------------------------ command line


def parse_env(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """Parse repeated --env NAME=VALUE options."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not ENV_NAME_RE.match(name):
            raise HarnessError(f"--env expects NAME=VALUE, got {item!r}")
        pairs.append((name, value))
    return tuple(pairs)


def add_vm_options(parser: argparse.ArgumentParser, timeout: float | None) -> None:
    """Options shared by run and shell."""
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
    sub.add_parser(
        "fetch",
        help="download and unpack the kernel, build the initramfs (cached, idempotent)",
        description="Cache Debian's kernel and the initramfs under "
        "${DPU_TESTVM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dpu-testvm}.",
    )
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
    return VMOptions(
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
            fetch()
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
