"""The verbs transport: a session's data plane on one RDMA RC queue pair (pyverbs).

Each transport object (one per session, on either side) owns a device context, one
protection domain, one completion queue for sends and receives, and one RC queue pair:

- Capsules travel as SEND into a ring of `recv_depth` pre-posted RECV buffers of
  `MAX_CAPSULE` bytes (one registered region). A consumed RECV is reposted before its
  capsule is handed to `recv()`, so the peer's credits never run out while the
  receiving program is busy (NVMe-oF/RDMA does the same); `rnr_retry=7` makes a
  sender wait, not fail, should it ever find the ring empty.
- `send()` copies the capsule into one of `queue_depth` registered send slots and
  posts a signalled SEND; `read()`/`write()` post one signalled RDMA READ/WRITE
  straight between the staging region and the host's region. Every call returns when
  its work completion arrives. At most `send_depth` work requests are posted at once.
- Completions are polled from asyncio: `poll_mode="event"` waits on a completion
  channel's file descriptor with `loop.add_reader`; `poll_mode="busy"` polls the CQ
  from a task that yields to the loop between polls (what a DPU service would do).

Connection, out of band (OpenSession carries the addresses): the host builds its
transport (QP in INIT, RECVs posted) and sends `address`; the agent builds its own,
`await connect(host_address)` (RTR, RTS) and returns its `address`; the host
`await connect(agent_address)`. The agent must not send before the host connected:
a SEND to a QP that is not yet RTR is dropped and retried, and fails with
IBV_WC_RETRY_EXC_ERR once the retry budget (below) is spent.

Differences from the tcp transport (same interface, RDMA semantics):

- A refused READ or WRITE (bad rkey, out of bounds, access not granted) fails with
  `RemoteAccessError` *and moves both queue pairs to the error state* (the host's
  RECVs are flushed): every pending and later operation on the session, on either
  side, fails with `TransportError`. The tcp host refuses the one access and goes
  on. So the agent validates every span against the regions the host registered
  before it posts a READ or WRITE.
- The peer going away is not signalled: RC notices only when an operation finds no
  responder. The requester retries `retry_cnt=6` times after an ACK timeout of
  4.096 us * 2**14 = 67 ms, so the next SEND, READ or WRITE fails with
  IBV_WC_RETRY_EXC_ERR after 7 * 67 ms = 0.47 s (0.48 s measured on rxe); then the
  link is dead and `recv()` fails too. A side that only waits in `recv()` learns
  nothing until it posts.
- A capsule longer than `MAX_CAPSULE`, a span outside the local region or longer
  than the port's `max_msg_sz` raise ValueError before anything is posted.

pyverbs comes from the distribution (Debian's python3-pyverbs, rdma-core 44); it is
imported optionally, so this module imports (and type-checks) where it is absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import ipaddress
import logging
import os
import pathlib
import secrets
from typing import TYPE_CHECKING, Any, Final

from dpu_wire.capsule import MAX_CAPSULE
from dpu_wire.transport import _memory
from dpu_wire.transport.base import (
    Access,
    AgentTransport,
    CapsuleInbox,
    HostTransport,
    PeerAddress,
    Region,
    RemoteAccessError,
    TransportError,
    VerbsAddress,
)

if TYPE_CHECKING:
    import mmap
    from collections.abc import Iterator

# Importing pyverbs calls logging.basicConfig(level=INFO) (pyverbs/base.pyx): keep the
# root logger as the program set it up.
_root_logger = logging.getLogger()
_root_setup = (list(_root_logger.handlers), _root_logger.level)
try:  # Debian's python3-pyverbs; absent on machines without rdma-core
    import pyverbs.enums as ev
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ, CompChannel
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

# RC attributes for INIT -> RTR -> RTS (ibv_rc_pingpong's, with more RDMA READs in flight).
ACK_TIMEOUT: Final = 14  # 4.096 us * 2**14 = 67 ms before a retry
# Retries after an ACK timeout: 7 tries x 67 ms = 0.47 s to notice a vanished peer. Not 7:
# rxe (drivers/infiniband/sw/rxe/rxe_comp.c) never counts a retry_cnt of 7 down, i.e.
# retries forever, as the spec has it only for rnr_retry.
RETRY_CNT: Final = 6
RNR_RETRY: Final = 7  # 7 = retry forever when the peer has no RECV posted
MIN_RNR_TIMER: Final = 12  # 0.64 ms before a RECV-not-ready retry
RD_ATOMIC: Final = 16  # RDMA READs in flight (clamped to what the device supports)
HOP_LIMIT: Final = 64  # RoCEv2 may cross routers
POLL_BATCH: Final = 16  # work completions taken per poll

_RECV_TAG: Final = 1 << 63  # wr_id of a RECV: the tag | its ring slot
_EVENT_FD_LINK: Final = "anon_inode:[infinibandevent]"
_MTU_BYTES: Final = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # enum ibv_mtu -> bytes


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


@dataclasses.dataclass(slots=True)
class _Pending:
    """A posted send-queue work request waiting for its completion."""

    future: asyncio.Future[None]
    what: str  # "SEND", "RDMA READ", "RDMA WRITE"
    slot: int | None  # the send slot a SEND occupies


@dataclasses.dataclass(frozen=True)
class _Config:
    device: str | None
    port: int | None
    gid_index: int | None
    queue_depth: int
    send_depth: int
    recv_depth: int
    poll_mode: str  # "event" or "busy"
    qp_access: int

    def check(self) -> None:
        if self.poll_mode not in ("event", "busy"):
            raise ValueError(f"poll_mode must be 'event' or 'busy', not {self.poll_mode!r}")
        for name in ("queue_depth", "send_depth", "recv_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


class _QueuePair:
    """The machinery both sides share: resources, rings, posting and completions."""

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
        self._cq: Any = None
        self._channel: Any = None
        self._channel_fd = -1
        self._pd: Any = None
        self._pending: dict[int, _Pending] = {}
        self._next_wr_id = 1
        self._credits = asyncio.Semaphore(config.send_depth)
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(config.queue_depth):
            self._free_slots.put_nowait(slot)
        self._inbox = CapsuleInbox()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None
        self._closed = False
        self._ctx: Any = None
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
        """Create PD, CQ (+ channel), QP in INIT, the rings; post every RECV."""
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
        self._pd = PD(self._ctx)
        if cfg.poll_mode == "event":
            self._channel, self._channel_fd = _open_channel(self._ctx)
        self._cq = CQ(self._ctx, cfg.send_depth + cfg.recv_depth, None, self._channel, 0)
        cap = QPCap(
            max_send_wr=cfg.send_depth, max_recv_wr=cfg.recv_depth, max_send_sge=1, max_recv_sge=1
        )
        init = QPInitAttr(qp_type=ev.IBV_QPT_RC, scq=self._cq, rcq=self._cq, cap=cap)
        attr = QPAttr(port_num=self._port)
        attr.qp_access_flags = cfg.qp_access
        self._qp = QP(self._pd, init, attr)  # RC with attributes: created in INIT
        local_write = int(ev.IBV_ACCESS_LOCAL_WRITE)
        self._recv_ring = self.register(cfg.recv_depth * MAX_CAPSULE, Access.NONE, local_write)
        self._send_ring = self.register(cfg.queue_depth * MAX_CAPSULE, Access.NONE, 0)
        for slot in range(cfg.recv_depth):
            sge = SGE(self._recv_ring.addr + slot * MAX_CAPSULE, MAX_CAPSULE, self._recv_ring.lkey)
            try:
                self._recv_wrs.append(RecvWR(wr_id=_RECV_TAG | slot, num_sge=1, sg=[sge]))
            finally:
                sge.close()  # RecvWR copied it; pyverbs 44 never frees an SGE by itself
            self._qp.post_recv(self._recv_wrs[slot])
        # Kept, not read from the QP each time: a destroyed pyverbs QP must not be touched
        # (its qp_num reads freed memory), and a failed session is still listed.
        self._address = VerbsAddress(
            gid=self._gid, qp_num=int(self._qp.qp_num), psn=self._psn, mtu=self._mtu, lid=self._lid
        )
        log.debug("verbs %s port %d: QP %#x in INIT", device, self._port, self._address.qp_num)

    @property
    def address(self) -> VerbsAddress:
        """This side's QP as the peer needs it (also after close)."""
        return self._address

    def connect(self, peer: PeerAddress | None) -> None:
        """INIT -> RTR -> RTS towards `peer`, then start taking completions."""
        if self._closed:
            raise TransportError("transport is closed")
        if not isinstance(peer, VerbsAddress):
            raise TransportError(f"the verbs transport needs a verbs address, got {peer!r}")
        if self._loop is not None:
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
        self._start_completions()

    def _start_completions(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._config.poll_mode == "event":
            self._cq.req_notify()
            self._loop.add_reader(self._channel_fd, self._on_channel)
            self._on_channel()  # anything that completed before the reader was added
        else:
            self._poller = self._loop.create_task(self._busy_poll(), name="verbs-cq-poller")

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

    # -- operations

    async def send(self, capsule: bytes) -> None:
        """Copy `capsule` into a send slot and SEND it; return once it completed."""
        if len(capsule) > MAX_CAPSULE:
            raise ValueError(f"capsule of {len(capsule)} bytes exceeds {MAX_CAPSULE}")
        self._check()
        slot = await self._free_slots.get()
        offset = slot * MAX_CAPSULE
        self._send_ring.view[offset : offset + len(capsule)] = capsule
        local = (self._send_ring.addr + offset, len(capsule), self._send_ring.lkey)
        await self._post("SEND", ev.IBV_WR_SEND, local, (0, 0), slot)

    async def rdma(
        self, opcode: int, local: Region, offset: int, length: int, remote: tuple[int, int]
    ) -> None:
        """One signalled RDMA READ/WRITE between `local[offset:+length]` and (addr, rkey)."""
        region = self._local(local, offset, length)
        what = "RDMA READ" if opcode == ev.IBV_WR_RDMA_READ else "RDMA WRITE"
        await self._post(what, opcode, (region.addr + offset, length, region.lkey), remote, None)

    def _local(self, local: Region, offset: int, length: int) -> VerbsRegion:
        """`local` as a live region of this transport, with the span inside it."""
        if not isinstance(local, VerbsRegion) or local not in self._regions:
            raise ValueError("the local region is not a live staging region of this transport")
        if offset < 0 or length < 0 or offset + length > local.length:
            raise ValueError(
                f"span [{offset}, {offset + length}) is outside the {local.length}-byte region"
            )
        if length > self._max_msg:
            raise ValueError(f"{length} bytes exceed the port's max_msg_sz {self._max_msg}")
        return local

    async def recv(self) -> bytes:
        """The next capsule, or TransportError once the link is gone."""
        if self._closed:
            raise TransportError("transport is closed")
        return await self._inbox.get()

    def _check(self) -> None:
        if self._inbox.error is not None:
            raise self._inbox.error
        if self._loop is None:
            raise TransportError("not connected")

    async def _post(
        self,
        what: str,
        opcode: int,
        local: tuple[int, int, int],
        remote: tuple[int, int],
        slot: int | None,
    ) -> None:
        """Post one signalled send-queue WR within the credits; await its completion."""
        try:
            await self._credits.acquire()
        except BaseException:
            self._give_back(slot)
            raise
        try:
            self._check()
            assert self._loop is not None  # noqa: S101 - _check made sure
            wr_id = self._next_wr_id
            self._next_wr_id += 1
            future = self._loop.create_future()
            self._post_wr(wr_id, opcode, local, remote)
        except BaseException as exc:
            self._credits.release()
            self._give_back(slot)
            if isinstance(exc, PyverbsError):
                error = TransportError(f"posting {what} failed: {exc}")
                self._fail(error)
                raise error from exc
            raise
        self._pending[wr_id] = _Pending(future, what, slot)
        await future

    def _post_wr(
        self, wr_id: int, opcode: int, local: tuple[int, int, int], remote: tuple[int, int]
    ) -> None:
        """Post one signalled send-queue WR with one SGE (`local` = addr, length, lkey)."""
        sge = SGE(*local)
        try:
            wr = SendWR(
                wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=ev.IBV_SEND_SIGNALED
            )
        finally:
            sge.close()  # SendWR copied it; pyverbs 44 never frees an SGE by itself
        try:
            if opcode != ev.IBV_WR_SEND:
                addr, rkey = remote
                wr.set_wr_rdma(rkey, addr)
            self._qp.post_send(wr)  # the provider copies the WR into its queue
        finally:
            wr.close()  # frees the WR's SGE array, which pyverbs 44 would leak

    def _give_back(self, slot: int | None) -> None:
        if slot is not None:
            self._free_slots.put_nowait(slot)

    def _retire(self, op: _Pending) -> None:
        """Return what a finished WR held: its credit and its send slot."""
        self._credits.release()
        self._give_back(op.slot)

    # -- completions

    def _on_channel(self) -> None:
        """The channel fd is readable: take the events, re-arm, poll until empty."""
        try:
            events = 0
            while _take_cq_event(self._channel, self._cq):
                events += 1
            if events:
                self._cq.ack_events(events)
            self._cq.req_notify()  # before the last poll: a later completion raises an event
            self._drain()
        except PyverbsError as exc:
            self._fail(TransportError(f"completion channel failed: {exc}"))

    async def _busy_poll(self) -> None:
        try:
            while self._inbox.error is None:  # a failed link has nothing left to complete
                self._drain()
                await asyncio.sleep(0)
        except PyverbsError as exc:
            self._fail(TransportError(f"polling the completion queue failed: {exc}"))

    def _drain(self) -> None:
        while True:
            count, wcs = self._cq.poll(POLL_BATCH)
            for wc in wcs:
                self._complete(int(wc.wr_id), int(wc.status), int(wc.byte_len))
            if count < POLL_BATCH:
                return

    def _complete(self, wr_id: int, status: int, byte_len: int) -> None:
        if wr_id & _RECV_TAG:
            self._received(wr_id & ~_RECV_TAG, status, byte_len)
            return
        op = self._pending.pop(wr_id, None)
        if op is None:  # flushed after the link had already failed
            return
        self._retire(op)
        if status == ev.IBV_WC_SUCCESS:
            if not op.future.done():
                op.future.set_result(None)
            return
        name = _wc_status_name(status)
        error = TransportError(f"{op.what} failed with {name}; the queue pair is in error")
        if not op.future.done():
            op.future.set_exception(
                RemoteAccessError(
                    f"the peer refused the {op.what} ({name}: rkey, bounds or access); "
                    "the queue pair is now in the error state"
                )
                if status == ev.IBV_WC_REM_ACCESS_ERR
                else error
            )
        self._fail(error)

    def _received(self, slot: int, status: int, byte_len: int) -> None:
        """A RECV completed: copy the capsule out, repost the buffer, then queue it."""
        if status != ev.IBV_WC_SUCCESS:
            self._fail(
                TransportError(
                    f"the queue pair is in the error state (a RECV completed with "
                    f"{_wc_status_name(status)}): an operation failed on this side, "
                    "or the peer made an access this side refused"
                )
            )
            return
        offset = slot * MAX_CAPSULE
        capsule = bytes(self._recv_ring.view[offset : offset + byte_len])
        try:
            self._qp.post_recv(self._recv_wrs[slot])
        except PyverbsError as exc:
            self._fail(TransportError(f"reposting a RECV failed: {exc}"))
            return
        self._inbox.put(capsule)

    def _fail(self, error: TransportError) -> None:
        """The link is gone: fail every pending operation, and every later one."""
        if not self._inbox.fail(error):
            return
        if not self._closed:
            log.warning("verbs data plane failed: %s", error)
        pending, self._pending = self._pending, {}
        for op in pending.values():
            self._retire(op)
            if not op.future.done():
                op.future.set_exception(error)

    # -- teardown

    async def close(self) -> None:
        """Fail what is pending, stop taking completions, destroy everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._fail(TransportError("transport closed"))
        if self._loop is not None and self._channel_fd >= 0:
            self._loop.remove_reader(self._channel_fd)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._release()

    def _release(self) -> None:
        """Destroy in dependency order: QP, MRs, CQ, channel, PD, context."""
        if self._qp is not None:
            self._qp.close()
        for region in self._regions:
            region.close()
        self._regions.clear()
        for wr in self._recv_wrs:
            wr.close()  # frees its SGE array; a second close would free it again
        self._recv_wrs.clear()
        for obj in (self._cq, self._channel, self._pd, self._ctx):
            if obj is not None:
                obj.close()  # pyverbs' close() is idempotent


def _open_channel(ctx: Any) -> tuple[Any, int]:  # noqa: ANN401 - pyverbs Context
    """A completion channel and its file descriptor, set non-blocking.

    pyverbs 44 does not expose the channel's fd (`CompChannel.fd` arrived in rdma-core
    57), so where it is missing the fd is the one new "[infinibandevent]" descriptor.
    """
    before = set(_event_fds())
    channel = CompChannel(ctx)
    fd = getattr(channel, "fd", None)
    if fd is None:
        new = [fd for fd in _event_fds() if fd not in before]
        if len(new) != 1:
            channel.close()
            raise TransportError(
                f"cannot tell the completion channel's fd ({len(new)} new event fds); "
                "use poll_mode='busy'"
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


# ---------------------------------------------------------------- the two sides


class _VerbsTransport:
    """What both sides share: construction and the capsule link."""

    def __init__(  # noqa: PLR0913 - the verbs knobs, all with defaults
        self,
        device: str | None = None,
        port: int | None = None,
        gid_index: int | None = None,
        queue_depth: int = 32,
        poll_mode: str = "event",
        *,
        send_depth: int | None = None,
        recv_depth: int | None = None,
    ) -> None:
        _require_pyverbs()
        default_depth = 2 * queue_depth + 8
        config = _Config(
            device=device,
            port=port,
            gid_index=gid_index,
            queue_depth=queue_depth,
            send_depth=default_depth if send_depth is None else send_depth,
            recv_depth=default_depth if recv_depth is None else recv_depth,
            poll_mode=poll_mode,
            qp_access=self._qp_access(),
        )
        self._qp = _QueuePair(config)

    @staticmethod
    def _qp_access() -> int:
        """What the peer may do through this side's QP."""
        return 0

    @property
    def address(self) -> VerbsAddress:
        """This side's QP as the peer needs it (gid, qp_num, psn, mtu, lid)."""
        return self._qp.address

    async def send(self, capsule: bytes) -> None:
        """Send a capsule (at most MAX_CAPSULE bytes); returns when the SEND completed."""
        await self._qp.send(capsule)

    async def recv(self) -> bytes:
        """The next capsule from the peer; TransportError once the link is gone."""
        return await self._qp.recv()

    async def close(self) -> None:
        """Fail pending operations, destroy the QP, regions and device resources. Idempotent."""
        await self._qp.close()


