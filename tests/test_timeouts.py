"""rollart.timeouts.wait_for: a timeout that never swallows its caller's cancellation.

The case that matters: the caller is cancelled (a runner's SIGTERM) just as the awaited work ends.
Python 3.11's asyncio.wait_for then returns the work's result and the cancellation is gone; the
first test fails with it (shown by the last test, which documents why the ban in pyproject exists).
"""

from __future__ import annotations

import asyncio

import pytest

from rollart.timeouts import wait_for


async def _cancelled_as_the_work_ends(waiter) -> str:
    async def work() -> int:
        return 1

    caller = asyncio.current_task()
    assert caller is not None
    future = asyncio.ensure_future(work())
    future.add_done_callback(lambda _: caller.cancel())  # the signal lands between the work's end and the caller's wake-up
    try:
        await waiter(future, 10)
        await asyncio.sleep(0.1)  # a cancellation merely deferred would land here
    except asyncio.CancelledError:
        return "cancelled"
    return "swallowed"


async def test_a_cancellation_that_meets_the_works_end_reaches_the_caller():
    assert await asyncio.create_task(_cancelled_as_the_work_ends(wait_for)) == "cancelled"


async def test_the_work_is_cancelled_at_the_timeout_and_its_result_returned_before():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def hangs() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        await wait_for(hangs(), 0.05)
    assert started.is_set() and cancelled.is_set()
    assert await wait_for(asyncio.sleep(0, result="done"), 5) == "done"
    assert await wait_for(asyncio.sleep(0, result="no limit"), None) == "no limit"


async def test_python_311s_wait_for_swallows_it():
    """pyproject pins Python 3.11; on 3.12 this fails, and the ban and rollart.timeouts can go."""
    assert await asyncio.create_task(_cancelled_as_the_work_ends(asyncio.wait_for)) == "swallowed"  # noqa: TID251
