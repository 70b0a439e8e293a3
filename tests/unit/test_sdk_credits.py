"""The SDK's queue credits: a count with first-come waiters, and no credit ever lost."""

from __future__ import annotations

import asyncio

import pytest

from host_client._credits import Credits

pytestmark = pytest.mark.asyncio


async def test_free_credits_are_taken_without_waiting():
    pool = Credits(2)
    assert pool.try_take()
    await pool.take()
    assert pool.free == 0
    assert not pool.try_take()
    pool.give()
    pool.give()
    assert pool.free == 2


async def test_waiters_are_served_in_arrival_order():
    pool = Credits(0)
    served: list[int] = []

    async def wait(i: int) -> None:
        await pool.take()
        served.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(5)]
    await asyncio.sleep(0)
    assert not pool.try_take()  # waiters come first, even for a free credit
    for _ in range(5):
        pool.give()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert served == [0, 1, 2, 3, 4]
    assert pool.free == 0


async def test_a_freed_credit_does_not_jump_the_queue():
    pool = Credits(0)
    waiter = asyncio.create_task(pool.take())
    await asyncio.sleep(0)
    pool.give()  # handed to the waiter, not to the free count
    assert pool.free == 0
    assert not pool.try_take()
    await waiter
    assert pool.free == 0


async def test_a_cancelled_waiter_loses_no_credit():
    pool = Credits(0)
    first = asyncio.create_task(pool.take())
    second = asyncio.create_task(pool.take())
    await asyncio.sleep(0)
    first.cancel()  # cancelled while waiting: leaves the line
    with pytest.raises(asyncio.CancelledError):
        await first
    pool.give()
    await second  # the credit went to the next in line
    pool.give()
    assert pool.free == 1


async def test_a_waiter_cancelled_after_being_handed_a_credit_passes_it_on():
    pool = Credits(0)
    first = asyncio.create_task(pool.take())
    second = asyncio.create_task(pool.take())
    await asyncio.sleep(0)
    pool.give()  # handed to `first`...
    first.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # got the credit `first` could not use
    assert pool.free == 0
    pool.give()
    assert pool.free == 1


async def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="negative"):
        Credits(-1)


async def test_a_credit_given_past_a_cancelled_waiter_still_in_line_is_not_lost():
    """Between its cancellation and its task running again, a waiter is still in line:
    a credit given meanwhile skips it, and the next taker gets it at once."""
    pool = Credits(0)
    first = asyncio.create_task(pool.take())
    await asyncio.sleep(0)
    first.cancel()  # its waiter is cancelled now; its task has not run yet
    pool.give()
    assert pool.free == 1
    assert pool.try_take()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert pool.free == 0