class VerbsHostTransport(_VerbsTransport, HostTransport):
    """Host side: registers regions the agent reads and writes; exchanges capsules.

    Args:
        device: RDMA device name; None: the first with a usable port (`find_port`).
        port: port number; None: the first ACTIVE one.
        gid_index: GID table index; None: the port's IPv4-mapped RoCEv2 GID.
        queue_depth: capsules in flight (send slots); sets the other depths' defaults.
        poll_mode: "event" (completion channel) or "busy" (poll from a task).
        send_depth: send-queue WRs in flight; default 2 * queue_depth + 8.
        recv_depth: RECV buffers posted; default 2 * queue_depth + 8.
    """

    @staticmethod
    def _qp_access() -> int:
        return int(ev.IBV_ACCESS_REMOTE_READ | ev.IBV_ACCESS_REMOTE_WRITE)

    async def connect(self, agent: PeerAddress | None) -> None:
        """Connect to the agent's QP (its address came back from OpenSession)."""
        self._qp.connect(agent)

    def register(self, length: int, access: Access) -> VerbsRegion:
        """Allocate `length` bytes and register them with only the access asked for."""
        return self._qp.register(length, access, _mr_flags(access))

    def deregister(self, region: Region) -> None:
        """Deregister and unmap a region: the agent's later accesses fail."""
        self._qp.deregister(region)


