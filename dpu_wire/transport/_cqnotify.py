"""Completion events for an extended CQ, which pyverbs does not offer (44 to 64).

The receive side of a link polls an extended CQ (`CQEX`): taking a completion costs a
few calls, where the plain `CQ.poll` builds a Python WC object per completion (35 us
under TCG; the copy job measured 100 us faster in the test VM with the extended CQ).
But a side with nothing in flight must sleep on its completion channel, and arming
an extended CQ's event (`ibv_req_notify_cq`) and taking its events
(`ibv_get_cq_event`, `ibv_ack_cq_events`) are not in pyverbs for extended CQs. This
module does those three calls itself:

- `ibv_req_notify_cq` is an inline function of `<infiniband/verbs.h>`: a call through
  `cq->context->ops.req_notify_cq`, a slot of a table whose layout is the verbs ABI
  (applications compiled against any rdma-core call it the same way);
- `ibv_get_cq_event` and `ibv_ack_cq_events` are exported by libibverbs.

The C pointers come from the pyverbs objects (the CQ's `struct ibv_cq *`, the channel's
`struct ibv_comp_channel *`). pyverbs keeps them in fields Python cannot read, so they
are located in the objects' memory, next to the one field whose value is known (the
`Context` object both were made from), and then checked against each other in C: the
CQ's channel must be this channel, both must share the device context, and the
channel's descriptor must be the one the link polls. Anything that does not add up
raises `NotifyUnavailable`, and the link falls back to a plain CQ, which pyverbs arms
itself. Nothing here is called on the fast path: only when a link goes to sleep.
"""

from __future__ import annotations

import ctypes
import errno
import sys
from typing import Any, Final

_PTR: Final = ctypes.sizeof(ctypes.c_void_p)
_SEARCH: Final = 16  # pointer-sized fields of a pyverbs object searched
_REQ_NOTIFY_SLOT: Final = 12  # ibv_context_ops: poll_cq is slot 11, req_notify_cq 12
_LOWEST_HEAP: Final = 1 << 16  # below this no mapping can hold a QP (vm.mmap_min_addr)
_OPS_OFFSET: Final = _PTR  # struct ibv_context { struct ibv_device *device; ops; ... }


class NotifyUnavailable(Exception):
    """The pointers could not be found or did not check out: use a plain CQ."""


def _read_ptr(address: int) -> int:
    return int(ctypes.c_void_p.from_address(address).value or 0)


def _field_after_context(obj: object, context: object) -> tuple[int, int]:
    """(offset of the field that holds `context`, the object's address) in a pyverbs object."""
    return _fields_holding(obj, context)


def _fields_holding(obj: object, *values: object) -> tuple[int, int]:
    """(offset of consecutive fields holding `values`, the object's address).

    Searched within the object's own memory (its type's basic size), after its header.
    """
    base = id(obj)
    want = [id(value) for value in values]
    words = min(_SEARCH, type(obj).__basicsize__ // _PTR) - len(want) + 1
    for index in range(2, words):
        if all(_read_ptr(base + (index + k) * _PTR) == w for k, w in enumerate(want)):
            return index * _PTR, base
    raise NotifyUnavailable(f"no field found for the objects in {type(obj).__name__}")


def cq_pointer(cq: Any, context: Any) -> int:  # noqa: ANN401 - pyverbs objects
    """The `struct ibv_cq_ex *` of a pyverbs CQEX made from `context` (an ibv_cq too)."""
    if sys.byteorder != "little" or _PTR != 8:
        raise NotifyUnavailable("only 64-bit little-endian layouts are known")
    # CQEX: ... struct ibv_cq_ex *cq; struct ibv_cq *ibv_cq; object context ...
    offset, base = _field_after_context(cq, context)
    cq_ex, ibv_cq = _read_ptr(base + offset - 2 * _PTR), _read_ptr(base + offset - _PTR)
    if not ibv_cq or cq_ex != ibv_cq:  # ibv_cq_ex_to_cq() is a cast: the two are equal
        raise NotifyUnavailable("the extended CQ's pointers do not look right")
    return ibv_cq


def qp_pointer(qp: Any, pd: Any, context: Any) -> int:  # noqa: ANN401 - pyverbs objects
    """The `struct ibv_qp *` of a pyverbs QP made in `pd` (unchecked: see `_vcore.Qp`)."""
    if sys.byteorder != "little" or _PTR != 8:
        raise NotifyUnavailable("only 64-bit little-endian layouts are known")
    # QP: ... struct ibv_qp *qp; int type; int state; object pd; object context ...
    # (`context` stays None for a QP made in a PD: the PD alone marks the place)
    del context
    offset, base = _fields_holding(qp, pd)
    pointer = _read_ptr(base + offset - 2 * _PTR)
    if pointer < _LOWEST_HEAP or pointer % _PTR:
        raise NotifyUnavailable("the QP's pointer does not look like one")
    return pointer


def _libibverbs() -> ctypes.CDLL:
    for name in ("libibverbs.so.1", "libibverbs.so"):
        try:
            return ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
    raise NotifyUnavailable("libibverbs is not loadable")


class CqNotifier:
    """Arm and take the completion events of one extended CQ bound to one channel."""

    def __init__(self, cq: Any, channel: Any, context: Any, channel_fd: int) -> None:  # noqa: ANN401 - pyverbs objects
        ibv_cq = cq_pointer(cq, context)
        # CompChannel: ... struct ibv_comp_channel *cc; object context ...
        offset, base = _field_after_context(channel, context)
        cc = _read_ptr(base + offset - _PTR)
        if not cc:
            raise NotifyUnavailable("the completion channel's pointer is missing")
        # struct ibv_cq { ibv_context *context; ibv_comp_channel *channel; ... }
        # struct ibv_comp_channel { ibv_context *context; int fd; int refcnt; }
        ctx = _read_ptr(ibv_cq)
        if _read_ptr(ibv_cq + _PTR) != cc or _read_ptr(cc) != ctx or not ctx:
            raise NotifyUnavailable("the CQ is not bound to this channel")
        if ctypes.c_int.from_address(cc + _PTR).value != channel_fd:
            raise NotifyUnavailable("the channel's descriptor is not the one polled")
        lib = _libibverbs()
        self._get_event = lib.ibv_get_cq_event
        self._get_event.argtypes = (
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p),
        )
        self._get_event.restype = ctypes.c_int
        self._ack = lib.ibv_ack_cq_events
        self._ack.argtypes = (ctypes.c_void_p, ctypes.c_uint)
        self._ack.restype = None
        slot = _read_ptr(ctx + _OPS_OFFSET + _REQ_NOTIFY_SLOT * _PTR)
        if not slot:
            raise NotifyUnavailable("the provider has no req_notify_cq")
        self._req_notify = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)(slot)
        self._cq = ibv_cq
        self._channel = cc
        self._event_cq = ctypes.c_void_p()
        self._event_ctx = ctypes.c_void_p()
        self._unacked = 0

    def arm(self) -> None:
        """Ask for an event on the next completion (ibv_req_notify_cq)."""
        rc = self._req_notify(self._cq, 0)
        if rc:
            raise OSError(rc, f"ibv_req_notify_cq failed: {errno.errorcode.get(rc, rc)}")

    def take_events(self) -> int:
        """Consume the events the (non-blocking) channel holds; acknowledge them."""
        taken = 0
        while self._get_event(self._channel, self._event_cq, self._event_ctx) == 0:
            if self._event_cq.value != self._cq:
                raise OSError(errno.EINVAL, "an event for another CQ on this channel")
            taken += 1
        if taken:
            self._ack(self._cq, taken)
        return taken
