"""The per-test time limit ends an asyncio test even while background tasks keep the loop busy."""

from __future__ import annotations

from tests.conftest import REPO

BUSY_TEST = """
import asyncio, time
import pytest

@pytest.mark.timeout(1)
async def test_stuck_while_a_background_task_spins():
    async def spin():  # a consumer's fetch loop: the loop runs Python code most of the time
        while True:
            started = time.monotonic()
            while time.monotonic() - started < 0.01:
                pass
            await asyncio.sleep(0)

    spinner = asyncio.create_task(spin())
    await asyncio.sleep(5)  # the line the failure must name
    spinner.cancel()
"""


def test_an_async_test_past_its_limit_fails_at_the_await_it_is_stuck_on(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_busy=BUSY_TEST)
    result = pytester.runpytest_subprocess("-p", "tests.async_timeout", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*await asyncio.sleep(5)*", "*TimeoutError*",
                                 "*test timed out after 1 s; tasks still pending:*", "*spin()*"])
    assert result.duration < 4, "ended at its limit, not when the test's sleep ran out"


def test_without_the_plugin_the_alarm_lands_in_the_background_task(pytester):
    """Why the plugin exists: pytest-timeout's signal alone lets this test pass after its full sleep."""
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_busy=BUSY_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
