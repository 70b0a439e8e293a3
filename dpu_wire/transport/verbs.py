"""The verbs transport: a session's data plane on one RDMA RC queue pair (pyverbs).

Each link (one per session, on either side) owns a device context, one protection
domain, two completion queues and one RC queue pair:

- Capsules travel as SEND into a ring of `recv_depth` pre-posted RECV buffers of
  `MAX_CAPSULE` bytes (one registered region). A consumed RECV is reposted as soon as
  its capsule has been handed over, so the peer's credits never run out while the
  receiving program is busy (NVMe-oF/RDMA does the same); `rnr_retry=7` makes a
  sender wait, not fail, should it ever find the ring empty.
- Sends, RDMA READs and RDMA WRITEs are posted from work requests built once and
  reused (a pyverbs SGE + SendWR costs tens of microseconds to build; the provider
  copies a posted WR, so one object per opcode serves every post). A capsule is copied
  into one of the send ring's slots first.
- Send-queue completions are taken from an extended CQ (`CQEX`: no Python object per
  completion; one start_poll/end_poll pair per completion, because rxe's next_poll
  ends the batch by itself and a following end_poll corrupts the queue). A WRITE may
  be posted unsignalled when a signalled operation follows it (a job's last WRITE and
  its COMPLETION's SEND): RC completes the send queue in order, so the signalled
  completion covers it. Such a WRITE is held back until that SEND is posted, and both
  go in one `ibv_post_send` (a chained pair of work requests: one doorbell); if no SEND
  follows within the reactor's pass, `flush` posts the WRITE alone.
- RECV completions come from a plain CQ bound to a completion channel: the only
  completions a side ever needs to be woken for are capsules (pyverbs 44 cannot arm an
  extended CQ). A side that has nothing in flight arms the channel and sleeps on its
  file descriptor; while work is in flight it polls (see `AgentLink`, `HostLink`).

Connection, out of band (OpenSession carries the addresses): the host builds its link
(QP in INIT, RECVs posted) and sends `address`; the agent builds its own, connects it
(RTR, RTS) and returns its `address`; the host `await connect(agent_address)`. The
agent never sends first: a SEND to a QP that is not yet RTR is dropped and retried,
and fails with IBV_WC_RETRY_EXC_ERR once the retry budget (below) is spent.

Differences from the tcp transport (same semantics otherwise):

- A refused READ or WRITE (bad rkey, out of bounds, access not granted) moves both
  queue pairs to the error state (the host's RECVs are flushed): every pending and later
  operation on the session, on either side, fails. So the agent checks every span
  against the regions the host advertised before it posts a READ or WRITE.
- The peer going away is not signalled: RC notices only when an operation finds no
  responder. The requester retries `retry_cnt=6` times after an ACK timeout of
  4.096 us * 2**16 = 268 ms, so the next SEND, READ or WRITE fails with
  IBV_WC_RETRY_EXC_ERR after 7 * 268 ms = 1.9 s without an answer. (The timeout was
  67 ms, ibv_rc_pingpong's and perftest's. NCCL's default is 1.07 s, UCX's 1 s.) A
  retransmission after a sequence NAK counts against the same budget, so a link that
  reorders one QP's packets can fail a live session: the test VM's veth pair did, until
  it steered each flow to one CPU (deploy/testvm/vmguest.py).
- A capsule longer than `MAX_CAPSULE`, a span outside the local region or longer than
  the port's `max_msg_sz` raise ValueError before anything is posted.

pyverbs comes from the distribution (Debian's python3-pyverbs, rdma-core 44); it is
imported optionally, so this module imports (and type-checks) where it is absent.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import ctypes
import dataclasses
import errno
import ipaddress
import logging
import os
import pathlib
import secrets
import time
import weakref
from typing import TYPE_CHECKING, Any, Final

from dpu_wire.capsule import MAX_CAPSULE, MAX_INLINE, SUBMIT_SIZE
from dpu_wire.transport import _memory, native
from dpu_wire.transport._cqnotify import CqNotifier, NotifyUnavailable
from dpu_wire.transport.base import (
    Access,
    AgentLink,
    FastRegion,
    FastSink,
    HostLink,
    OutCapsule,
    PeerAddress,
    Region,
    RemoteAccessError,
    TransportError,
    VerbsAddress,
    readable_view,
)

if TYPE_CHECKING:
    import mmap
    from collections.abc import Callable, Iterator, Sequence

    from dpu_wire.capsule import CompletionFields, Span
    from dpu_wire.transport.base import LinkSink

# Importing pyverbs calls logging.basicConfig(level=INFO) (pyverbs/base.pyx): keep the
# root logger as the program set it up.
_root_logger = logging.getLogger()
_root_setup = (list(_root_logger.handlers), _root_logger.level)
try:  # Debian's python3-pyverbs; absent on machines without rdma-core
    import pyverbs.enums as ev
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ, CQEX, CompChannel, CqInitAttrEx, PollCqAttr
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR
except ImportError as exc:  # pragma: no cover - depends on the machine
    _PYVERBS_MISSING: ImportError | None = exc
else:
    _PYVERBS_MISSING = None
finally:
    _root_logger.handlers[:] = _root_setup[0]
    _root_logger.setLevel(_root_setup[1])

log = logging.getLogger(__name__)

# RC attributes for INIT -> RTR -> RTS (ibv_rc_pingpong's, with more RDMA READs in flight
# and a longer ACK timeout).
ACK_TIMEOUT: Final = 16  # 4.096 us * 2**16 = 268 ms before a retry (see the module's text)
# Retries after an ACK timeout: 7 tries x 268 ms = 1.9 s to notice a vanished peer. Not 7:
# rxe (drivers/infiniband/sw/rxe/rxe_comp.c) never counts a retry_cnt of 7 down, i.e.
# retries forever, as the spec has it only for rnr_retry.
RETRY_CNT: Final = 6
RNR_RETRY: Final = 7  # 7 = retry forever when the peer has no RECV posted
MIN_RNR_TIMER: Final = 12  # 0.64 ms before a RECV-not-ready retry
RD_ATOMIC: Final = 16  # RDMA READs in flight (clamped to what the device supports)
HOP_LIMIT: Final = 64  # RoCEv2 may cross routers
RECV_BATCH: Final = 16  # RECV completions taken per poll of the receive CQ
CORE_SLOTS: Final = 16  # the native core's READ ring: jobs it READs at once, at most
CORE_MAX: Final = 64 << 10  # the largest COPY it READs itself (the pipeline's small buffer)
CORE_DATA: Final = 128  # a READ ring slot: the job's COMPLETION, then its data from here
CORE_WR: Final = 1 << 62  # the bit of the wr_ids the core's READ path posts with
DEFAULT_SPIN_S: Final = 0.002  # how long a host link polls after the last activity
WAIT_TURNS: Final = 32  # `HostLink.wait` spins in a row before the event loop must turn
GAP_WEIGHT: Final = 0.25  # a new wait's weight in the host's average wait for an answer
GAP_CAP: Final = 4  # a wait counts for at most this many spins in that average

_EVENT_FD_LINK: Final = "anon_inode:[infinibandevent]"
_MTU_BYTES: Final = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu -> bytes
_ENOENT: Final = errno.ENOENT


def _require_pyverbs() -> None:
    if _PYVERBS_MISSING is not None:
        raise TransportError(
            f"the verbs transport needs pyverbs (Debian's python3-pyverbs): {_PYVERBS_MISSING}"
        )


# ---------------------------------------------------------------- ports and addresses


def find_port(device: str | None = None, port: int | None = None) -> tuple[str, int, int]:
    """The first ACTIVE port with an IPv4-mapped RoCEv2 GID.

    Args:
        device: the device to look on (e.g. "rxe0"); None: every device, in order.
        port: the port to use; None: the first ACTIVE one.

    Returns:
        (device, port, gid_index).

    Raises:
        TransportError: there is no RDMA device, or no such port.
    """
    _require_pyverbs()
    try:
        names = [dev.name.decode() for dev in get_device_list()]
    except PyverbsError as exc:
        raise TransportError(f"no RDMA device: {exc}") from exc
    if device is not None:
        if device not in names:
            raise TransportError(f"no RDMA device named {device!r} (found: {names})")
        names = [device]
    for name in names:
        try:
            found = _active_roce_port(name, port)
        except PyverbsError as exc:
            log.debug("skipping RDMA device %s: %s", name, exc)
            continue
        if found is not None:
            return name, *found
    where = f"port {port} of " if port is not None else "a port of "
    raise TransportError(
        f"no ACTIVE RDMA port with an IPv4-mapped RoCEv2 GID: looked at {where}{names or 'nothing'}"
    )


def _active_roce_port(name: str, only: int | None) -> tuple[int, int] | None:
    """(port, gid_index) of the first usable port of device `name`, or None."""
    with Context(name=name) as ctx:
        ports = [only] if only is not None else range(1, ctx.query_device().phys_port_cnt + 1)
        for port in ports:
            attr = ctx.query_port(port)
            if attr.state != ev.IBV_PORT_ACTIVE:
                continue
            index = _roce_v2_ipv4_gid(ctx, port, int(attr.gid_tbl_len))
            if index is not None:
                return port, index
    return None


def _roce_v2_ipv4_gid(ctx: Any, port: int, table_len: int) -> int | None:  # noqa: ANN401 - pyverbs Context
    """Index of the first RoCEv2 GID that is IPv4-mapped (::ffff:a.b.c.d)."""
    for index in range(table_len):
        try:
            entry = ctx.query_gid_ex(port, index)
        except PyverbsRDMAError:  # ENODATA: an empty slot
            continue
        if int(entry.gid_type) != int(ev.IBV_GID_TYPE_ROCE_V2):
            continue
        if _gid_bytes(ctx.query_gid(port, index)).startswith(bytes(10) + b"\xff\xff"):
            return index
    return None


def _gid_bytes(gid: object) -> bytes:
    """The 16 bytes of a pyverbs GID (its str() is eight 4-digit hex groups)."""
    return ipaddress.IPv6Address(str(gid)).packed


def _gid_ifindex(ctx: Any, port: int, index: int) -> int:  # noqa: ANN401 - pyverbs Context
    """The ifindex of the netdev a RoCE GID belongs to; 0 where the device does not say."""
    try:
        return int(ctx.query_gid_ex(port, index).ndev_ifindex)
    except (PyverbsError, AttributeError):
        return 0


def _gid_object(raw: bytes) -> Any:  # noqa: ANN401 - a pyverbs GID
    """A pyverbs GID from 16 bytes."""
    if len(raw) != 16:
        raise TransportError(f"a GID is 16 bytes, got {len(raw)}")
    return GID(ipaddress.IPv6Address(raw).exploded)


def _mtu_enum(mtu_bytes: int) -> int:
    """The largest ibv_mtu not above `mtu_bytes`."""
    fitting = [enum for enum, size in _MTU_BYTES.items() if size <= mtu_bytes]
    if not fitting:
        raise TransportError(f"path MTU {mtu_bytes} is below the RDMA minimum of 256 bytes")
    return max(fitting)


def _wc_status_name(status: int) -> str:
    try:
        return str(ev.ibv_wc_status(status).name)
    except ValueError:
        return f"ibv_wc_status {status}"


# ---------------------------------------------------------------- memory


def _mr_flags(access: Access) -> int:
    """The least ibv_access_flags that let the peer do what `access` allows."""
    flags = 0
    if access & Access.REMOTE_READ:
        flags |= ev.IBV_ACCESS_REMOTE_READ
    if access & Access.REMOTE_WRITE:
        flags |= ev.IBV_ACCESS_LOCAL_WRITE | ev.IBV_ACCESS_REMOTE_WRITE
    return flags


class VerbsRegion(Region):
    """Page-aligned anonymous memory registered as one MR; `view` is the memory itself."""

    def __init__(self, pd: object, length: int, access: Access, flags: int) -> None:
        self._mm: mmap.mmap | None
        self._mm, self.addr = _memory.allocate(length)
        size = max(length, 1)
        if not flags & ev.IBV_ACCESS_LOCAL_WRITE:
            # A read-only pin of untouched anonymous memory may pin the shared zero page,
            # which the program's later writes never reach (older kernels; 6.1 unshares
            # it). Faulting every page in writable first makes it safe everywhere.
            ctypes.memset(self.addr, 0, size)
        try:
            self._mr: Any = MR(pd, size, flags, address=self.addr)
        except PyverbsError as exc:
            self._mm.close()
            raise TransportError(f"cannot register {length} bytes: {exc}") from exc
        self.view = memoryview(self._mm)[:length]
        self.length = length
        self.access = access
        self.rkey = int(self._mr.rkey)
        self.lkey = int(self._mr.lkey)

    def close(self) -> None:
        """Deregister, then unmap (the view must not be used afterwards). Idempotent."""
        self._mr.close()
        if self._mm is None:
            return
        self.view.release()
        try:
            self._mm.close()
        except BufferError:  # the program still holds a slice: unmapped when it is freed
            log.debug("region at %#x is still referenced; unmapped later", self.addr)
        self._mm = None


# ---------------------------------------------------------------- the queue pair


@dataclasses.dataclass(frozen=True)
class _Config:
    device: str | None
    port: int | None
    gid_index: int | None
    queue_depth: int
    send_depth: int
    recv_depth: int
    qp_access: int
    recv_slot: int = MAX_CAPSULE  # bytes of each RECV buffer: the longest SEND taken

    def check(self) -> None:
        for name in ("queue_depth", "send_depth", "recv_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


# An agent link's RECV ring at most: inline sources make every RECV buffer 80 +
# inline_max bytes, and a client chooses the queue depth (so the ring's length) of each of
# the sessions it may open. Past this the link offers less (`inline_within`).
RECV_RING_BYTES: Final = 2 << 20


def inline_within(inline_max: int, recv_depth: int) -> int:
    """The inline_max a link with `recv_depth` RECV buffers offers for a wanted `inline_max`.

    As asked while its RECV ring stays within RECV_RING_BYTES; else what fits, in steps
    of 512 bytes, and never less than what a 256-byte buffer holds anyway (176).
    """
    fits = RECV_RING_BYTES // recv_depth - SUBMIT_SIZE
    if fits >= inline_max:
        return inline_max
    return min(inline_max, max(fits - fits % 512, MAX_CAPSULE - SUBMIT_SIZE))


def _slot_bytes(inline_max: int) -> int:
    """A capsule slot's bytes when SUBMITs carry up to `inline_max` source bytes."""
    if not 0 <= inline_max <= MAX_INLINE:
        raise ValueError(f"inline_max must be 0..{MAX_INLINE}, not {inline_max}")
    return max(MAX_CAPSULE, SUBMIT_SIZE + inline_max)