class VerbsAgentTransport(_VerbsTransport, AgentTransport):
    """Agent side: RDMA READs host regions into staging memory and WRITEs results back.

    Args:
        device: RDMA device name; None: the first with a usable port (`find_port`).
        port: port number; None: the first ACTIVE one.
        gid_index: GID table index; None: the port's IPv4-mapped RoCEv2 GID.
        queue_depth: capsules in flight (send slots); sets the other depths' defaults.
        poll_mode: "event" (completion channel) or "busy" (poll from a task).
        send_depth: send-queue WRs (SEND, READ, WRITE) in flight; default 2 * queue_depth + 8.
        recv_depth: RECV buffers posted; default 2 * queue_depth + 8.
    """

    async def connect(self, host: PeerAddress) -> None:
        """Connect to the host's QP whose address came in OpenSession."""
        self._qp.connect(host)

    def staging(self, length: int) -> VerbsRegion:
        """Local memory registered for LOCAL_WRITE only: READ target and WRITE source."""
        return self._qp.register(length, Access.NONE, int(ev.IBV_ACCESS_LOCAL_WRITE))

    def release(self, region: Region) -> None:
        """Deregister and unmap a staging region."""
        self._qp.deregister(region)

    async def read(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA READ `length` bytes at host (`addr`, `rkey`) into `local[offset:]`."""
        await self._qp.rdma(ev.IBV_WR_RDMA_READ, local, offset, length, (addr, rkey))

    async def write(self, local: Region, offset: int, length: int, addr: int, rkey: int) -> None:
        """RDMA WRITE `local[offset:offset+length]` to host (`addr`, `rkey`)."""
        await self._qp.rdma(ev.IBV_WR_RDMA_WRITE, local, offset, length, (addr, rkey))
