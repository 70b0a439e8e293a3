"""The verbs transport's native core: posts and polls in C, when it is built.

`_vcore.c` (built by the package's own build, `setup.py`) does the calls a job makes on
its queue pair: ibv_post_send of one work request or of a WRITE chained to a SEND (a
SEND's capsule copied into its slot in the same call), ibv_post_recv of a RECV ring
slot, one completion at a time from an extended CQ; waits that spin on the CQs with the
GIL released (a host for its only job's completion, an idle agent reactor for its one
link's next completion); and the agent's fast path, which runs inline COPY jobs to their
end and COPY jobs of up to 64 KiB from their READ to their COMPLETION (`Qp.serve`,
`Qp.poll_send`, `AgentLink.fast_regions`). pyverbs stays the resource
layer: it makes every object, and this module only finds their C pointers (as
`_cqnotify` does for the completion channel) and hands them to `_vcore.Qp`, which checks
that the QP and the CQs belong together before anything is posted through them.

Why: under TCG each pyverbs attribute write, post and three-call completion costs
microseconds of interpreter work per operation, on both sides of every job
(docs/performance.md, "Native code: the decision"). Semantics do not change: the same
work requests with the same ids, the same completions in the same order.

The core is optional. Without it (no C compiler or `libibverbs-dev` at install time, an
unknown pyverbs layout, `DPU_NATIVE=0` in the environment) the link runs the pure-Python
path it always had; `status()` says which and why, and the agent logs it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Final

from dpu_wire.transport._cqnotify import NotifyUnavailable, cq_pointer, qp_pointer

if TYPE_CHECKING:
    from types import ModuleType

ENV: Final = "DPU_NATIVE"  # "0": use the pure-Python path even where the core is built
ABI: Final = 2  # _vcore's calls as this code makes them (_vcore.ABI; an older build is not used)


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(ENV, "1") == "0":
        return None, f"turned off ({ENV}=0)"
    try:
        from dpu_wire.transport import _vcore  # noqa: PLC0415 - optional, compiled
    except ImportError as exc:
        return None, f"not built ({exc})"
    if getattr(_vcore, "ABI", 0) != ABI:
        return None, f"a stale build (ABI {getattr(_vcore, 'ABI', 0)}, not {ABI}): make venv"
    return _vcore, "built"


_CORE, _WHY = _load()


def status() -> tuple[bool, str]:
    """(whether links use the native core, why not or "built")."""
    return _CORE is not None, _WHY


def attach(  # noqa: PLR0913, PLR0917 - the QP's parts
    qp: Any,  # noqa: ANN401 - pyverbs objects, here and below
    pd: Any,  # noqa: ANN401
    context: Any,  # noqa: ANN401
    send_cq: Any,  # noqa: ANN401
    recv_cq: Any,  # noqa: ANN401
    recv_ring: tuple[int, int, int, int],
) -> Any | None:  # noqa: ANN401 - a _vcore.Qp
    """A `_vcore.Qp` for these pyverbs objects, or None (use pyverbs).

    `recv_ring` is (address, slot bytes, slots, lkey) of the RECV ring.
    """
    if _CORE is None:
        return None
    try:
        qp_ptr = qp_pointer(qp, pd, context)
        send_ptr = cq_pointer(send_cq, context)
        recv_ptr = cq_pointer(recv_cq, context)
        return _CORE.Qp(qp_ptr, int(qp.qp_num), send_ptr, recv_ptr, *recv_ring)
    except (NotifyUnavailable, ValueError):
        return None