_LIVE: Final[weakref.WeakSet[_QueuePair]] = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Close the queue pairs a program left open before the interpreter tears down.

    Otherwise pyverbs frees their objects in whatever order module teardown reaches
    them: a channel or context before the CQ bound to it, which crashes the process.
    """
    for qp in list(_LIVE):
        with contextlib.suppress(Exception):
            qp.close()


class _QueuePair:
    """What both sides share: resources, rings, posting and taking completions.

    Not thread-safe and not async: the owner (the agent's reactor, or the host link on
    its event loop) calls everything from one thread.
    """

    def __init__(self, config: _Config) -> None:
        config.check()
        _require_pyverbs()
        device, port, gid_index = config.device, config.port, config.gid_index
        if device is None or port is None or gid_index is None:
            found = find_port(device, port)
            device, port = found[0], found[1]
            gid_index = found[2] if gid_index is None else gid_index
        self._config = config
        self._port, self._gid_index = port, gid_index
        self._psn = secrets.randbits(24)
        self._regions: set[VerbsRegion] = set()
        self._recv_wrs: list[Any] = []
        self._qp: Any = None
        self._recv_cq: Any = None
        self._notifier: CqNotifier | None = None
        self._native: Any = None  # a native.attach() core: posts and polls in C
        self._fast: FastSink | None = None  # set: the core runs COPY jobs itself
        self._send_cq: Any = None
        self._channel: Any = None
        self._channel_fd = -1
        self._pd: Any = None
        self._ctx: Any = None
        # posted send-queue work requests in order: (wr_id, token, send slot)
        self._sq: collections.deque[tuple[int, int | None, int | None]] = collections.deque()
        self._next_wr_id = 1
        self._free_slots = list(range(config.queue_depth))
        self._send_slot = MAX_CAPSULE  # bytes of each send slot (`grow_send_slots`)
        # an unsignaled WRITE not posted yet: (local addr, length, lkey, remote addr, rkey)
        self._held: tuple[int, int, int, int, int] | None = None
        self.error: TransportError | None = None
        self._unreported: list[int] = []  # tokens of a failed link not yet reported
        self._recv_flushed = False  # a RECV failed: the QP is in error (see `_received`)
        self.connected = False
        self._closed = False
        _LIVE.add(self)
        try:
            self._ctx = Context(name=device)
            self._open(device)
        except BaseException as exc:
            self._release()
            if isinstance(exc, PyverbsError):
                raise TransportError(f"cannot set up a QP on {device} port {port}: {exc}") from exc
            raise

    # -- set-up

    def _open(self, device: str) -> None:
        """PD, the two CQs and the channel, the QP in INIT, the rings and the work requests."""
        cfg = self._config
        port_attr = self._ctx.query_port(self._port)
        dev_attr = self._ctx.query_device()
        self._mtu = _MTU_BYTES[int(port_attr.active_mtu)]
        self._lid = int(port_attr.lid)
        self._max_msg = int(port_attr.max_msg_sz)
        self._rd_atomic = min(
            RD_ATOMIC, int(dev_attr.max_qp_rd_atom), int(dev_attr.max_qp_init_rd_atom)
        )
        self._gid = _gid_bytes(self._ctx.query_gid(self._port, self._gid_index))
        self._ifindex = _gid_ifindex(self._ctx, self._port, self._gid_index)
        self._pd = PD(self._ctx)
        self._channel, self._channel_fd = _open_channel(self._ctx)
        self._open_recv_cq(cfg.recv_depth)
        self._send_cq = CQEX(self._ctx, CqInitAttrEx(cqe=cfg.send_depth))
        self._poll_attr = PollCqAttr()
        cap = QPCap(
            max_send_wr=cfg.send_depth, max_recv_wr=cfg.recv_depth, max_send_sge=1, max_recv_sge=1
        )
        init = QPInitAttr(qp_type=ev.IBV_QPT_RC, scq=self._send_cq, rcq=self._recv_cq, cap=cap)
        attr = QPAttr(port_num=self._port)
        attr.qp_access_flags = cfg.qp_access
        self._qp = QP(self._pd, init, attr)  # RC with attributes: created in INIT
        local_write = int(ev.IBV_ACCESS_LOCAL_WRITE)
        recv_slot = cfg.recv_slot
        self._recv_ring = self.register(cfg.recv_depth * recv_slot, Access.NONE, local_write)
        self._send_ring = self.register(cfg.queue_depth * MAX_CAPSULE, Access.NONE, 0)
        for slot in range(cfg.recv_depth):
            sge = SGE(self._recv_ring.addr + slot * recv_slot, recv_slot, self._recv_ring.lkey)
            try:
                self._recv_wrs.append(RecvWR(wr_id=slot, num_sge=1, sg=[sge]))
            finally:
                sge.close()  # RecvWR copied it; pyverbs 44 never frees an SGE by itself
            self._qp.post_recv(self._recv_wrs[slot])
        # One work request per kind of post, each pointing at its own SGE. A WR is copied
        # by the provider when posted, so these are rewritten for every post. Their own
        # SGE arrays (allocated by SendWR) are never freed: pyverbs 44 does not, and
        # close() would free the SGE we point them at instead. Four small leaks per QP.
        signaled = int(ev.IBV_SEND_SIGNALED)
        self._wrs: dict[str, tuple[Any, Any]] = {}
        for name, opcode, flags in (
            ("send", ev.IBV_WR_SEND, signaled),
            ("read", ev.IBV_WR_RDMA_READ, signaled),
            ("write", ev.IBV_WR_RDMA_WRITE, signaled),
            ("write_unsignaled", ev.IBV_WR_RDMA_WRITE, 0),
        ):
            sge = SGE(0, 0, 0)
            wr = SendWR(wr_id=0, opcode=opcode, num_sge=1, sg=[sge], send_flags=flags)
            wr.sg_list = sge
            self._wrs[name] = (wr, sge)
        self._send_wr, self._send_sge = self._wrs["send"]
        self._send_sge.lkey = self._send_ring.lkey
        if self._notifier is not None:  # the core polls extended CQs only
            self._native = native.attach(
                self._qp,
                self._pd,
                self._ctx,
                self._send_cq,
                self._recv_cq,
                (self._recv_ring.addr, recv_slot, cfg.recv_depth, self._recv_ring.lkey),
            )
        # An unsignaled WRITE whose `next` is the SEND's work request: a job's last WRITE
        # and its COMPLETION go to the device in one ibv_post_send (one doorbell: on rxe
        # one system call and one run of the requester instead of two). `post_rdma` holds
        # such a WRITE back until the SEND comes, or `flush` posts it alone.
        chain_sge = SGE(0, 0, 0)
        chain_wr = SendWR(
            wr_id=0, opcode=ev.IBV_WR_RDMA_WRITE, num_sge=1, sg=[chain_sge], send_flags=0
        )
        chain_wr.sg_list = chain_sge
        chain_wr.next_wr = self._send_wr
        self._chain = (chain_wr, chain_sge)
        # Kept, not read from the QP each time: a destroyed pyverbs QP must not be touched
        # (its qp_num reads freed memory), and a failed session is still listed.
        self._address = VerbsAddress(
            gid=self._gid, qp_num=int(self._qp.qp_num), psn=self._psn, mtu=self._mtu, lid=self._lid
        )
        log.debug("verbs %s port %d: QP %#x in INIT", device, self._port, self._address.qp_num)

    def _open_recv_cq(self, depth: int) -> None:
        """An extended CQ whose events `CqNotifier` arms, or else a plain one pyverbs arms."""
        attr = CqInitAttrEx(
            cqe=depth, channel=self._channel, wc_flags=int(ev.IBV_WC_EX_WITH_BYTE_LEN)
        )
        cq = CQEX(self._ctx, attr)
        try:
            self._notifier = CqNotifier(cq, self._channel, self._ctx, self._channel_fd)
        except NotifyUnavailable as exc:
            log.info("receive CQ events through a plain CQ: %s", exc)
            cq.close()
            self._notifier = None
            self._recv_cq = CQ(self._ctx, depth, None, self._channel, 0)
            self._poll_recv = self._poll_recv_plain  # type: ignore[method-assign]
        else:
            self._recv_cq = cq
            self._poll_recv = self._poll_recv_ex  # type: ignore[method-assign]

    @property
    def address(self) -> VerbsAddress:
        """This side's QP as the peer needs it (also after close)."""
        return self._address

    @property
    def native(self) -> bool:
        """Whether posts and polls go through the native core (`native.py`)."""
        return self._native is not None

    @property
    def channel_fd(self) -> int:
        """The completion channel's descriptor (readable once an armed RECV CQ completes)."""
        return self._channel_fd

    @property
    def netdev_ifindex(self) -> int:
        """The ifindex of the netdev this side's GID is on (0: unknown)."""
        return self._ifindex

    def connect(self, peer: PeerAddress | None) -> None:
        """INIT -> RTR -> RTS towards `peer`."""
        if self._closed:
            raise TransportError("transport is closed")
        if not isinstance(peer, VerbsAddress):
            raise TransportError(f"the verbs transport needs a verbs address, got {peer!r}")
        if self.connected:
            raise TransportError("already connected")
        attr = QPAttr(port_num=self._port)
        route = GlobalRoute(
            dgid=_gid_object(peer.gid), sgid_index=self._gid_index, hop_limit=HOP_LIMIT
        )
        attr.ah_attr = AHAttr(port_num=self._port, is_global=1, gr=route, dlid=peer.lid)
        attr.path_mtu = _mtu_enum(min(self._mtu, peer.mtu))
        attr.dest_qp_num = peer.qp_num
        attr.rq_psn = peer.psn
        attr.sq_psn = self._psn
        attr.max_dest_rd_atomic = self._rd_atomic
        attr.max_rd_atomic = self._rd_atomic
        attr.min_rnr_timer = MIN_RNR_TIMER
        attr.timeout = ACK_TIMEOUT
        attr.retry_cnt = RETRY_CNT
        attr.rnr_retry = RNR_RETRY
        try:
            self._qp.to_rts(attr)
        except PyverbsError as exc:
            raise TransportError(
                f"cannot connect QP {self._address.qp_num:#x} to {peer}: {exc}"
            ) from exc
        self.connected = True

    # -- memory

    def register(self, length: int, access: Access, flags: int) -> VerbsRegion:
        """A new registered region in this PD."""
        if self._closed:
            raise TransportError("transport is closed")
        if length < 0:
            raise ValueError(f"region length must not be negative, got {length}")
        region = VerbsRegion(self._pd, length, access, flags)
        self._regions.add(region)
        return region

    def deregister(self, region: Region) -> None:
        """Close a region of this PD; others are ignored."""
        if isinstance(region, VerbsRegion) and region in self._regions:
            self._regions.discard(region)
            region.close()

    # -- posting

    @property
    def outstanding(self) -> int:
        """Send-queue work requests posted and not yet completed (the core's included)."""
        core = self._native
        return len(self._sq) + (core.core_wrs if core is not None else 0)

    def room(self) -> int:
        """Work requests that can be posted now (a SEND also needs a free send slot)."""
        return self._config.send_depth - self._queued()

    def _queued(self) -> int:
        """Send-queue entries taken: posted and not completed (`outstanding`), a held WRITE."""
        return self.outstanding + (self._held is not None)

    def send_room(self) -> int:
        """Capsules that can be sent now."""
        return min(self.room(), len(self._free_slots))

    def can_send(self) -> bool:
        """Whether a SEND can be posted now, taking finished SENDs first if none can."""
        return bool(self.send_room() or (self.poll_sends(None) and self.send_room()))

    @property
    def send_slot(self) -> int:
        """Bytes of each send slot: the longest capsule `post_send` takes."""
        return self._send_slot

    def grow_send_slots(self, size: int) -> None:
        """Make every send slot `size` bytes (at least `MAX_CAPSULE`); nothing may be in flight.

        A host learns the session's `inline_max` after its QP was made (OpenSession
        carries both), so its send ring is replaced once, before its first SEND.
        """
        if size <= self._send_slot:
            return
        if self._sq or len(self._free_slots) != self._config.queue_depth:
            raise TransportError("send slots can only grow while no SEND is in flight")
        ring = self.register(self._config.queue_depth * size, Access.NONE, 0)
        self.deregister(self._send_ring)
        self._send_ring, self._send_slot = ring, size
        self._send_sge.lkey = ring.lkey

    def post_send(
        self, capsule: bytes | memoryview, token: int | None, tail: memoryview | None = None
    ) -> None:
        """Copy `capsule` (then `tail`, an inline source) into a send slot; post a SEND."""
        size = len(capsule)
        total = size if tail is None else size + tail.nbytes
        if total > self._send_slot:
            raise ValueError(f"capsule of {total} bytes exceeds {self._send_slot}")
        self._check_post()
        if not self._free_slots:
            raise TransportError("no free send slot (more capsules in flight than queue_depth)")
        slot = self._free_slots.pop()
        offset = slot * self._send_slot
        if self._native is not None and self._held is None:  # copy and post in one call
            self._native_copy_send(offset, capsule, tail, token, slot)
            return
        view = self._send_ring.view
        view[offset : offset + size] = capsule
        if tail is not None:
            view[offset + size : offset + total] = tail
        addr = self._send_ring.addr + offset
        if self._native is not None:
            self._native_chain(addr, total, token, slot)
            return
        sge = self._send_sge
        sge.addr = addr
        sge.length = total
        if self._held is None:
            self._post(self._send_wr, token, slot, "SEND")
        else:
            self._post_chain(token, slot)

    def _native_copy_send(
        self,
        offset: int,
        capsule: bytes | memoryview,
        tail: memoryview | None,
        token: int | None,
        slot: int,
    ) -> None:
        """`post_send` through the core: the copy into the slot and the SEND, one call."""
        wr_id = self._next_wr_id
        self._next_wr_id = wr_id + 1
        ring = self._send_ring
        rc = self._native.send_copy(
            wr_id, ring.addr + offset, self._send_slot, ring.lkey, capsule, tail
        )
        self._native_posted(rc, "SEND", slot)
        self._sq.append((wr_id, token, slot))

    def call(
        self, capsule: bytes, tail: memoryview | None, job_id: int, timeout: float
    ) -> CompletionFields | bool | None:
        """`post_send` of a host's SUBMIT, then up to `timeout` s for its COMPLETION.

        Through the core only (`_vcore` call): False at once, nothing posted, without
        it or without room for the SEND. Else the COMPLETION's fields if it came (its
        RECV reposted), or None: whatever arrived stays for the next poll.
        """
        core, free = self._native, self._free_slots
        if core is None or self.error is not None or not self.connected or not self.can_send():
            return False
        slot = free.pop()
        wr_id = self._next_wr_id
        self._next_wr_id = wr_id + 1
        ring, size = self._send_ring, self._send_slot
        try:
            fields: CompletionFields | None = core.call(
                wr_id, ring.addr + slot * size, size, ring.lkey, capsule, tail, job_id,
                int(timeout * 1e9),
            )  # fmt: skip
        except OSError as exc:
            raise self._post_failed("SEND", exc, slot) from None
        except ValueError:  # the capsule did not fit: nothing was posted
            free.append(slot)
            raise
        self._sq.append((wr_id, None, slot))
        if fields is not None and core.recv_errno:
            error = TransportError(f"reposting a RECV failed: {os.strerror(core.recv_errno)}")
            self.fail(error, None)
        return fields

    def _native_chain(self, addr: int, length: int, token: int | None, slot: int) -> None:
        """`post_send` through the core behind a held WRITE: both in one post."""
        w_addr, w_length, w_lkey, remote_addr, rkey = self._pop_held()
        wr_id = self._next_wr_id
        lkey = self._send_ring.lkey
        self._next_wr_id = wr_id + 2
        rc = self._native.post_chain(
            wr_id, w_addr, w_length, w_lkey, remote_addr, rkey, wr_id + 1, addr, length, lkey
        )
        self._native_posted(rc, "RDMA WRITE + SEND", slot)
        self._sq.append((wr_id, None, None))
        self._sq.append((wr_id + 1, token, slot))

    def _native_posted(self, rc: int, what: str, slot: int | None) -> None:
        """Fail the link as `_post` does when the core's post answered an errno."""
        if rc != 0:
            raise self._post_failed(what, f"{os.strerror(rc)} (errno {rc})", slot)

    def _post_failed(self, what: str, why: object, slot: int | None) -> TransportError:
        """A post was refused: give its slot back and fail the link; the error to raise."""
        if slot is not None:
            self._free_slots.append(slot)
        error = TransportError(f"posting {what} failed: {why}")
        self.fail(error, None)
        return error

    def post_rdma(  # noqa: PLR0913, PLR0917 - an RDMA operation's operands
        self,
        kind: str,
        local: Region,
        offset: int,
        length: int,
        remote: tuple[int, int],
        token: int | None,
    ) -> None:
        """Post an RDMA READ ("read") or WRITE ("write", "write_unsignaled")."""
        if not isinstance(local, VerbsRegion) or local not in self._regions:
            raise ValueError("the local region is not a live staging region of this transport")
        if offset < 0 or length <= 0 or offset + length > local.length:
            raise ValueError(
                f"span [{offset}, {offset + length}) is outside the {local.length}-byte region"
            )
        if length > self._max_msg:
            raise ValueError(f"{length} bytes exceed the port's max_msg_sz {self._max_msg}")
        self._check_post()
        if self._held is not None:  # what was posted first goes to the device first
            self._post_held()
        if kind == "write_unsignaled":
            self._held = (local.addr + offset, length, local.lkey, remote[0], remote[1])
            return
        if self._native is not None:
            wr_id = self._next_wr_id
            self._next_wr_id = wr_id + 1
            read = kind == "read"
            rc = self._native.post_rdma(
                wr_id, read, local.addr + offset, length, local.lkey, remote[0], remote[1], True
            )
            self._native_posted(rc, "RDMA READ" if read else "RDMA WRITE", None)
            self._sq.append((wr_id, token, None))
            return
        wr, sge = self._wrs[kind]
        sge.addr = local.addr + offset
        sge.length = length
        sge.lkey = local.lkey
        wr.set_wr_rdma(remote[1], remote[0])
        self._post(wr, token, None, "RDMA READ" if kind == "read" else "RDMA WRITE")

    def flush(self) -> None:
        """Post a held WRITE alone (no SEND followed it in this pass)."""
        if self._held is not None and self.error is None and not self._closed:
            self._post_held()

    def _pop_held(self) -> tuple[int, int, int, int, int]:
        """The held WRITE's operands (addr, length, lkey, remote addr, rkey); none held after."""
        held = self._held
        assert held is not None  # noqa: S101 - the callers checked
        self._held = None
        return held

    def _take_held(self, wr: Any, sge: Any) -> None:  # noqa: ANN401 - pyverbs SendWR, SGE
        """Write the held WRITE's operands into `wr` and `sge`; nothing is held after."""
        addr, length, lkey, remote_addr, rkey = self._pop_held()
        sge.addr, sge.length, sge.lkey = addr, length, lkey
        wr.set_wr_rdma(rkey, remote_addr)

    def _post_held(self) -> None:
        if self._native is not None:
            addr, length, lkey, remote_addr, rkey = self._pop_held()
            wr_id = self._next_wr_id
            self._next_wr_id = wr_id + 1
            rc = self._native.post_rdma(wr_id, False, addr, length, lkey, remote_addr, rkey, False)
            self._native_posted(rc, "RDMA WRITE", None)
            self._sq.append((wr_id, None, None))
            return
        wr, sge = self._wrs["write_unsignaled"]
        self._take_held(wr, sge)
        self._post(wr, None, None, "RDMA WRITE")

    def _post_chain(self, token: int | None, slot: int) -> None:
        """Post the held WRITE and the SEND prepared in the send WR with one call."""
        wr, sge = self._chain
        self._take_held(wr, sge)
        write_id = self._next_wr_id
        self._next_wr_id = write_id + 2
        wr.wr_id = write_id
        self._send_wr.wr_id = write_id + 1
        try:
            self._qp.post_send(wr)
        except PyverbsError as exc:
            self._free_slots.append(slot)
            error = TransportError(f"posting RDMA WRITE + SEND failed: {exc}")
            self.fail(error, None)
            raise error from exc
        self._sq.append((write_id, None, None))
        self._sq.append((write_id + 1, token, slot))

    def _check_post(self) -> None:
        if self.error is not None:
            raise self.error
        if not self.connected:
            raise TransportError("not connected")
        if self._queued() >= self._config.send_depth:
            raise TransportError("the send queue is full")

    def _post(self, wr: Any, token: int | None, slot: int | None, what: str) -> None:  # noqa: ANN401 - a pyverbs SendWR
        wr_id = self._next_wr_id
        self._next_wr_id = wr_id + 1
        wr.wr_id = wr_id
        try:
            self._qp.post_send(wr)
        except PyverbsError as exc:
            raise self._post_failed(what, exc, slot) from exc
        self._sq.append((wr_id, token, slot))

    # -- completions

    def poll(self, sink: LinkSink, budget: int) -> int:
        """Take send completions, then up to `budget` capsules; return how many."""
        if self._unreported:
            self._report_failed(sink)
        core = self._native
        taken = self.poll_sends(sink, budget) if self._sq or (core and core.core_busy) else 0
        if self._closed:  # a callback closed the link: its CQs are gone
            return taken
        return taken + self._poll_recv(sink, budget)

    def poll_sends(self, sink: LinkSink | None, budget: int = RECV_BATCH) -> int:
        """Take up to `budget` send-queue completions (sink None: report no tokens).

        Bounded: a token's callback usually posts the job's next operation, which on a
        fast device has completed by the next poll; unbounded, one busy job would keep
        the caller here for its whole run (and its reactor's other work waiting).
        """
        sq, core = self._sq, self._native
        taken = 0
        while (sq or (core and core.core_busy)) and taken < budget and not self._closed:
            got = self._take_send()
            if got is None:  # nothing (or an error code)
                return taken
            wr_id, status = got
            if wr_id & CORE_WR:  # one of the core's READ path failed
                self._failed_core(status, sink)
                return taken
            taken += 1
            ok = status == ev.IBV_WC_SUCCESS
            # RC completes the send queue in order: everything up to wr_id is done.
            while sq:
                done_id, token, slot = sq.popleft()
                if slot is not None:
                    self._free_slots.append(slot)
                last = done_id == wr_id
                if token is not None and (ok or not last) and sink is not None:
                    sink.on_done(token, None)
                if last:
                    if not ok:
                        self._failed_completion(status, token, sink)
                        return taken
                    break
        return taken

    def _take_send(self) -> tuple[int, int] | None:
        """The next send-queue completion: (wr_id, status), or None if there is none.

        Through the core, the READ path's own are taken there and only its failures
        come back.
        """
        core = self._native
        if core is not None:
            got: tuple[int, int] | None = core.poll_send()
            return got
        cq = self._send_cq
        if cq.start_poll(self._poll_attr) != 0:  # ENOENT: nothing (or an error code)
            return None
        wr_id, status = cq.wr_id, cq.status
        cq.end_poll()
        return wr_id, status

    def _failed_completion(self, status: int, token: int | None, sink: LinkSink | None) -> None:
        name = _wc_status_name(status)
        if status == ev.IBV_WC_REM_ACCESS_ERR:
            error: TransportError = RemoteAccessError(
                f"the peer refused an RDMA operation ({name}: rkey, bounds or access); "
                "the queue pair is now in the error state"
            )
        else:
            error = TransportError(f"a work request failed with {name}; the queue pair is in error")
        self.fail(error, sink, token)

    def _failed_core(self, status: int, sink: LinkSink | None) -> None:
        """A work request of the core's READ path failed (status), or its post (-errno)."""
        if status < 0:
            self.fail(TransportError(f"posting a job's WRITE failed: {os.strerror(-status)}"), sink)
        else:
            self._failed_completion(status, None, sink)

    def _core_done(self) -> None:
        """Hand the jobs the core's READ path answered to the fast sink."""
        fast, core = self._fast, self._native
        if fast is not None and core is not None and core.core_answered:
            fast.on_core_done(core.take_done())

    def core_cancel(self, job_id: int) -> bool:
        """See `AgentLink.core_cancel`; False once the job's answer went to the sink."""
        core = self._native
        if core is None or self._closed or core.core_cancel(job_id):
            return True
        self._core_done()
        return False

    def _poll_recv(self, sink: LinkSink, budget: int) -> int:
        """Take up to `budget` capsules (bound to the variant `_open_recv_cq` chose)."""
        raise NotImplementedError

    def _poll_recv_ex(self, sink: LinkSink, budget: int) -> int:
        if self._native is not None:
            return self._poll_recv_native(sink, budget)
        cq, attr = self._recv_cq, self._poll_attr
        taken = 0
        while taken < budget and not self._closed:
            if cq.start_poll(attr) != 0:  # ENOENT: empty
                break
            slot, status, length = cq.wr_id, cq.status, cq.read_byte_len()
            cq.end_poll()  # one batch per completion: rxe's next_poll breaks the queue
            taken += 1
            if not self._received(sink, slot, status, length):
                break
        return taken

    def fast_regions(
        self, regions: list[FastRegion], inline_max: int, default_deadline: float, sink: FastSink
    ) -> bool:
        """Set up the core's fast path (once) and the regions its jobs may use."""
        if self._native is None or inline_max <= 0 or self._closed:
            return False
        if self._fast is None:
            slot = (SUBMIT_SIZE + inline_max + 63) & ~63  # a COMPLETION, then the data
            depth = self._config.queue_depth
            ring = self.register(depth * slot, Access.NONE, 0)
            self._native.fast_setup(ring.addr, ring.lkey, slot, depth, inline_max)
            # The READ path: a slot per job, the COMPLETION then up to CORE_MAX bytes.
            slots = min(depth, CORE_SLOTS)
            slot = CORE_DATA + CORE_MAX
            ring = self.register(slots * slot, Access.NONE, int(ev.IBV_ACCESS_LOCAL_WRITE))
            deadline_ms = min(round(default_deadline * 1000), 0xFFFF_FFFF)
            self._native.read_setup(ring.addr, ring.lkey, slot, slots, CORE_MAX, deadline_ms)
        self._fast = sink
        self._native.set_regions(regions)
        return True

    def _serve_fast(
        self, sink: LinkSink, fast: FastSink, budget: int, job_room: int
    ) -> tuple[int, bool]:
        """Let the core run and start COPY jobs (`fast_regions`).

        (capsules taken, whether the core stopped at one for the pipeline: more may wait).
        """
        next_id, jobs, started, pending, err, inline_failed = self._native.serve(
            budget, self._next_wr_id, self.room(), job_room
        )
        self._next_wr_id = next_id
        taken = len(jobs) + len(started)
        if started:
            fast.on_core_jobs(started)
        if jobs:
            sq = self._sq
            for job in jobs:
                sq.append((job[8], None, None))
                sq.append((job[8] + 1, None, None))
            fast.on_fast_jobs(jobs, bool(inline_failed))
        if err:
            self.fail(TransportError(f"posting a fast job failed: {os.strerror(err)}"), sink)
            return taken, False
        if pending is None:
            return taken, False
        return taken + 1, self._received(sink, *pending)

    def _poll_recv_native(self, sink: LinkSink, budget: int) -> int:
        """Capsules through the core: its fast path while the sink allows, else one by one.

        Every capsule of the pass is handled before the next send completion is taken,
        whichever side handles it: a CANCEL right behind a job the core READs finds the
        job open, as in the pipeline (DP-2.5-1).
        """
        core, fast = self._native, self._fast
        if fast is not None:
            self._core_done()  # its jobs end before the next capsule is read (DP-2.6-2)
        taken = 0
        while taken < budget and not self._closed:
            job_room = 0
            if (
                fast is not None
                and self._held is None
                and not self._unreported
                and self.error is None
            ):  # a failed link starts nothing (its send queue's room is not known)
                job_room = fast.fast_room()
            if fast is not None and job_room > 0:
                served, more = self._serve_fast(sink, fast, budget - taken, job_room)
                taken += served
                if not more:
                    break
            else:
                got = core.poll_recv()
                if got is None:  # empty
                    break
                taken += 1
                if not self._received(sink, *got):
                    break
            if fast is not None:
                self._core_done()  # a send poll inside that capsule's handling took some
        return taken

    def idle_wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for a completion of either queue, left for the next poll.

        (`_vcore` wait_any.) False at once without the native core.
        """
        if self._native is None or self._closed or self.error is not None:
            return False
        return bool(self._native.wait_any(max(0, int(timeout * 1e9))))

    def spin_recv(self, sink: LinkSink, timeout: float) -> int:
        """Wait up to `timeout` s for one capsule, polling with the GIL released.

        For a host waiting on the answer it expects: it takes the capsule the moment it
        lands instead of after a turn of its event loop. Returns the capsules taken (0
        or 1); 0 at once without the native core.
        """
        if self._native is None or self._closed or self.error is not None:
            return 0
        got = self._native.spin_recv(max(0, int(timeout * 1e9)))
        if got is None:
            return 0
        self._received(sink, *got)
        return 1

    def _poll_recv_plain(self, sink: LinkSink, budget: int) -> int:
        if self._closed:
            return 0
        count: int
        count, wcs = self._recv_cq.poll(min(budget, RECV_BATCH))
        for wc in wcs:
            if not self._received(sink, wc.wr_id, wc.status, wc.byte_len):
                break
        return count

    def _received(self, sink: LinkSink, slot: int, status: int, length: int) -> bool:
        """Hand a received capsule over and repost its RECV; False once the link failed."""
        if status != ev.IBV_WC_SUCCESS:
            # A flushed RECV is a consequence: when the QP went to error because a send-queue
            # operation failed (RETRY_EXC_ERR, REM_ACCESS_ERR), that completion carries the
            # cause, and the device completes every outstanding send WR once in error. Report
            # it from there when one is outstanding; the RECVs' flushes say nothing more.
            self._recv_flushed = True
            if self.outstanding and status == ev.IBV_WC_WR_FLUSH_ERR:
                self.poll_sends(sink)
            if not self.outstanding:  # (the core's work requests count: its READs too)
                self.fail(
                    TransportError(
                        "the queue pair is in the error state (a RECV completed with "
                        f"{_wc_status_name(status)}): an operation failed on this side, "
                        "or the peer made an access this side refused"
                    ),
                    sink,
                )
            return False
        if self._recv_flushed:
            return False
        start = slot * self._config.recv_slot
        try:
            if self.error is None:
                sink.on_capsule(self._recv_ring.view[start : start + length])
        finally:
            if self.error is None and not self._closed:
                self._repost(sink, slot)
        return self.error is None and not self._closed

    def _repost(self, sink: LinkSink, slot: int) -> None:
        if self._native is not None:
            rc = self._native.post_recv(slot)
            if rc:
                self.fail(TransportError(f"reposting a RECV failed: {os.strerror(rc)}"), sink)
            return
        try:
            self._qp.post_recv(self._recv_wrs[slot])
        except PyverbsError as exc:
            self.fail(TransportError(f"reposting a RECV failed: {exc}"), sink)

    def arm(self, sink: LinkSink) -> bool:
        """Ask for an event on the next capsule; False if one arrived meanwhile (polled)."""
        if self.error is not None or self._closed:
            return True  # nothing will ever arrive: sleeping is right
        try:
            if self._notifier is not None:
                self._notifier.arm()
            else:
                self._recv_cq.req_notify()
        except (PyverbsError, OSError) as exc:
            self.fail(TransportError(f"arming the completion queue failed: {exc}"), sink)
            return True
        return self._poll_recv(sink, RECV_BATCH) == 0

    def take_events(self) -> None:
        """Consume the channel's pending events (the descriptor was readable)."""
        if self._closed:
            return
        try:
            if self._notifier is not None:
                self._notifier.take_events()
                return
            events = 0
            while _take_cq_event(self._channel, self._recv_cq):
                events += 1
            if events:
                self._recv_cq.ack_events(events)
        except (PyverbsError, OSError) as exc:
            self.fail(TransportError(f"completion channel failed: {exc}"), None)

    def fail(self, error: TransportError, sink: LinkSink | None, first: int | None = None) -> None:
        """The link is gone: every outstanding token is reported with the error, once.

        Without a sink at hand, the tokens wait for the next `poll`.
        """
        if self.error is not None:
            return
        self.error = error.detached()
        if not self._closed:
            log.warning("verbs data plane failed: %s", error)
        if first is not None:
            self._unreported.append(first)
        self._unreported += [token for _, token, _ in self._sq if token is not None]
        self._sq.clear()
        self._free_slots = list(range(self._config.queue_depth))
        if sink is not None:
            self._report_failed(sink)

    def _report_failed(self, sink: LinkSink) -> None:
        tokens, self._unreported = self._unreported, []
        assert self.error is not None  # noqa: S101 - only after fail()
        for token in tokens:
            sink.on_done(token, self.error)

    # -- teardown

    def close(self) -> None:
        """Destroy everything. Idempotent; reports nothing."""
        if self._closed:
            return
        self._closed = True
        if self.error is None:
            self.error = TransportError("transport closed")
        self._sq.clear()
        self._release()

    def _release(self) -> None:
        """Destroy in dependency order: QP, MRs, CQs, channel, PD, context."""
        if self._native is not None:
            self._native.close()  # its pointers die with the objects below
            self._native = None
        if self._qp is not None:
            self._qp.close()
        if self._notifier is not None:  # destroying a CQ waits for its events' acks
            with contextlib.suppress(OSError):
                self._notifier.take_events()
        for region in self._regions:
            region.close()
        self._regions.clear()
        for wr in self._recv_wrs:
            wr.close()  # frees its SGE array; a second close would free it again
        self._recv_wrs.clear()
        for obj in (self._send_cq, self._recv_cq, self._channel, self._pd, self._ctx):
            if obj is not None:
                obj.close()  # pyverbs' close() is idempotent
        # Drop the objects now: a pyverbs Context closes what it still tracks when it is
        # freed, and at interpreter exit the channel's Python subclass may be gone by then.
        self._notifier = None
        self._send_cq = self._recv_cq = self._channel = self._qp = None
        self._pd = self._ctx = None


