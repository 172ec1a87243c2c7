"""Messages that finish out of order are not redone by the next owner of their partition.

Offset 0 is still in flight (a long rollout) while offsets 1-5 finish and commit: the committed offset
stays at 0, and the commit's metadata names 1-5 as done. The member stops (its drain gives up on
offset 0); its successor redoes offset 0 only. Regression: the exactly-once chaos campaign found a
group's completions twice on the log, committed once before a kill:env and again by the restarted
member, which resumed from the older offset of a group still running beside it.

Tansu keeps no commit metadata (it answers an OffsetFetch with ''): there the successor redoes 1-5
too, at-least-once as before (the Redis marks of a de-duplicating loop absorb it), which the Tansu
case asserts so that a Tansu that starts keeping metadata is noticed.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from rollart.messages import TaskSpec
from tests.bus.test_transactions import outputs
from tests.conftest import ALL_BROKERS, KAFKA_ONLY, make_config

N = 6


@pytest.fixture
def config(endpoints, request):
    return make_config(endpoints, bus={"processing_guarantee": request.param})


async def run_member(runtime, handle, until, *, settle_s: float) -> None:
    loop = runtime.consumer_loop("env", ["tasks"], handle, transactional=True, dedup=False, ordering="none",
                                 drain_timeout_s=0.2)
    running = asyncio.create_task(loop.run())
    try:
        for _ in range(600):
            if await until():
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("timed out")
        await asyncio.sleep(settle_s)  # a periodic commit after what was waited for
    finally:
        loop.stop()
        await running


@ALL_BROKERS
@pytest.mark.parametrize("config", ["at_least_once"], indirect=True)
async def test_a_successor_redoes_only_the_message_left_unfinished(runtime, endpoints):
    await successor_redoes_only_the_unfinished(runtime, endpoints)


@KAFKA_ONLY
@pytest.mark.parametrize("config", ["exactly_once"], indirect=True)
async def test_under_exactly_once_each_output_is_on_the_log_once(runtime, endpoints):
    await successor_redoes_only_the_unfinished(runtime, endpoints)


async def successor_redoes_only_the_unfinished(runtime, endpoints) -> None:
    config = runtime.config
    for i in range(N):  # one key: one partition, offsets 0..5
        await runtime.producer.send_and_wait("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                             key="one-partition")
    first, second = [], []

    def member(handled: list, hold_g0: bool):
        async def handle(envelope, ctx) -> None:
            handled.append(envelope.message.group_id)
            if hold_g0 and envelope.message.group_id == "g0":
                await asyncio.Event().wait()  # still rolling out when the member stops
            await ctx.produce("trajectories.completed", envelope.message, key=envelope.message.group_id)
        return handle

    async def five_visible() -> bool:
        return sum((await outputs(config, endpoints)).values()) >= N - 1

    await run_member(runtime, member(first, hold_g0=True), five_visible, settle_s=config.bus.commit_interval_s * 5)
    assert sorted(first) == [f"g{i}" for i in range(N)]

    async def g0_done() -> bool:
        return "g0" in second

    await run_member(runtime, member(second, hold_g0=False), g0_done, settle_s=config.bus.commit_interval_s * 5)
    if endpoints.broker == "tansu":  # no commit metadata: everything from the committed offset is redone
        assert sorted(second) == [f"g{i}" for i in range(N)]
        assert await outputs(config, endpoints) == Counter({"g0": 1, **{f"g{i}": 2 for i in range(1, N)}})
        return
    assert second == ["g0"], "the successor redid only the message its predecessor had not finished"
    assert await outputs(config, endpoints) == Counter({f"g{i}": 1 for i in range(N)})
