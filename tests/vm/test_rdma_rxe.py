"""RDMA WRITE and READ of 1 MiB between two RC QPs on two soft-RoCE nodes.

QP A lives on the host's device (rxe1 in the test VM) and QP B on the agent's (rxe0),
their traffic routed across the veth pair between them (tests/vm/conftest.py checks
that it crossed).

The resources are layered like rdma-core's tests/base.py: a device context with its
protection domain, then RC endpoints (CQ + QP) on it; each is a context manager and is
closed in reverse order of creation.
"""

from __future__ import annotations

import os
import random
import time
from typing import TYPE_CHECKING, Any, Protocol, Self

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import TracebackType

pytestmark = pytest.mark.rdma

SIZE = 1 << 20
CQ_DEPTH = 16
POLL_TIMEOUT_S = 30.0
# QP attributes for the INIT -> RTR -> RTS transitions (the values ibv_rc_pingpong uses).
MIN_RNR_TIMER = 12
ACK_TIMEOUT = 14
RETRY_CNT = 7
RNR_RETRY = 7
RD_ATOMIC = 1


class RdmaPort(Protocol):
    """What the rdma_port fixture of conftest.py gives."""

    @property
    def device(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def gid_index(self) -> int: ...


class VerbsContext:
    """An opened device with one protection domain (rdma-core's BaseResources)."""

    def __init__(self, port: RdmaPort) -> None:
        from pyverbs.device import Context  # noqa: PLC0415
        from pyverbs.pd import PD  # noqa: PLC0415

        self.port = port
        self.ctx: Any = Context(name=port.device)
        try:
            self.pd: Any = PD(self.ctx)
            self.port_attr: Any = self.ctx.query_port(port.port)
        except BaseException:
            self.ctx.close()
            raise

    def mr(self, access: int) -> Any:
        """Register a SIZE-byte buffer with exactly the given access flags."""
        from pyverbs.mr import MR  # noqa: PLC0415

        return MR(self.pd, SIZE, access)

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RCEndpoint:
    """One RC QP with its own CQ on a VerbsContext (rdma-core's RCResources)."""

    def __init__(self, dev: VerbsContext, qp_access: int) -> None:
        import pyverbs.enums as e  # noqa: PLC0415
        from pyverbs.cq import CQ  # noqa: PLC0415
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: PLC0415

        self.dev = dev
        self.psn = random.getrandbits(24)  # a PSN, not a secret
        self.cq: Any = CQ(dev.ctx, CQ_DEPTH, None, None, 0)
        try:
            cap = QPCap(max_send_wr=CQ_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
            attr = QPAttr(port_num=dev.port.port)
            attr.qp_access_flags = qp_access
            self.qp: Any = QP(dev.pd, init, attr)  # created in INIT
        except BaseException:
            self.cq.close()
            raise

    def connect(self, remote: RCEndpoint) -> None:
        """Move the QP to RTS, addressed to the remote QP over the RoCEv2 GID."""
        from pyverbs.addr import AHAttr, GlobalRoute  # noqa: PLC0415
        from pyverbs.qp import QPAttr  # noqa: PLC0415

        port, there = self.dev.port, remote.dev.port
        gid = remote.dev.ctx.query_gid(there.port, there.gid_index)
        route = GlobalRoute(dgid=gid, sgid_index=port.gid_index)
        attr = QPAttr(port_num=port.port)
        attr.ah_attr = AHAttr(port_num=port.port, is_global=1, gr=route, dlid=0)
        attr.path_mtu = self.dev.port_attr.active_mtu
        attr.dest_qp_num = remote.qp.qp_num
        attr.rq_psn = remote.psn
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = RD_ATOMIC
        attr.max_rd_atomic = RD_ATOMIC
        attr.min_rnr_timer = MIN_RNR_TIMER
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_CNT
        attr.rnr_retry = RNR_RETRY
        self.qp.to_rts(attr)

    def post_rdma(self, opcode: int, local_mr: Any, remote_mr: Any, wr_id: int) -> None:
        """Post one signalled RDMA WRITE/READ of SIZE bytes between the two MRs."""
        import pyverbs.enums as e  # noqa: PLC0415
        from pyverbs.wr import SGE, SendWR  # noqa: PLC0415

        sge = SGE(local_mr.buf, SIZE, local_mr.lkey)
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(remote_mr.rkey, remote_mr.buf)
        self.qp.post_send(wr)

    def poll_one(self, timeout: float = POLL_TIMEOUT_S) -> Any:
        """Wait for one completion, failing (never hanging) after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            count, wcs = self.cq.poll(1)
            if count:
                return wcs[0]
            if time.monotonic() > deadline:
                pytest.fail(f"no completion on the CQ within {timeout:.0f} s")
            time.sleep(0.001)

    def close(self) -> None:
        self.qp.close()
        self.cq.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def check_completion(wc: Any, wr_id: int, opcode: int) -> None:
    import pyverbs.enums as e  # noqa: PLC0415

    status = e.ibv_wc_status(wc.status)
    assert status == e.IBV_WC_SUCCESS, f"completion failed: {status.name}"
    assert wc.wr_id == wr_id
    assert wc.opcode == opcode


def assert_same_bytes(got: bytes, want: bytes) -> None:
    """Compare every byte; on a mismatch, report where (not a 1 MiB diff)."""
    assert len(got) == len(want), f"length {len(got)} != {len(want)}"
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        bad = sum(a != b for a, b in zip(got, want, strict=True))
        pytest.fail(f"{bad} of {len(want)} bytes differ, the first at offset {first}")


@pytest.fixture(scope="module")
def verbs(host_port: RdmaPort) -> Iterator[VerbsContext]:
    """The host's node: QP A and its local buffers."""
    with VerbsContext(host_port) as dev:
        yield dev


@pytest.fixture(scope="module")
def verbs_b(rdma_port: RdmaPort) -> Iterator[VerbsContext]:
    """The agent's node: QP B and the buffers A reaches remotely."""
    with VerbsContext(rdma_port) as dev:
        yield dev


@pytest.fixture(scope="module")
def rc_pair(verbs: VerbsContext, verbs_b: VerbsContext) -> Iterator[tuple[RCEndpoint, RCEndpoint]]:
    """QP A (requester only, no remote access) connected to QP B (remote write + read)."""
    import pyverbs.enums as e  # noqa: PLC0415

    with (
        RCEndpoint(verbs, qp_access=0) as qp_a,
        RCEndpoint(verbs_b, e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ) as qp_b,
    ):
        qp_a.connect(qp_b)
        qp_b.connect(qp_a)
        yield qp_a, qp_b


def test_rdma_write_1mib(
    verbs: VerbsContext,
    verbs_b: VerbsContext,
    rc_pair: tuple[RCEndpoint, RCEndpoint],
) -> None:
    import pyverbs.enums as e  # noqa: PLC0415

    qp_a, _ = rc_pair
    data = os.urandom(SIZE)
    # The source is only read locally (no flags); the target takes remote writes.
    with (
        verbs.mr(0) as src,
        verbs_b.mr(e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE) as dst,
    ):
        src.write(data, SIZE)
        dst.write(os.urandom(SIZE), SIZE)
        qp_a.post_rdma(e.IBV_WR_RDMA_WRITE, src, dst, wr_id=1)
        check_completion(qp_a.poll_one(), 1, e.IBV_WC_RDMA_WRITE)
        assert_same_bytes(dst.read(SIZE, 0), data)


def test_rdma_read_1mib(
    verbs: VerbsContext,
    verbs_b: VerbsContext,
    rc_pair: tuple[RCEndpoint, RCEndpoint],
) -> None:
    import pyverbs.enums as e  # noqa: PLC0415

    qp_a, _ = rc_pair
    data = os.urandom(SIZE)
    # The source is only read remotely; the local target is written by the HCA.
    with (
        verbs_b.mr(e.IBV_ACCESS_REMOTE_READ) as remote,
        verbs.mr(e.IBV_ACCESS_LOCAL_WRITE) as local,
    ):
        remote.write(data, SIZE)
        local.write(os.urandom(SIZE), SIZE)
        qp_a.post_rdma(e.IBV_WR_RDMA_READ, local, remote, wr_id=2)
        check_completion(qp_a.poll_one(), 2, e.IBV_WC_RDMA_READ)
        assert_same_bytes(local.read(SIZE, 0), data)