if _PYVERBS_MISSING is None:

    class _Channel(CompChannel):  # type: ignore[misc]
        """A completion channel an extended CQ can be bound to.

        pyverbs 44's CQEX calls `channel.add_ref(cq)`, a cdef method Python code cannot
        reach, so binding any CompChannel raises AttributeError once the CQ exists. This
        Python-level `add_ref` takes the call; the link destroys its CQs before the
        channel itself, which is all the reference was for.
        """

        def add_ref(self, obj: object) -> None:
            """Nothing to remember: see the class docstring."""


def _open_channel(ctx: Any) -> tuple[Any, int]:  # noqa: ANN401 - pyverbs Context
    """A completion channel and its file descriptor, set non-blocking.

    pyverbs 44 does not expose the channel's fd (`CompChannel.fd` arrived in rdma-core
    57), so where it is missing the fd is the one new "[infinibandevent]" descriptor.
    """
    before = set(_event_fds())
    channel = _Channel(ctx)
    fd = getattr(channel, "fd", None)
    if fd is None:
        new = [fd for fd in _event_fds() if fd not in before]
        if len(new) != 1:
            channel.close()
            raise TransportError(
                f"cannot tell the completion channel's fd ({len(new)} new event fds)"
            )
        fd = new[0]
    os.set_blocking(fd, False)  # ibv_get_cq_event then fails with EAGAIN instead of waiting
    return channel, int(fd)


