"""A per-test time limit that holds for asyncio tests (a pytest plugin, loaded by tests/conftest.py).

pytest-timeout's default (signal) method raises in whatever Python code the main thread runs when the
alarm fires. In an asyncio test that is mostly some task's step (a consumer's fetch loop, a heartbeat),
and asyncio's Task catches the exception as that task's own result: the background task dies, the test
goes on and passes however long it takes (seen in CI: 765 s under the 300 s limit). So:

* a coroutine test's body runs under ``asyncio.timeout`` of its limit (the ``timeout`` marker, else
  pytest-timeout's setting): the test's own task is cancelled at the await it is stuck on, the failure
  names that line, and the stacks of the tasks still pending are printed with it;
* pytest-timeout stays the backstop for what runs outside the body (async fixtures, teardown), for
  these items with its thread method (dump every thread's stack and end the session) at
  ``BACKSTOP_FACTOR`` times the limit, so that it never fires first and never lands in a stray task.
"""

from __future__ import annotations

import asyncio
import functools
import io
import sys

import pytest
import pytest_timeout
from pytest_asyncio.plugin import PytestAsyncioFunction

BACKSTOP_FACTOR = 2.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, PytestAsyncioFunction):
            limit = pytest_timeout._get_item_settings(item).timeout
            if limit:
                item.obj = bounded(item.obj, limit)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    if not isinstance(item, PytestAsyncioFunction):
        return None
    backstop = settings._replace(method="thread", timeout=settings.timeout * BACKSTOP_FACTOR)
    return pytest_timeout.pytest_timeout_set_timer(item, backstop)


def bounded(test, limit_s: float):
    """``test`` (a coroutine function) failing with TimeoutError after ``limit_s``."""

    @functools.wraps(test)
    async def run(*args, **kwargs):
        try:
            async with asyncio.timeout(limit_s):
                return await test(*args, **kwargs)
        except TimeoutError:
            sys.stderr.write(f"test timed out after {limit_s:g} s; tasks still pending:\n{pending_stacks()}")
            raise

    return run


def pending_stacks() -> str:
    out = io.StringIO()
    current = asyncio.current_task()
    for task in asyncio.all_tasks():
        if task is not current:
            task.print_stack(limit=8, file=out)
    return out.getvalue()
