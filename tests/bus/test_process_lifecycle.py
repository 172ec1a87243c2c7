"""A member killed -9 before committing: its messages are redelivered, dedup keeps effects single."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections import Counter
from pathlib import Path

from rollart.messages import TaskSpec
from rollart.metrics import MESSAGES_DEDUPLICATED
from rollart.timeouts import wait_for
from tests.conftest import BOTH_BROKERS, REPO, eventually

pytestmark = BOTH_BROKERS  # the broker contract

N = 30


async def spawn_consumer(runtime, effect_key: str, *, commit_interval_s: float, handler_delay_s: float,
                         startup_s: float = 0.0):
    return await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).with_name("consumer_process.py")), runtime.endpoints.kafka_bootstrap,
        runtime.endpoints.redis_url, runtime.config.job, "env", "tasks", effect_key, str(commit_interval_s),
        str(handler_delay_s), str(startup_s), stdout=asyncio.subprocess.PIPE, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "ROLLART_KAFKA_BROKER": runtime.endpoints.broker})


async def read_until(proc, text: str, timeout: float = 60.0) -> list[str]:
    lines = []
    while True:
        line = (await wait_for(proc.stdout.readline(), timeout)).decode()
        assert line, f"the consumer process exited before printing {text!r}: {lines[-5:]}"
        lines.append(line.strip())
        if line.strip() == text:
            return lines


async def test_killed_consumer_redelivers_and_dedup_keeps_effect_single(runtime, loops, redis):
    config = runtime.config
    effect_key = f"{config.job}:effect"
    acks = [await runtime.producer.send("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                        key=f"g{i}") for i in range(N)]
    await asyncio.gather(*acks)

    proc = await spawn_consumer(runtime, effect_key, commit_interval_s=3600, handler_delay_s=0)
    try:
        await read_until(proc, f"handled {N}")
        await eventually(lambda: redis.llen(effect_key), what="effects recorded")
        await asyncio.sleep(0.2)  # let its background dedup marks land, as they would in ~1 ms
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()

    committed = await _committed(runtime, config)
    assert committed == 0, "the killed consumer must not have committed anything"

    before = MESSAGES_DEDUPLICATED.labels(config.job, "env", "tasks")._value.get()
    effects_seen = []

    async def handle(envelope, ctx) -> None:
        effects_seen.append(envelope.message_id)
        await redis.rpush(effect_key, envelope.message_id)

    survivor = await loops.start(runtime.consumer_loop("env", ["tasks"], handle))
    await eventually(lambda: MESSAGES_DEDUPLICATED.labels(config.job, "env", "tasks")._value.get() - before >= N,
                     what="all N redelivered messages recognised as duplicates")
    await loops.stop(survivor)
    assert effects_seen == [], "a redelivered message ran its handler again"
    effects = Counter(m.decode() for m in await redis.lrange(effect_key, 0, -1))
    assert len(effects) == N and set(effects.values()) == {1}
    assert await _committed(runtime, config) == N, "the survivor commits past the redelivered messages"


async def test_sigterm_finishes_in_flight_work_commits_and_exits(runtime, redis):
    config = runtime.config
    effect_key = f"{config.job}:effect"
    for i in range(3):
        await runtime.producer.send_and_wait("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                             key="one-partition")
    proc = await spawn_consumer(runtime, effect_key, commit_interval_s=3600, handler_delay_s=1.0)
    await read_until(proc, "started task:g0")
    proc.send_signal(signal.SIGTERM)  # mid-handler: it must finish g0, commit it, and exit
    rest = (await wait_for(proc.stdout.read(), 60)).decode().split("\n")
    assert await proc.wait() == 0
    assert "exited cleanly" in rest
    effects = [m.decode() for m in await redis.lrange(effect_key, 0, -1)]
    assert effects[0] == "task:g0", "the in-flight handler completed"
    assert await _committed(runtime, config) == len(effects), "exactly what was handled is committed"


async def test_sigterm_during_start_up_exits_cleanly_without_joining(runtime, redis):
    """A stage SIGTERMed while it still loads (an engine's blocking construction, then its warm-up)
    exits 0 at once: no default-action death (-15), no waiting for the blocking step to end, no
    group join, nothing handled or committed."""
    config = runtime.config
    effect_key = f"{config.job}:effect"
    await runtime.producer.send_and_wait("tasks", TaskSpec(group_id="g0", env="e", tag="t", group_size=1), key="g0")
    # The signal lands in the blocking part (0-3 s), then in the async one (3-6 s).
    for delay_s, in_blocking_part in ((1.0, True), (4.0, False)):
        proc = await spawn_consumer(runtime, effect_key, commit_interval_s=0.1, handler_delay_s=0, startup_s=3.0)
        await read_until(proc, "starting")
        await asyncio.sleep(delay_s)
        proc.send_signal(signal.SIGTERM)
        rest = (await wait_for(proc.stdout.read(), 60)).decode().split("\n")
        assert await proc.wait() == 0, rest
        assert "stopped during start-up" in rest and not any(line.startswith("handled") for line in rest)
        assert ("constructed" not in rest) == in_blocking_part, f"the blocking step was interrupted: {rest}"
    assert await redis.llen(effect_key) == 0
    assert await _committed(runtime, config) == 0


async def _committed(runtime, config) -> int:
    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=runtime.endpoints.kafka_bootstrap, group_id=f"{config.job}.env",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        total = 0
        for p in range(8):
            total += await consumer.committed(TopicPartition(f"{config.job}.tasks", p)) or 0
        return total
    finally:
        await consumer.stop()