def _event_fds() -> Iterator[int]:
    for entry in pathlib.Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            if str(entry.readlink()) == _EVENT_FD_LINK:
                yield int(entry.name)


def _take_cq_event(channel: Any, cq: Any) -> bool:  # noqa: ANN401 - pyverbs objects
    """Consume one event from the non-blocking channel; False when there is none."""
    try:
        channel.get_cq_event(cq)
    except PyverbsRDMAError as exc:
        if exc.error_code in (errno.EAGAIN, errno.EWOULDBLOCK):
            return False
        raise
    return True


def _config(  # noqa: PLR0913, PLR0917 - the verbs knobs
    device: str | None,
    port: int | None,
    gid_index: int | None,
    queue_depth: int,
    send_depth: int | None,
    recv_depth: int | None,
    qp_access: int,
    recv_slot: int = MAX_CAPSULE,
) -> _Config:
    default_depth = 2 * queue_depth + 8
    return _Config(
        device=device,
        port=port,
        gid_index=gid_index,
        queue_depth=queue_depth,
        send_depth=default_depth if send_depth is None else send_depth,
        recv_depth=default_depth if recv_depth is None else recv_depth,
        qp_access=qp_access,
        recv_slot=recv_slot,
    )


# ---------------------------------------------------------------- the agent side


