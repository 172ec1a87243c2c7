"""``wait_for``: asyncio.wait_for as Python 3.12 builds it, on the Python 3.11 rollart runs on.

Python 3.11's ``asyncio.wait_for`` loses a cancellation that arrives as its inner awaitable finishes:
it returns the result and the caller never sees the ``CancelledError`` (CPython gh-86296; 3.12 rebuilt
it on ``asyncio.timeout``). A runner's SIGTERM is such a cancellation: one that met the topic admin's
start in ``rollart run`` trained the whole run instead of stopping it. ruff bans ``asyncio.wait_for``
here (pyproject.toml, banned-api) in favour of this one.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``aw``'s result, or TimeoutError after ``timeout`` seconds (None: no limit), ``aw`` then
    cancelled; a cancellation of the caller always propagates."""
    async with asyncio.timeout(timeout):
        return await aw
