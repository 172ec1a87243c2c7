"""The faults ``rollart chaos`` injects into a running job, one function each.

Process faults act on the stage processes ``rollart run`` supervises (``OUT/pids.json``): SIGKILL, then
the runner restarts the stage (the trainer with ``--resume``). State faults delete the job's Redis
keys. Input faults produce records no stage can decode (garbage, unknown kinds, oversized values)
into every topic a consumer group reads; each must end in that topic's DLQ.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaProducer

from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.messages.codec import H_ID, H_SCHEMA
from rollart.stages.registry import STAGES, stage_of_process
from rollart.topics import expand_catalog
from rollart.names import RedisKeys
from rollart.names import REWARDS_JUDGE

# The stages every training job runs, each apart (a job with env.colocate_pool runs envgen in place of two)
KILLABLE = tuple(s.name for s in STAGES.values() if s.requires is None and not s.hosts)
KILL_TARGETS = tuple(s.name for s in STAGES.values() if s.requires is None)  # what kill:<stage> may name

BROKER = "broker"  # kill:broker: SIGKILL the campaign's own Apache Kafka, then start it on the same log
BROKER_DOWN_S = 3.0  # how long the broker stays dead: clients see refused connections, not a blip


def killable(config) -> tuple[str, ...]:
    """The stages of KILL_TARGETS this job runs: what a kill that names none picks from."""
    return tuple(name for name in KILL_TARGETS if STAGES[name].pools(config))


@dataclass(frozen=True)
class Injected:
    """A record produced on purpose that must reach its topic's DLQ."""

    topic: str  # physical
    partition: int
    offset: int
    what: str


def stage_pids(out: Path) -> dict[str, int]:
    try:
        return json.loads((out / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def stage_of(name: str) -> str:
    """``gen-default-0`` → generation, ``env-0`` → env, ``reward-0`` → reward."""
    return stage_of_process(name)


def kill_stage(out: Path, stage: str) -> str | None:
    """SIGKILL one process of ``stage``; returns its name (None if none runs)."""
    for name, pid in sorted(stage_pids(out).items()):
        if stage_of(name) == stage:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return name
    return None


async def kill_broker(stack_file: Path, down_s: float = BROKER_DOWN_S) -> str:
    """SIGKILL the local Apache Kafka recorded in ``stack_file``, wait, restart it on the same port
    and log (what a crashed broker pod does); returns what happened."""
    import asyncio

    from rollart.local.stack import StackState, restart_broker

    state = StackState.read(stack_file)
    if state is None or state.broker_kind != "kafka":
        raise RuntimeError("kill:broker needs the campaign's own local Apache Kafka (configure no broker "
                           "endpoints; --broker kafka)")
    old = state.broker_pid
    os.kill(old, signal.SIGKILL)
    await asyncio.sleep(down_s)
    new = await asyncio.to_thread(restart_broker, state)
    state.write(stack_file)
    return f"kafka pid {old} -> {new}"


def flush_redis(redis_url: str, config: RollartConfig, job: str) -> int:
    """Delete every Redis key of the job (what a Redis restart without persistence does)."""
    import redis as redis_sync

    client = redis_sync.Redis.from_url(redis_url)
    try:
        return sum(client.delete(key) for key in client.scan_iter(match=RedisKeys(config.redis.key_prefix, job).job_pattern))
    finally:
        client.close()


def bad_records(max_value_bytes: int) -> list[tuple[str, bytes, list[tuple[str, bytes]]]]:
    """(what, value, headers) of records that must be dead-lettered."""
    return [
        ("garbage value", b"\x93not msgpack at all", [(H_SCHEMA, b"TaskSpec/1.0"), (H_ID, b"chaos-garbage")]),
        ("unknown kind", b"\x80", [(H_SCHEMA, b"NoSuchKind/1.0"), (H_ID, b"chaos-kind")]),
        ("no schema header", b"\x80", []),
        ("oversized value", b"\x00" * (max_value_bytes + 1), [(H_SCHEMA, b"TaskSpec/1.0"), (H_ID, b"chaos-big")]),
    ]


def consumed_topics(config: RollartConfig) -> list[str]:
    """Physical topics a running consumer group reads (their DLQs are where bad records must go);
    ``rewards.judge`` has a consumer only when some tag is scored by an LLM judge."""
    judged = any(spec.reward.type == "judge" for spec in config.tags.values())
    return [t.name for t in expand_catalog(config) if not t.is_dlq and t.spec is not None and t.spec.consumers
            and (t.logical != REWARDS_JUDGE or judged)]


async def inject_bad_messages(config: RollartConfig, endpoints: Endpoints) -> list[Injected]:
    producer = AIOKafkaProducer(max_request_size=config.bus.max_value_bytes + (1 << 20),
                                **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap))
    await producer.start()
    injected = []
    try:
        for topic in consumed_topics(config):
            for what, value, headers in bad_records(config.bus.max_value_bytes):
                meta = await producer.send_and_wait(topic, value, key=b"chaos", headers=headers)
                injected.append(Injected(topic, meta.partition, meta.offset, what))
    finally:
        await producer.stop()
    return injected
