"""A volume as a kernel block device: the Linux NBD driver, served by the agent itself.

The agent configures `/dev/nbdN` with ioctls (as `nbd-client` does after its
handshake) and hands the kernel one end of a socketpair; a thread serves the NBD
transmission phase on the other end through the volume store, so every block the
device reads or writes passes the volume's data services (end-to-end CRC,
compression, encryption) like any other I/O. No TCP, no handshake, no extra tool.

Wire format (the NBD protocol's transmission phase, big-endian):
request  = magic u32 0x25609513, flags u16, type u16, handle u64, offset u64, length u32
reply    = magic u32 0x67446698, error u32, handle u64 [, data for a read]

Commands served: READ, WRITE (FUA honoured), FLUSH, TRIM, DISC. The device's block
size is the volume's, so the kernel sends whole blocks only.

The volume's QoS limits hold for the device as for data-plane jobs: each READ, WRITE
and TRIM takes its tokens first and, past the limits, waits for them in this thread
(requests are served one at a time, so the device's queue waits behind it). The
kernel's request timeout is off (0): with it, a request that waits longer than the
timeout for its tokens would make the kernel drop the connection, and the device
with it. A stopped server is still noticed at once (the socket closes), as is a
failed store (an error answers the request).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Final

from dpu_agent.errors import AgentError, FailedPrecondition, ResourceExhausted, Unavailable

if TYPE_CHECKING:
    from dpu_agent.storage.backend import VolumeStore

log = logging.getLogger(__name__)

# linux/nbd.h
NBD_SET_SOCK: Final = 0xAB00
NBD_SET_BLKSIZE: Final = 0xAB01
NBD_DO_IT: Final = 0xAB03
NBD_CLEAR_SOCK: Final = 0xAB04
NBD_CLEAR_QUE: Final = 0xAB05
NBD_SET_SIZE_BLOCKS: Final = 0xAB07
NBD_DISCONNECT: Final = 0xAB08
NBD_SET_TIMEOUT: Final = 0xAB09
NBD_SET_FLAGS: Final = 0xAB0A
NBD_FLAG_HAS_FLAGS: Final = 1 << 0
NBD_FLAG_SEND_FLUSH: Final = 1 << 2
NBD_FLAG_SEND_FUA: Final = 1 << 3
NBD_FLAG_SEND_TRIM: Final = 1 << 5
NBD_CMD_READ: Final = 0
NBD_CMD_WRITE: Final = 1
NBD_CMD_DISC: Final = 2
NBD_CMD_FLUSH: Final = 3
NBD_CMD_TRIM: Final = 4
NBD_CMD_FLAG_FUA: Final = 1 << 0
REQUEST_MAGIC: Final = 0x25609513
REPLY_MAGIC: Final = 0x67446698
REQUEST: Final = struct.Struct(">IHHQQI")
REPLY: Final = struct.Struct(">IIQ")
MAX_REQUEST_BYTES: Final = 32 << 20
KERNEL_TIMEOUT_S: Final = 0  # no request timeout in the kernel: QoS waits (module docstring)
STOP_TIMEOUT_S: Final = 30  # the threads' join at stop
SYS_BLOCK: Final = Path("/sys/block")


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    view = bytearray(size)
    got = 0
    while got < size:
        n = sock.recv_into(memoryview(view)[got:], size - got)
        if n == 0:
            return None
        got += n
    return bytes(view)


def _errno_of(exc: Exception) -> int:
    if isinstance(exc, ResourceExhausted):
        return errno.ENOSPC
    if isinstance(exc, AgentError):
        return errno.EIO
    return errno.EIO


def free_device() -> str:
    """The first /dev/nbdN with no server behind it; FailedPrecondition if none."""
    if not SYS_BLOCK.joinpath("nbd0").exists():
        raise FailedPrecondition("no NBD devices: load the nbd kernel module (modprobe nbd)")
    index = 0
    while SYS_BLOCK.joinpath(f"nbd{index}").exists():
        busy = SYS_BLOCK.joinpath(f"nbd{index}", "pid").exists()
        size = SYS_BLOCK.joinpath(f"nbd{index}", "size").read_text().strip()
        if not busy and size == "0":
            return f"nbd{index}"
        index += 1
    raise ResourceExhausted("every NBD device is in use (modprobe nbd nbds_max=...)")


class NbdExport:
    """One volume served on one /dev/nbdN until `stop()`."""

    def __init__(self, store: VolumeStore, volume_id: str, device: str) -> None:
        self.store = store
        self.volume_id = volume_id
        self.device = device
        self.path = f"/dev/{device}"
        info = store.get(volume_id)
        self.block_size = info.block_size
        self.blocks = info.size_bytes // info.block_size
        self._fd = -1
        self._ours: socket.socket | None = None
        self._kernels: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()  # ends a QoS wait at once
        self.error: str = ""

    def start(self) -> None:
        """Configure the device and start serving it."""
        self._stopping.clear()
        ours, kernels = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            ours.close()
            kernels.close()
            raise Unavailable(f"cannot open {self.path}: {exc.strerror}") from None
        self._fd, self._ours, self._kernels = fd, ours, kernels
        flags = NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA | NBD_FLAG_SEND_TRIM
        try:
            fcntl.ioctl(fd, NBD_SET_BLKSIZE, self.block_size)
            fcntl.ioctl(fd, NBD_SET_SIZE_BLOCKS, self.blocks)
            fcntl.ioctl(fd, NBD_SET_TIMEOUT, KERNEL_TIMEOUT_S)
            fcntl.ioctl(fd, NBD_SET_FLAGS, flags)
            fcntl.ioctl(fd, NBD_SET_SOCK, kernels.fileno())
        except OSError as exc:
            self._close_fds()
            raise FailedPrecondition(f"cannot set up {self.path}: {exc.strerror}") from None
        for target, name in ((self._do_it, "nbd-kernel"), (self._serve, "nbd-serve")):
            thread = threading.Thread(target=target, name=f"{name}-{self.device}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._wait_ready()

    def _wait_ready(self) -> None:
        # NBD_DO_IT sets the device up in the kernel thread; the pid file appears then.
        pid = SYS_BLOCK / self.device / "pid"
        for _ in range(200):
            if pid.exists():
                return
            if not self._threads[0].is_alive():
                break
            threading.Event().wait(0.01)
        self.stop()
        raise FailedPrecondition(f"{self.path} did not come up: {self.error or 'no reason given'}")

    def _do_it(self) -> None:
        try:
            fcntl.ioctl(self._fd, NBD_DO_IT)
        except OSError as exc:
            if exc.errno not in {errno.EPIPE, errno.ECONNRESET}:
                self.error = exc.strerror or str(exc)
        finally:
            with contextlib.suppress(OSError):
                fcntl.ioctl(self._fd, NBD_CLEAR_QUE)
                fcntl.ioctl(self._fd, NBD_CLEAR_SOCK)

    def _serve(self) -> None:
        sock = self._ours
        assert sock is not None  # noqa: S101 - start() set it
        try:
            while self._one(sock):
                pass
        except OSError as exc:
            log.warning("nbd export ended", extra={"device": self.device, "error": str(exc)})

    def _one(self, sock: socket.socket) -> bool:
        head = _recv_exact(sock, REQUEST.size)
        if head is None:
            return False
        magic, flags, kind, handle, offset, length = REQUEST.unpack(head)
        if magic != REQUEST_MAGIC or length > MAX_REQUEST_BYTES:
            log.warning("bad nbd request", extra={"device": self.device, "magic": magic})
            return False
        if kind == NBD_CMD_DISC:
            return False
        payload = b""
        if kind == NBD_CMD_WRITE:
            data = _recv_exact(sock, length)
            if data is None:
                return False
            payload = data
        error, out = 0, b""
        try:
            out = self._execute(kind, flags, offset, length, payload)
        except Exception as exc:  # noqa: BLE001 - the device gets an errno, the log the reason
            error = _errno_of(exc)
            log.warning(
                "nbd request failed",
                extra={"device": self.device, "kind": kind, "offset": offset, "error": str(exc)},
            )
        sock.sendall(REPLY.pack(REPLY_MAGIC, error, handle) + out)
        return True

    def _execute(self, kind: int, flags: int, offset: int, length: int, payload: bytes) -> bytes:
        if kind == NBD_CMD_READ:
            self._throttle("read", length)
            return self.store.read(self.volume_id, offset, length)
        if kind == NBD_CMD_WRITE:
            fua = bool(flags & NBD_CMD_FLAG_FUA)
            self._throttle("write", len(payload))
            self.store.write(self.volume_id, offset, payload, fua=fua)
        elif kind == NBD_CMD_FLUSH:
            self.store.flush(self.volume_id)  # not limited, as VOLUME_FLUSH
        elif kind == NBD_CMD_TRIM:
            self._throttle("write", 0)  # one write operation of no bytes, as VOLUME_TRIM
            self.store.trim(self.volume_id, offset, length)
        else:
            raise OSError(errno.EINVAL, f"unknown NBD command {kind}")
        return b""

    def _throttle(self, op: str, nbytes: int) -> None:
        """Wait for the volume's QoS tokens of this request (`VolumeStore.throttle`)."""
        reservation = self.store.throttle(self.volume_id, op, nbytes)
        if reservation.wait > 0 and self._stopping.wait(reservation.wait):
            reservation.give_back()  # the export stops: this request is never done
            raise Unavailable(f"{self.path} is being disconnected")

    def stop(self) -> None:
        """Disconnect the device and end the threads (the volume keeps every acknowledged write)."""
        self._stopping.set()
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.ioctl(self._fd, NBD_DISCONNECT)
        for thread in reversed(self._threads):  # the server first, then the kernel's thread
            thread.join(timeout=STOP_TIMEOUT_S)
            if self._ours is not None:
                with contextlib.suppress(OSError):
                    self._ours.shutdown(socket.SHUT_RDWR)
        self._threads.clear()
        self._close_fds()
        with contextlib.suppress(AgentError):
            self.store.flush(self.volume_id)

    def _close_fds(self) -> None:
        for sock in (self._ours, self._kernels):
            if sock is not None:
                sock.close()
        self._ours = self._kernels = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
