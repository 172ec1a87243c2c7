"""Exactly-once on Apache Kafka: a hop's outputs and input offsets commit in one transaction.

A member killed -9 after handling (outputs sent into its open transaction, nothing committed) leaves
nothing visible to read_committed consumers; its successor under the same member name fences it,
redoes the inputs and commits: the output topic then holds each output exactly once, though the
handler ran twice for each input. Under at-least-once the same crash leaves two copies on the log.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import pytest

from rollart.bus.reader import read_to_end
from rollart.config import ConfigError, build_config
from rollart.messages import DEFAULT_CODEC, TaskSpec
from tests.bus.test_process_lifecycle import read_until, spawn_consumer
from tests.conftest import KAFKA_ONLY, make_config

N = 12
MEMBER = "member-0"


@pytest.fixture
def config(endpoints, request):
    return make_config(endpoints, bus={"processing_guarantee": request.param})


async def outputs(config, endpoints) -> Counter:
    copies = Counter()
    async for record in read_to_end(config, endpoints, f"{config.job}.trajectories.completed"):
        copies[DEFAULT_CODEC.decode(record.value, record.headers).message.group_id] += 1
    return copies


async def crash_then_recover(runtime, endpoints, monkeypatch) -> Counter:
    """N tasks; a member handles all of them and is killed before committing; a successor with the
    member's name finishes. Returns the copies of each output on trajectories.completed."""
    config = runtime.config
    for i in range(N):
        await runtime.producer.send_and_wait("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                             key=f"g{i}")
    monkeypatch.setenv("OUTPUT_TOPIC", "trajectories.completed")
    monkeypatch.setenv("ROLLART_MEMBER", MEMBER)
    monkeypatch.setenv("ROLLART_BUS_PROCESSING_GUARANTEE", config.bus.processing_guarantee)
    proc = await spawn_consumer(runtime, f"{config.job}:effect", commit_interval_s=3600, handler_delay_s=0)
    try:
        await read_until(proc, f"handled {N}")
        await asyncio.sleep(0.5)  # its sends reach the broker (in its open transaction, if any)
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()

    redone = []

    async def handle(envelope, ctx) -> None:  # the successor: the same output per input
        redone.append(envelope.message.group_id)
        await ctx.produce("trajectories.completed", envelope.message, key=envelope.message_id)

    loop = runtime.consumer_loop("env", ["tasks"], handle, transactional=True, dedup=False)
    running = asyncio.create_task(loop.run())
    try:
        for _ in range(600):
            if len(redone) >= N:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(config.bus.commit_interval_s * 3)  # a commit after the last one
    finally:
        loop.stop()
        await running
    assert sorted(redone) == sorted(f"g{i}" for i in range(N)), "the successor redid every uncommitted input"
    return await outputs(config, endpoints)


@KAFKA_ONLY
@pytest.mark.parametrize("config", ["exactly_once"], indirect=True)
async def test_a_killed_transactional_member_leaves_each_output_exactly_once(runtime, endpoints, monkeypatch):
    monkeypatch.setenv("ROLLART_MEMBER", MEMBER)  # the successor in this process shares the dead member's id
    copies = await crash_then_recover(runtime, endpoints, monkeypatch)
    assert copies == Counter({f"g{i}": 1 for i in range(N)}), "read_committed: once each, the killed copy aborted"


@KAFKA_ONLY
@pytest.mark.parametrize("config", ["at_least_once"], indirect=True)
async def test_the_same_crash_under_at_least_once_leaves_duplicates_on_the_log(runtime, endpoints, monkeypatch):
    copies = await crash_then_recover(runtime, endpoints, monkeypatch)
    assert set(copies) == {f"g{i}" for i in range(N)} and set(copies.values()) == {2}


def test_exactly_once_on_tansu_fails_at_start_up_naming_the_field():
    with pytest.raises(ConfigError, match="bus.processing_guarantee"):
        build_config({"kafka": {"broker": "tansu"}, "bus": {"processing_guarantee": "exactly_once"}})


@KAFKA_ONLY
@pytest.mark.parametrize("config", ["exactly_once"], indirect=True)
async def test_a_transactional_loop_keeps_no_redis_marks(runtime):
    """Regression (the first exactly-once chaos campaign lost 169 groups): marks flushed after a commit
    included inputs done in the next transaction; that one was aborted by a kill, and the successor
    skipped the redelivered inputs as seen. The transaction alone de-duplicates."""
    async def handle(envelope, ctx) -> None:
        pass

    assert runtime.consumer_loop("env", ["tasks"], handle, transactional=True).dedup is None
    assert runtime.consumer_loop("env-actions", ["env.actions"], handle).dedup is not None  # not a transactional hop
    from rollart.bus import ConsumerLoop

    with pytest.raises(ValueError, match="transactional loop"):
        ConsumerLoop(config=runtime.config, endpoints=runtime.endpoints, group="env", topics=["tasks"], handler=handle,
                     producer=runtime.producer, dedup=runtime.deduplicator("env"), transactional_id="t.env.m")
