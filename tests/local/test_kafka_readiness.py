"""A local Apache Kafka is up only once it coordinates any group and any transactional id.

A fresh KRaft broker creates its coordinator topics (__consumer_offsets, __transaction_state) at the
first FindCoordinator and answers COORDINATOR_NOT_AVAILABLE while they load: every consumer of a run
on a fresh stack logged "GroupCoordinatorNotAvailableError" at its start (ten lines in one benchmark)
and retried. The stack's readiness probe asks for a coordinator on every partition of both topics.
"""

from __future__ import annotations

import asyncio
import uuid

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import CoordinationType

from rollart.local.brokers import COORDINATOR_PARTITIONS, coordinator_probes, java_string_hash
from rollart.local.stack import start_kafka, stop_pid


def test_the_hash_is_javas_string_hash_code():
    assert java_string_hash("") == 0
    assert java_string_hash("hello") == 99162322
    assert java_string_hash("polygenelubricants") == -2**31  # abs() of it is still negative in Java: Kafka masks
    assert java_string_hash("\U0001F600") == 31 * 0xD83D + 0xDE00  # a surrogate pair: two UTF-16 units, as Java


def test_the_probes_name_one_key_per_partition():
    for partitions in (1, COORDINATOR_PARTITIONS, 50):
        probes = coordinator_probes(partitions)
        assert [(java_string_hash(key) & 0x7FFFFFFF) % partitions for key in probes] == list(range(partitions))


async def _first_answers(bootstrap: str, keys: list[str]) -> dict[tuple[str, str], str]:
    """The first FindCoordinator answer for each key and kind: "" where it named a coordinator."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    answers = {}
    try:
        for kind in CoordinationType:
            for key in keys:
                try:
                    await admin.find_coordinator(key, kind)
                    answers[(kind.name, key)] = ""
                except Exception as exc:  # noqa: BLE001 - the answer is the finding
                    answers[(kind.name, key)] = type(exc).__name__
    finally:
        await admin.close()
    return answers


def test_a_fresh_broker_coordinates_any_group_once_it_is_up(tmp_path):
    proc, bootstrap, _ = start_kafka(tmp_path / "kafka", tmp_path)
    try:
        answers = asyncio.run(_first_answers(bootstrap, [f"g-{uuid.uuid4().hex}" for _ in range(24)]))
    finally:
        stop_pid(proc.pid)
    assert {key: error for key, error in answers.items() if error} == {}, "a coordinator at the first ask"