class VerbsAgentLink(AgentLink):
    """Agent side: RDMA READs host regions into staging memory and WRITEs results back.

    Driven by the agent's reactor (see `AgentLink`). `connect` is called once, before
    the reactor takes the link over.

    Args:
        device: RDMA device name; None: the first with a usable port (`find_port`).
        port: port number; None: the first ACTIVE one.
        gid_index: GID table index; None: the port's IPv4-mapped RoCEv2 GID.
        queue_depth: capsules in flight (send slots); sets the other depths' defaults.
        send_depth: send-queue WRs (SEND, READ, WRITE) in flight; default 3 * queue_depth + 8.
        recv_depth: RECV buffers posted; default 2 * queue_depth + 8.
        inline_max: the largest job source a SUBMIT may carry inline (0..16384); each
            RECV buffer is then max(256, 80 + inline_max) bytes (docs/data-plane.md 2.8).
            The link offers less (`self.inline_max`) where the RECV ring would exceed
            RECV_RING_BYTES.
    """

    needs_polling = True

    def __init__(  # noqa: PLR0913 - the verbs knobs, all with defaults
        self,
        device: str | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        queue_depth: int = 32,
        *,
        send_depth: int | None = None,
        recv_depth: int | None = None,
        inline_max: int = 0,
    ) -> None:
        # A job has at most a WRITE and its COMPLETION's SEND in flight, and every send
        # slot may hold a refusal besides: 3 per job keeps the send queue from filling.
        depth = 3 * queue_depth + 8 if send_depth is None else send_depth
        config = _config(device, port, gid_index, queue_depth, depth, recv_depth, 0)
        _slot_bytes(inline_max)  # in range
        self.inline_max = inline_within(inline_max, config.recv_depth)
        slot = _slot_bytes(self.inline_max)
        self._qp = _QueuePair(dataclasses.replace(config, recv_slot=slot))

    @property
    def error(self) -> TransportError | None:  # type: ignore[override]
        """Why the link failed, or None."""
        return self._qp.error

    @property
    def address(self) -> VerbsAddress:
        """This side's QP as the host needs it."""
        return self._qp.address

    @property
    def netdev_ifindex(self) -> int:
        """The ifindex of the netdev the link's GID is on: where its packets leave (0: unknown)."""
        return self._qp.netdev_ifindex

    def connect(self, host: PeerAddress) -> None:
        """INIT -> RTR -> RTS towards the host's QP (its address came in OpenSession)."""
        self._qp.connect(host)

    def idle_wait(self, seconds: float) -> bool:
        """See `AgentLink.idle_wait`: the native core spins on the receive CQ."""
        return self._qp.idle_wait(seconds)

    def fast_regions(self, regions: list[FastRegion], sink: FastSink) -> bool:
        """See `AgentLink.fast_regions`: with the native core, COPY jobs run in C."""
        return self._qp.fast_regions(regions, self.inline_max, sink.default_deadline, sink)

    def core_cancel(self, job_id: int) -> bool:
        """See `AgentLink.core_cancel`."""
        return self._qp.core_cancel(job_id)

    def staging(self, length: int) -> VerbsRegion:
        """Local memory registered for LOCAL_WRITE only: READ target and WRITE source."""
        return self._qp.register(length, Access.NONE, int(ev.IBV_ACCESS_LOCAL_WRITE))

    def release(self, region: Region) -> None:
        """Deregister and unmap a staging region."""
        self._qp.deregister(region)

    def fileno(self) -> int:
        """The completion channel (readable after `arm` once a capsule arrives)."""
        return self._qp.channel_fd

    def on_event(self) -> None:
        """Consume the channel's events."""
        self._qp.take_events()

    @property
    def outstanding(self) -> int:
        """Send-queue work requests not yet completed."""
        return self._qp.outstanding

    def room(self) -> int:
        """Operations that can be posted now (a SEND also needs a send slot)."""
        return self._qp.send_room()

    def post_read(  # noqa: PLR0913, PLR0917 - an RDMA READ's operands
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int
    ) -> None:
        """Post a signalled RDMA READ into `local[offset:]`."""
        self._qp.post_rdma("read", local, offset, length, (addr, rkey), token)

    def post_write(  # noqa: PLR0913, PLR0917 - an RDMA WRITE's operands
        self, local: Region, offset: int, length: int, addr: int, rkey: int, token: int | None
    ) -> None:
        """Post an RDMA WRITE, unsignalled when `token` is None."""
        kind = "write_unsignaled" if token is None else "write"
        self._qp.post_rdma(kind, local, offset, length, (addr, rkey), token)

    def post_send(self, capsule: bytes, token: int | None = None) -> None:
        """Post a signalled SEND of a capsule."""
        self._qp.post_send(capsule, token)

    def flush(self) -> None:
        """Post a WRITE held back for a SEND that did not come in this pass."""
        with contextlib.suppress(TransportError):  # the link failed: `error` says why
            self._qp.flush()

    def poll(self, sink: LinkSink, budget: int) -> int:
        """Take send completions and up to `budget` capsules."""
        return self._qp.poll(sink, budget)

    def arm(self, sink: LinkSink) -> bool:
        """Arm the receive CQ's event; False if a capsule slipped in (handed to `sink`)."""
        return self._qp.arm(sink)

    def close(self) -> None:
        """Destroy the QP, the regions and the device resources. Idempotent."""
        self._qp.close()


