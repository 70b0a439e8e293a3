"""The native core's READ path, driven through a stand-in verbs provider (fakeverbs.c).

On rxe (tests/vm/test_native_verbs.py) the order in which completions arrive is the
device's; here a test queues them itself, so the orders a hostile or unlucky peer can
produce are checked one by one: a job whose answer went out and whose SEND completed
before the pipeline took its record, and a chain the device took only half of.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from dpu_wire.capsule import Span, Submit
from dpu_wire.jobkinds import JobKind
from dpu_wire.transport.verbs import CORE_DATA, CORE_MAX, CORE_WR
from tests.unit.test_native_build import missing_inputs

SOURCE = Path(__file__).with_name("fakeverbs.c")
RECV_SLOT, RECV_DEPTH = 256, 8
FAST_SLOT, FAST_DEPTH, INLINE_MAX = 320, 4, 176
READ_SLOT, READ_SLOTS = CORE_DATA + CORE_MAX, 2
SRC = Span(0x10000, 4096, 7)
DST = Span(0x20000, 4096, 7)
OP_READ, OP_WRITE, OP_SEND = 0, 1, 2  # the low bits of a READ-path wr_id
IBV_WR_RDMA_WRITE, IBV_WR_SEND, IBV_WR_RDMA_READ = 0, 2, 4
ENOMEM = 12


class _Posted(ctypes.Structure):
    _fields_ = [
        ("wr_id", ctypes.c_uint64),
        ("opcode", ctypes.c_int),
        ("flags", ctypes.c_int),
        ("addr", ctypes.c_uint64),
        ("length", ctypes.c_uint32),
        ("remote_addr", ctypes.c_uint64),
        ("rkey", ctypes.c_uint32),
    ]


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    missing = missing_inputs()
    if missing:
        pytest.skip(f"no native core to drive here, no {', '.join(missing)}")
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    assert shutil.which(cc[0]), cc
    lib = tmp_path_factory.mktemp("fakeverbs") / "libfakeverbs.so"
    subprocess.run([*cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(SOURCE)], check=True)
    made = ctypes.CDLL(str(lib))
    for name in ("fake_reset", "fake_send_cq", "fake_recv_cq"):
        getattr(made, name).restype = ctypes.c_uint64
    made.push_send.argtypes = [ctypes.c_uint64, ctypes.c_int]
    made.push_recv.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_uint32]
    return made


class Core:
    """A `_vcore.Qp` on the stand-in provider, its rings in ctypes buffers."""

    def __init__(self, fake: ctypes.CDLL) -> None:
        from dpu_wire.transport import _vcore  # noqa: PLC0415 - built where `fake` is

        self.fake = fake
        qp = fake.fake_reset()
        self.recv = ctypes.create_string_buffer(RECV_SLOT * RECV_DEPTH)
        self.fast = ctypes.create_string_buffer(FAST_SLOT * FAST_DEPTH)
        self.ring = ctypes.create_string_buffer(READ_SLOT * READ_SLOTS)
        self.qp: Any = _vcore.Qp(
            qp,
            1,
            fake.fake_send_cq(),
            fake.fake_recv_cq(),
            ctypes.addressof(self.recv),
            RECV_SLOT,
            RECV_DEPTH,
            1,
        )
        self.qp.fast_setup(ctypes.addressof(self.fast), 2, FAST_SLOT, FAST_DEPTH, INLINE_MAX)
        self.qp.read_setup(ctypes.addressof(self.ring), 3, READ_SLOT, READ_SLOTS, CORE_MAX, 60_000)
        access = 3  # REMOTE_READ | REMOTE_WRITE
        self.qp.set_regions([(0x10000, 0x100000, SRC.rkey, access)])

    def submit(self, slot: int, job_id: int) -> list[tuple[int, ...]]:
        """A READ-path COPY arrives in RECV `slot` and is served; the jobs it started."""
        capsule = Submit(job_id, JobKind.COPY, SRC, DST).encode()
        ctypes.memmove(ctypes.addressof(self.recv) + slot * RECV_SLOT, capsule, len(capsule))
        self.fake.push_recv(slot, 0, len(capsule))
        _, _, started, pending, err, _ = self.qp.serve(16, 1, 64, 4)
        assert (pending, err) == (None, 0)
        return list(started)

    def complete(self, index: int, op: int, status: int = 0) -> object:
        """The send completion of READ-ring slot `index`'s `op`, taken by poll_send."""
        self.fake.push_send(CORE_WR | index << 2 | op, status)
        return self.qp.poll_send()

    def posted(self) -> list[_Posted]:
        n = ctypes.c_int.in_dll(self.fake, "n_posted").value
        return list((_Posted * 1024).in_dll(self.fake, "posted")[:n])


def test_an_answered_job_whose_send_completed_is_not_cancelled(fake: ctypes.CDLL) -> None:
    # The job's WRITE and COMPLETION went out and its SEND completed (its slot free)
    # before the pipeline took the done list: the pipeline, ending it now (its link
    # failed, a CANCEL), must hear that it was answered, or it ends the job a second time.
    core = Core(fake)
    assert [job[0] for job in core.submit(0, 42)] == [42]
    assert core.complete(0, OP_READ) is None
    assert [p.opcode for p in core.posted()] == [IBV_WR_RDMA_READ, IBV_WR_RDMA_WRITE, IBV_WR_SEND]
    assert core.complete(0, OP_SEND) is None
    assert core.qp.core_busy == 0
    assert core.qp.core_cancel(42) is False
    assert [job[0] for job in core.qp.take_done()] == [42]


def test_a_job_cancelled_while_its_read_is_out_writes_nothing(fake: ctypes.CDLL) -> None:
    core = Core(fake)
    core.submit(0, 7)
    assert core.qp.core_cancel(7) is True
    assert core.qp.core_busy == 1  # the READ still lands in the slot
    assert core.complete(0, OP_READ) is None
    assert [p.opcode for p in core.posted()] == [IBV_WR_RDMA_READ]
    assert core.qp.core_busy == 0
    assert core.qp.take_done() is None


def test_a_half_posted_answer_keeps_its_slot(fake: ctypes.CDLL) -> None:
    # The device took the job's WRITE and refused its SEND: the WRITE may still read the
    # slot, so no later job may READ into it (the link fails on the refusal).
    core = Core(fake)
    core.submit(0, 43)
    ctypes.c_int.in_dll(fake, "refuse_at").value = 1
    assert core.complete(0, OP_READ) == (CORE_WR | OP_READ, -ENOMEM)
    write = core.posted()[-1]
    assert write.opcode == IBV_WR_RDMA_WRITE
    assert core.qp.core_busy == 1
    assert core.qp.take_done() is None  # not answered: the pipeline ends it
    core.submit(1, 44)
    read = core.posted()[-1]
    assert read.opcode == IBV_WR_RDMA_READ
    assert read.addr != write.addr, "a READ went into the buffer a WRITE is still sending"
