"""A block function's device I/O keeps to its volume's QoS limits.

The NBD server of a block function (virtualization/nbd.py) is driven here over a
socketpair with the NBD protocol, the side the kernel speaks (the kernel's own side,
a real /dev/nbdN under a real NVMe-oF target, is in tests/vm/virtualization).
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dpu_agent.storage import MemoryVolumeStore
from dpu_agent.storage.types import DataServices, QosLimits
from dpu_agent.virtualization import nbd

BLOCK = 4096
WRITE_IOPS = 10  # a 1 s burst of 10 writes, then one every 0.1 s


def _request(kind: int, handle: int, offset: int = 0, length: int = 0, flags: int = 0) -> bytes:
    return nbd.REQUEST.pack(nbd.REQUEST_MAGIC, flags, kind, handle, offset, length)


def _reply(sock: socket.socket, data_bytes: int = 0) -> tuple[int, int, bytes]:
    head = nbd._recv_exact(sock, nbd.REPLY.size)
    assert head is not None, "the server closed the connection"
    magic, error, handle = nbd.REPLY.unpack(head)
    assert magic == nbd.REPLY_MAGIC
    data = b""
    if data_bytes and not error:
        got = nbd._recv_exact(sock, data_bytes)
        assert got is not None
        data = got
    return error, handle, data


@pytest.fixture
def served() -> Iterator[tuple[MemoryVolumeStore, nbd.NbdExport, socket.socket]]:
    """A volume with a write IOPS limit, its NBD server on our end of a socketpair."""
    store = MemoryVolumeStore(capacity_bytes=64 << 20)
    store.create("disk", 1 << 20, BLOCK, DataServices(), qos=QosLimits(write_iops=WRITE_IOPS))
    export = nbd.NbdExport(store, "disk", "nbd-test")
    ours, kernels = socket.socketpair()
    export._ours = ours  # what start() sets up, without a /dev/nbdN
    thread = threading.Thread(target=export._serve, daemon=True)
    thread.start()
    try:
        yield store, export, kernels
    finally:
        export._stopping.set()
        kernels.close()
        thread.join(5)
        ours.close()
        store.close()


def test_device_writes_wait_for_the_volumes_qos_tokens(served):
    store, _, kernel = served
    writes = 3 * WRITE_IOPS  # the burst, then 20 that must wait for tokens
    for i in range(writes):
        block = bytes([i]) * BLOCK
        kernel.sendall(_request(nbd.NBD_CMD_WRITE, i, i * BLOCK, BLOCK) + block)
        assert _reply(kernel) == (0, i, b"")
    stats = store.stats("disk")
    assert stats.throttled_ops >= writes - WRITE_IOPS - 1, stats  # the burst passes freely
    assert stats.throttle_delay_us > 0
    kernel.sendall(_request(nbd.NBD_CMD_READ, 99, 5 * BLOCK, BLOCK))
    assert _reply(kernel, BLOCK) == (0, 99, bytes([5]) * BLOCK)  # reads are not limited here


def test_a_trim_counts_as_a_write_and_a_flush_is_not_limited(served):
    store, _, kernel = served
    for i in range(WRITE_IOPS + 3):
        kernel.sendall(_request(nbd.NBD_CMD_TRIM, i, 0, BLOCK))
        assert _reply(kernel)[0] == 0
    assert store.stats("disk").throttled_ops >= 2
    before = store.stats("disk").throttled_ops
    for i in range(5):
        kernel.sendall(_request(nbd.NBD_CMD_FLUSH, 100 + i))
        assert _reply(kernel)[0] == 0
    assert store.stats("disk").throttled_ops == before


def test_a_stop_ends_a_qos_wait_at_once_and_gives_its_tokens_back(served):
    store, export, kernel = served
    store.set_qos("disk", QosLimits(write_iops=1))  # buckets start full: 1 write free
    block = bytes(BLOCK)
    kernel.sendall(_request(nbd.NBD_CMD_WRITE, 1, 0, BLOCK) + block)
    assert _reply(kernel)[0] == 0
    kernel.sendall(_request(nbd.NBD_CMD_WRITE, 2, 0, BLOCK) + block)  # waits about 1 s
    time.sleep(0.1)
    export._stopping.set()  # as stop() does first
    error, handle, _ = _reply(kernel)
    assert (error, handle) == (errno.EIO, 2)
    export._stopping.clear()
    # The stopped write's token came back: the next one waits what is left of its second,
    # not a second more (given back: `min(cost, time left * rate)`).
    reservation = store.throttle("disk", "write", BLOCK)
    assert reservation.wait < 1.5, reservation.wait  # without the give-back: 1.9 s
    reservation.give_back()