# ---------------------------------------------------------------- the host side


class VerbsHostLink(HostLink):
    """Host side: registers regions the agent reads and writes; exchanges capsules.

    Completions are taken on the program's event loop without a task per job: after a
    send, or while `expecting()` says answers are due, the link polls its CQs once per
    loop iteration (`loop.call_soon`) for up to `spin` seconds after the last activity;
    then it arms the receive CQ's event and waits on the completion channel.

    The spin follows the answers' rhythm: the link spins only while an answer has come,
    on average, within `spin` of the send or answer before it (a moving average of the
    last few, `GAP_WEIGHT`). Answers further apart than `spin` would find every spin
    run out, and on a machine whose cores also run the agent or the NIC the spinning
    takes CPU from the work being waited for. `Session.run`'s call of a job alone
    always spins: its answer is one round trip away.

    Args:
        device: RDMA device name; None: the first with a usable port (`find_port`).
        port: port number; None: the first ACTIVE one.
        gid_index: GID table index; None: the port's IPv4-mapped RoCEv2 GID.
        queue_depth: capsules in flight (send slots); sets the other depths' defaults.
        spin: seconds to keep polling after the last activity (0: sleep at once).
        send_depth: send-queue WRs in flight; default 2 * queue_depth + 8.
        recv_depth: RECV buffers posted; default 2 * queue_depth + 8.
    """

    def __init__(  # noqa: PLR0913 - the verbs knobs, all with defaults
        self,
        device: str | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        queue_depth: int = 32,
        *,
        spin: float = DEFAULT_SPIN_S,
        send_depth: int | None = None,
        recv_depth: int | None = None,
    ) -> None:
        access = int(ev.IBV_ACCESS_REMOTE_READ | ev.IBV_ACCESS_REMOTE_WRITE)
        depth = 2 * queue_depth + 8 if send_depth is None else send_depth
        # the send ring must hold a SUBMIT and a CANCEL for every job in flight
        self._qp = _QueuePair(
            _config(device, port, gid_index, depth, send_depth, recv_depth, access)
        )
        self._spin = spin
        self._gap = 0.0  # the moving average of the waits for an answer (s)
        self._since = 0.0  # the last send or answer: the wait for the next one starts
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_capsule: Callable[[memoryview], None] | None = None
        self._on_failure: Callable[[TransportError], None] | None = None
        self._expecting: Callable[[], bool] = lambda: False
        self._polling = False
        self._last = 0.0
        self._reported = False
        self._closed = False
        self._backlog: collections.deque[tuple[bytes, memoryview | None]] = collections.deque()
        self.inline_max = 0  # sources SUBMITs carry inline (`accept_inline`)
        self._by_rkey: dict[int, VerbsRegion] = {}  # the regions registered, for local_view
        self._waits = 0  # `wait` calls since the event loop last turned (ran `_step`)

    @property
    def address(self) -> VerbsAddress:
        """This side's QP as the agent needs it."""
        return self._qp.address

    async def connect(self, agent: PeerAddress | None) -> None:
        """Connect to the agent's QP (its address came back from OpenSession)."""
        self._qp.connect(agent)

    @property
    def native(self) -> bool:
        """Whether the link posts and polls through the native core (`native.py`)."""
        return self._qp.native

    def register(self, length: int, access: Access) -> VerbsRegion:
        """Allocate `length` bytes and register them with only the access asked for."""
        region = self._qp.register(length, access, _mr_flags(access))
        self._by_rkey[region.rkey] = region
        return region

    def deregister(self, region: Region) -> None:
        """Deregister and unmap a region: the agent's later accesses fail."""
        if self._by_rkey.get(region.rkey) is region:
            del self._by_rkey[region.rkey]
        self._qp.deregister(region)

    def accept_inline(self, limit: int) -> int:
        """Send SUBMITs with up to `limit` source bytes inline (before the first send).

        Every send slot grows to 80 + `limit` bytes (the source is copied in after the
        SUBMIT: a reused pyverbs work request carries one SGE).
        """
        self._qp.grow_send_slots(_slot_bytes(limit))
        self.inline_max = limit
        return limit

    def local_view(self, span: Span) -> memoryview | None:
        """The memory behind `span` if it lies in a region the agent may READ."""
        if not self.inline_max:
            return None
        return readable_view(self._by_rkey.get(span[2]), span)

    def start(
        self,
        on_capsule: Callable[[memoryview], None],
        on_failure: Callable[[TransportError], None],
        expecting: Callable[[], bool],
    ) -> None:
        """Take completions on this event loop from now on."""
        self._loop = asyncio.get_running_loop()
        self._on_capsule, self._on_failure, self._expecting = on_capsule, on_failure, expecting
        self._loop.add_reader(self._qp.channel_fd, self._on_channel)
        self._kick()

    def send(self, capsules: Sequence[OutCapsule]) -> None:
        """Post a SEND per capsule, in order; TransportError once the link failed.

        Capsules that find every send slot taken wait in order and go out as earlier
        SENDs complete. A `(submit, source)` pair goes as one SEND once `accept_inline`
        allowed inline sources.
        """
        qp = self._qp
        if qp.error is not None:
            raise qp.error
        if len(capsules) == 1 and not self._backlog and qp.can_send():
            head, tail = self._parts(capsules[0])  # one capsule and room for it: straight out
            qp.post_send(head, None, tail)
            self._kick(sent=True)
            return
        out: list[tuple[bytes, memoryview | None]] = []
        limit = qp.send_slot
        for capsule in capsules:
            item = self._parts(capsule)
            size = len(item[0]) + (item[1].nbytes if item[1] is not None else 0)
            if size > limit:
                raise ValueError(f"capsule of {size} bytes exceeds {limit}")
            out.append(item)
        self._backlog.extend(out)
        self._send_backlog()
        self._kick(sent=True)

    def _parts(self, capsule: OutCapsule) -> tuple[bytes, memoryview | None]:
        """A capsule's SUBMIT and its inline source (None without one).

        TypeError for a source this link was not set up to carry (`accept_inline`).
        """
        if not isinstance(capsule, tuple):
            return capsule, None
        if not self.inline_max:
            raise TypeError("this link carries no inline sources (inline_max 0)")
        return capsule

    def _send_backlog(self) -> None:
        qp, backlog = self._qp, self._backlog
        while backlog and qp.error is None:
            if not qp.can_send():
                return  # the rest goes once SENDs complete (polled in _step)
            capsule, tail = backlog.popleft()
            qp.post_send(capsule, None, tail)

    def _kick(self, *, sent: bool = False) -> None:
        self._last = time.monotonic()
        if sent:
            self._since = self._last
        if not self._polling and self._loop is not None and not self._closed:
            self._polling = True
            self._loop.call_soon(self._step)

    def _step(self) -> None:
        """One poll; come back next loop iteration while busy, else arm and sleep."""
        self._polling = False
        self._waits = 0
        if self._closed:
            return
        qp = self._qp
        if qp.poll(self, RECV_BATCH):
            self._last = time.monotonic()
        if self._backlog:
            self._send_backlog()
        if self._report():
            return
        busy = self._expecting() or qp.outstanding
        if self._backlog or (busy and self._spins() and time.monotonic() - self._last < self._spin):
            self._polling = True
            assert self._loop is not None  # noqa: S101 - set by start()
            self._loop.call_soon(self._step)
        elif not qp.arm(self):
            self._kick()  # a capsule arrived while arming: it was handed over; go on
        else:
            self._report()

    def call(self, capsule: OutCapsule, job_id: int) -> CompletionFields | bool:
        """Post the SUBMIT and spin up to `spin` s for its COMPLETION (HostLink.call).

        Only through the native core, with nothing waiting to be sent and room for the
        SEND; False otherwise, and nothing is sent. The caller lets its event loop turn
        between calls (`Session.run`).
        """
        if self._closed or self._loop is None or self._backlog:
            return False
        head, tail = self._parts(capsule)
        fields = self._qp.call(head, tail, job_id, self._spin)
        if fields is None:
            self._kick(sent=True)  # the answer comes the usual way
            return True
        if fields is not False and self._qp.error is not None:  # a RECV not reposted
            self._report()
        return fields

    def _on_channel(self) -> None:
        self._qp.take_events()
        self._kick()

    def _spins(self) -> bool:
        """Whether answers come close enough together to spin for the next one."""
        return self._gap < self._spin

    def wait(self) -> None:
        """Spin up to `spin` s for the next capsule with the native core (HostLink.wait).

        At most `WAIT_TURNS` times in a row between two turns of the event loop (each
        turn runs `_step`): a program that awaits only jobs answered this way would
        otherwise never let its other tasks run.
        """
        if self._closed or self._loop is None or not self._qp.native:
            return
        if self._waits >= WAIT_TURNS or not self._spins():
            return
        self._waits += 1
        if self._qp.spin_recv(self, self._spin):  # send completions: at the next send
            self._last = time.monotonic()
            self._report()

    def on_capsule(self, data: memoryview) -> None:
        """LinkSink: a capsule arrived."""
        now = time.monotonic()
        wait = min(now - self._since, GAP_CAP * self._spin)
        self._gap += (wait - self._gap) * GAP_WEIGHT
        self._since = now
        if self._on_capsule is not None:
            self._on_capsule(data)

    def on_done(self, token: int, error: TransportError | None) -> None:
        """LinkSink: the host posts no tokens."""

    def _report(self) -> bool:
        error = self._qp.error
        if error is None:
            return False
        if not self._reported and not self._closed:
            self._reported = True
            if self._on_failure is not None:
                self._on_failure(error)
        return True

    async def close(self) -> None:
        """Destroy the QP, regions and device resources. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.remove_reader(self._qp.channel_fd)
        self._qp.close()
