"""`rollart lag` reports exactly the offsets a test produced and committed."""

from __future__ import annotations

import json
import subprocess
import sys

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata, TopicPartition

from rollart.endpoints import kafka_client_kwargs
from rollart.lag import consumer_lag, group_topics
from rollart.messages.samples import sample_messages
from tests.conftest import BOTH_BROKERS, REPO

pytestmark = BOTH_BROKERS  # the broker contract


async def test_lag_matches_produced_and_committed_offsets(runtime, endpoints):
    config = runtime.config
    task = sample_messages()[0]
    for _ in range(10):  # every task on partition 0 of `tasks`
        await runtime.producer.send_and_wait("tasks", task, partition=0)
    for _ in range(3):
        await runtime.producer.send_and_wait("tasks", task, partition=1)
    physical = runtime.producer.names.physical("tasks")
    consumer = AIOKafkaConsumer(group_id=f"{config.job}.env", enable_auto_commit=False,
                                **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap))
    await consumer.start()
    try:
        consumer.assign([TopicPartition(physical, 0)])
        await consumer.commit({TopicPartition(physical, 0): OffsetAndMetadata(4, "")})
    finally:
        await consumer.stop()

    assert ("gen-default", "gen.requests.default") in {(g, t) for g, t, *_ in group_topics(config)}
    rows = {(r.group, r.topic, r.partition): r for r in await consumer_lag(config, endpoints)}
    assert (rows[("env", "tasks", 0)].committed, rows[("env", "tasks", 0)].end, rows[("env", "tasks", 0)].lag) == (4, 10, 6)
    assert (rows[("env", "tasks", 1)].committed, rows[("env", "tasks", 1)].lag) == (None, 3)
    assert rows[("trainer", "rewards.results", 0)].lag == 0

    out = subprocess.run([sys.executable, "-m", "rollart.cli", "lag", "--json", "--job", config.job],
                         cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "ROLLART_KAFKA_BOOTSTRAP": endpoints.kafka_bootstrap,
                              "ROLLART_REDIS_URL": endpoints.redis_url, "ROLLART_KAFKA_BROKER": endpoints.broker})
    assert out.returncode == 0, out.stderr[-2000:]
    cli = {(r["group"], r["topic"], r["partition"]): r["lag"] for r in json.loads(out.stdout)}
    assert cli[("env", "tasks", 0)] == 6 and cli[("env", "tasks", 1)] == 3
