"""The guest's kernel and initramfs, cached per kernel version.

Debian's kernel package fetched with apt-get download and unpacked without installing,
and a busybox initramfs that mounts the host's root over 9p, under
${DPU_TESTVM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dpu-testvm}.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vmarch import Arch

from vmcommon import HarnessError, cache_root, locked, need_tool, run_tool, say

HOST_BUSYBOX = Path("/bin/busybox")  # the native guest's (apt-packages.txt: busybox-static)
BUSYBOX_PACKAGE = "busybox-static"

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


@dataclass(frozen=True)
class KernelCache:
    """One unpacked kernel (by version) and its initramfs in the cache."""

    arch: Arch
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
    def busybox(self) -> Path:
        """The initramfs' busybox: the host's, or the foreign architecture's own."""
        return self.base / "busybox" if self.arch.foreign else HOST_BUSYBOX

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


def apt_options(arch: Arch) -> list[str]:
    """The apt options for arch: none for the host's own; a private configuration for another.

    The host's sources (/etc/apt/sources.list{,.d}) with the architecture, the package
    lists and the download cache replaced, so nothing of the host's apt state changes.
    """
    if not arch.foreign:
        return []
    base = cache_root() / f"apt-{arch.name}"
    for sub in ("lists/partial", "archives/partial"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    (base / "status").touch()
    settings = {
        "APT::Architecture": arch.name,
        "APT::Architectures::": arch.name,
        "Dir::State::Lists": str(base / "lists"),
        "Dir::State::status": str(base / "status"),
        "Dir::Cache": str(base),
        "Debug::NoLocking": "1",
    }
    return [arg for key, value in settings.items() for arg in ("-o", f"{key}={value}")]


def apt_update(arch: Arch) -> None:
    """Fetch the package lists of a foreign architecture into its private apt state."""
    if arch.foreign:
        say(f"apt-get update for {arch.name} (private lists under {cache_root()}) ...")
        argv = [need_tool("apt-get", "apt"), "-q", *apt_options(arch), *sandbox_options()]
        run_tool([*argv, "update"], f"apt-get update ({arch.name})")


def sandbox_options() -> list[str]:
    """Root's apt drops to _apt for downloads, which cannot write into our directories."""
    return ["-o", "APT::Sandbox::User=root"] if os.geteuid() == 0 else []


def resolve_kernel_package(arch: Arch) -> tuple[str, str]:
    """Return (package, kernel version) that linux-image-<arch> currently depends on."""
    meta = arch.meta_package
    out = run_tool(
        [need_tool("apt-cache", "apt"), *apt_options(arch), "depends", meta],
        f"apt-cache depends {meta}",
    )
    pattern = rf"^\s*Depends:\s*(linux-image-(\d[\w.+-]*-{re.escape(arch.name)}))\s*$"
    match = re.search(pattern, out, re.MULTILINE)
    if not match:
        raise HarnessError(
            f"cannot resolve the kernel package from '{meta}' (run 'apt-get update' first?)"
        )
    return match.group(1), match.group(2)


def apt_download(arch: Arch, package: str, dest: Path) -> Path:
    """Download one .deb into dest with apt-get download and return its path."""
    argv = [need_tool("apt-get", "apt"), "-q", *apt_options(arch), *sandbox_options()]
    run_tool([*argv, "download", package], f"apt-get download {package}", cwd=dest)
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise HarnessError(f"apt-get download {package} produced no .deb in {dest}")
    return debs[-1]


def unpack_kernel(arch: Arch, package: str, version: str, dest: Path) -> None:
    """Download, dpkg -x and depmod the kernel package into dest/root (and busybox)."""
    say(f"downloading {package} (apt-get download) ...")
    deb = apt_download(arch, package, dest)
    say(f"unpacking {deb.name} (dpkg -x, no install) ...")
    root = dest / "root"
    run_tool([need_tool("dpkg", "dpkg"), "-x", str(deb), str(root)], "dpkg -x")
    deb.unlink()
    staged = KernelCache(arch, version, dest)
    if arch.foreign:
        unpack_busybox(arch, staged)
    if not staged.vmlinuz.is_file() or not staged.moddir.is_dir():
        raise HarnessError(f"{package} has no {staged.vmlinuz.name} or modules/{version}")
    say(f"depmod -b {root} {version} ...")
    run_tool([need_tool("depmod", "kmod"), "-b", str(root), version], "depmod")


def unpack_busybox(arch: Arch, kc: KernelCache) -> None:
    """The foreign architecture's static busybox, out of its busybox-static package."""
    with tempfile.TemporaryDirectory(dir=kc.base) as tmp:
        deb = apt_download(arch, BUSYBOX_PACKAGE, Path(tmp))
        run_tool([need_tool("dpkg", "dpkg"), "-x", str(deb), tmp], "dpkg -x")
        shutil.copyfile(Path(tmp) / "bin" / "busybox", kc.busybox)


def ensure_kernel(kc: KernelCache, package: str) -> None:
    """Unpack the kernel into the cache unless it is already there (atomically)."""
    if kc.kernel_stamp.is_file():
        say(f"kernel {kc.version} already cached in {kc.base}")
        return
    staging = Path(tempfile.mkdtemp(prefix=f".{kc.version}.", dir=kc.base.parent))
    try:
        unpack_kernel(kc.arch, package, kc.version, staging)
        (staging / "kernel.ok").write_text(f"{package}\n")
        if kc.base.exists():
            shutil.rmtree(kc.base)
        staging.rename(kc.base)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def cached_kernels(root: Path, arch: Arch) -> list[KernelCache]:
    """Complete kernels of arch in the cache, newest version last."""
    found = [
        KernelCache(arch, stamp.parent.name, stamp.parent)
        for stamp in root.glob(f"*-{arch.name}/kernel.ok")
    ]
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
    """Extract the ELF kernel once (falls back to booting the bzImage); amd64 only."""
    if kc.vmlinux.is_file() or kc.arch.name != "amd64":
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


def initrd_digest(kc: KernelCache, modules: Sequence[Path]) -> str:
    """Digest of everything the initramfs is made of, to know when to rebuild it."""
    digest = hashlib.sha256(INIT_SCRIPT.encode())
    digest.update(kc.busybox.read_bytes())
    for module in modules:
        digest.update(module.name.encode())
    return digest.hexdigest()


def build_initrd(kc: KernelCache, modules: Sequence[Path]) -> bytes:
    """Return a gzip'd cpio with busybox, /init and the boot modules."""
    cpio = CpioWriter()
    for directory in ("bin", "dev", "proc", "sys", "newroot", "ctl", "modules"):
        cpio.directory(directory)
    cpio.chardev("dev/console", 5, 1)
    cpio.file("bin/busybox", kc.busybox.read_bytes(), 0o755)
    cpio.file("init", INIT_SCRIPT.encode(), 0o755)
    for index, module in enumerate(modules):
        cpio.file(f"modules/{index:02d}-{module_name(module.name)}.ko", module_bytes(module))
    say(f"initramfs for {kc.version}: busybox + {len(modules)} modules")
    return gzip.compress(cpio.finish(), compresslevel=6, mtime=0)


def ensure_initrd(kc: KernelCache) -> None:
    """(Re)build the initramfs if it is missing or its inputs changed."""
    busybox = kc.busybox
    if not busybox.is_file() or not is_static_elf(busybox):
        raise HarnessError(f"{busybox} is missing or not static: apt-get install busybox-static")
    modules = boot_module_paths(kc.moddir, kc.arch.initrd_modules)
    digest = initrd_digest(kc, modules)
    stamp = kc.initrd_stamp
    if kc.initrd.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return
    say(f"building initramfs {kc.initrd} ...")
    tmp = kc.initrd.with_suffix(".tmp")
    tmp.write_bytes(build_initrd(kc, modules))
    tmp.rename(kc.initrd)
    kc.initrd_stamp.write_text(digest + "\n")


def fetch(arch: Arch) -> KernelCache:
    """Make sure the newest kernel of arch that apt knows of and its initramfs are cached."""
    root = cache_root()
    apt_update(arch)
    say("resolving the kernel package with apt-cache ...")
    package, version = resolve_kernel_package(arch)
    say(f"kernel package: {package}")
    kc = KernelCache(arch, version, root / version)
    with locked(root / ".lock"):
        ensure_kernel(kc, package)
        ensure_vmlinux(kc)
        ensure_initrd(kc)
    say(f"ready: {kc.boot_image} + {kc.initrd.name} in {kc.base}")
    return kc


def ensure_cache(arch: Arch) -> KernelCache:
    """Return the newest cached kernel of arch, fetching one if there is none."""
    root = cache_root()
    kernels = cached_kernels(root, arch) if root.is_dir() else []
    if not kernels:
        say(f"no {arch.name} kernel cached in {root}: fetching one (once) ...")
        return fetch(arch)
    kc = kernels[-1]
    with locked(root / ".lock"):
        ensure_vmlinux(kc)
        ensure_initrd(kc)
    return kc
