"""Staging buffers: who waits for them, who stops waiting, and handing them on.

A job that needs a large buffer while all are in use waits in its pool's queue. If it
ends first (CANCEL, deadline) it leaves the queue at once (`forget`): else a host that
keeps the large buffers busy (READs it does not answer, until op_timeout) and sends
SUBMIT + CANCEL pairs would pile ended jobs up in the queue. And `give_back` hands
buffers on in one loop: a job served there may end at once and give its own back,
which must not become one nested call per waiting job.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, cast

from dpu_agent.dataplane.staging import Buffer, Staging

if TYPE_CHECKING:
    from collections.abc import Callable

    from dpu_wire.transport.base import AgentLink

CHUNK = 1 << 20


def staging(large: int = 1) -> Staging:
    link = types.SimpleNamespace(
        staging=lambda length: types.SimpleNamespace(view=memoryview(bytearray(length))),
        release=lambda _region: None,
    )
    return Staging(cast("AgentLink", link), queue_depth=4, chunk_size=CHUNK, large=large)


def test_a_waiter_that_is_forgotten_is_never_served():
    pool = staging()
    held: list[Buffer] = []
    assert pool.take(CHUNK, 1, held.extend) is None  # the one large buffer, at once
    served: list[str] = []

    def job(name: str) -> Callable[[list[Buffer]], None]:
        def ready(got: list[Buffer]) -> None:
            served.append(name)
            pool.give_back(got)  # it ends at once

        return ready

    first = pool.take(CHUNK, 1, job("first"))
    second = pool.take(CHUNK, 1, job("second"))
    third = pool.take(CHUNK, 1, job("third"))
    assert None not in (first, second, third)
    assert second is not None
    pool.forget(second)
    pool.give_back(held)
    assert served == ["first", "third"]


def test_many_waiters_that_end_at_once_are_served_in_one_loop():
    pool = staging()
    held: list[Buffer] = []
    pool.take(CHUNK, 1, held.extend)
    served: list[int] = []

    def job(index: int) -> Callable[[list[Buffer]], None]:
        def ready(got: list[Buffer]) -> None:
            served.append(index)
            pool.give_back(got)  # it ends at once

        return ready

    for index in range(5000):  # far deeper than the interpreter's stack
        pool.take(CHUNK, 1, job(index))
    pool.give_back(held)
    assert served == list(range(5000))
