"""Standard Kafka tools work against the local Apache Kafka: kcat (librdkafka, from Debian) lists the
job's topics and reads a CompletedTrajectory's headers and value; Kafka's own kafka-consumer-groups
describes the groups, and `rollart lag` agrees with it partition by partition."""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import replace
from pathlib import Path

from rollart.lag import consumer_lag
from rollart.local.brokers import KafkaNode, kafka_tool_argv
from rollart.messages import DEFAULT_CODEC, CompletedTrajectory, TaskSpec
from rollart.messages.samples import sample_messages, sample_trajectory
from rollart.topics import expand_catalog
from tests.conftest import KAFKA_ONLY, eventually

pytestmark = KAFKA_ONLY


def kcat(bootstrap: str, *args: str) -> bytes:
    done = subprocess.run(["kcat", "-b", bootstrap, *args], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout


async def test_kcat_lists_topics_and_reads_a_trajectory(runtime, endpoints):
    trajectory = sample_trajectory("g5-t2", n_prompt=12, n_gen=20)
    meta = await runtime.producer.send_and_wait("trajectories.completed", trajectory, key=trajectory.traj_id,
                                                policy_version=3)

    metadata = json.loads(kcat(endpoints.kafka_bootstrap, "-L", "-J"))
    listed = {t["topic"]: len(t["partitions"]) for t in metadata["topics"]}
    for topic in expand_catalog(runtime.config):
        assert listed.get(topic.name) == topic.partitions, f"kcat sees {topic.name} as the catalog has it"

    where = ["-C", "-t", meta.topic, "-p", str(meta.partition), "-o", str(meta.offset), "-c", "1", "-e"]
    headers = kcat(endpoints.kafka_bootstrap, *where, "-f", "%h").decode()
    value = kcat(endpoints.kafka_bootstrap, *where, "-f", "%s")
    parsed = [tuple(pair.split("=", 1)) for pair in headers.split(",")]
    as_bytes = [(k, v.encode()) for k, v in parsed]
    assert dict(parsed)["rollart-schema"].startswith("CompletedTrajectory/")
    assert dict(parsed)["rollart-policy-version"] == "3"
    decoded = DEFAULT_CODEC.decode(value, as_bytes, accept=(CompletedTrajectory,)).message
    assert decoded == trajectory, "what kcat read back is the trajectory the stage produced"


def describe_groups(bootstrap: str, group: str) -> dict[tuple[str, int], tuple[int | None, int, int | None]]:
    """Kafka's own view: (topic, partition) -> (current offset, log end offset, lag)."""
    done = subprocess.run(kafka_tool_argv("kafka-consumer-groups", "--bootstrap-server", bootstrap, "--describe",
                                          "--group", group), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if len(cells) >= 6 and cells[0] == group:
            rows[(cells[1], int(cells[2]))] = (_number(cells[3]), int(cells[4]), _number(cells[5]))
    return rows


async def test_rollart_lag_agrees_with_kafka_consumer_groups(runtime, endpoints):
    tasks = iter(replace(sample_messages()[0], group_id=f"g{i}") for i in range(100))
    for partition, count in ((0, 7), (1, 2), (2, 5)):
        for _ in range(count):
            await runtime.producer.send_and_wait("tasks", next(tasks), partition=partition)
    handled = []

    async def handle(envelope, ctx) -> None:
        handled.append(ctx.record.offset)

    loop = runtime.consumer_loop("env", ["tasks"], handle)
    running = asyncio.create_task(loop.run())
    await eventually(lambda: len(handled) == 14, what="the env group consumed every task")
    loop.stop()
    await running  # a graceful stop commits what was handled
    for _ in range(3):  # more after the group stopped: lag
        await runtime.producer.send_and_wait("tasks", next(tasks), partition=0)

    group = f"{runtime.config.job}.env"
    kafka_view = describe_groups(endpoints.kafka_bootstrap, group)
    ours = {(f"{runtime.config.job}.{r.topic}", r.partition): r for r in await consumer_lag(runtime.config, endpoints)
            if r.group == "env"}
    assert kafka_view, "kafka-consumer-groups describes the group"
    for key, (current, end, lag) in kafka_view.items():
        row = ours[key]
        assert (row.committed, row.end) == (current, end), key
        if lag is not None:  # Kafka prints "-" where the group never committed; rollart counts it all
            assert row.lag == lag, key
    assert kafka_view[(f"{runtime.config.job}.tasks", 0)] == (7, 10, 3)


async def test_producer_batches_are_idempotent_on_the_log(runtime, stack):
    """The broker's own log (Kafka's kafka-dump-log) shows each batch with the producer's id and a
    sequence number: the broker drops a retried batch it already holds instead of appending it twice."""
    sent = [await runtime.producer.send_and_wait("tasks", TaskSpec(group_id="g0", env="frozenlake", tag="frozenlake", group_size=1), key="one-key")
            for _ in range(3)]
    partition = sent[0].partition
    segment = next((KafkaNode(Path(stack.broker_dir)).data_dir / f"{sent[0].topic}-{partition}").glob("*.log"))
    dumped = subprocess.run(kafka_tool_argv("kafka-dump-log", "--files", str(segment)),
                            capture_output=True, text=True, timeout=120)
    assert dumped.returncode == 0, dumped.stderr
    batches = [line for line in dumped.stdout.splitlines() if line.startswith("baseOffset:")]
    assert len(batches) == 3, dumped.stdout
    producer_ids = {field(line, "producerId") for line in batches}
    assert len(producer_ids) == 1 and int(producer_ids.pop()) >= 0, "one idempotent producer id, not -1"
    assert [int(field(line, "baseSequence")) for line in batches] == [0, 1, 2]


def field(line: str, name: str) -> str:
    return line.split(f"{name}: ", 1)[1].split()[0]


def _number(cell: str) -> int | None:
    """A kafka-consumer-groups cell: "-" where the tool has no figure."""
    return None if cell == "-" else int(cell)


def test_the_local_broker_jvm_compiles_with_c1_alone_unless_told(stack, monkeypatch, tmp_path):
    """The running broker's JVM (read with the JDK's jcmd) has C2 off: on 2 cores C2's compiler threads
    were a third of the broker's CPU in a demo run. ROLLART_LOCAL_KAFKA_OPTS comes after the defaults,
    so the JVM takes its value of a flag (the last one wins)."""
    from rollart.local.brokers import KAFKA_OPTS_ENV

    flags = subprocess.run(["jcmd", str(stack.broker_pid), "VM.flags"], capture_output=True, text=True, timeout=60)
    assert flags.returncode == 0, flags.stderr
    assert "-XX:TieredStopAtLevel=1" in flags.stdout.split(), flags.stdout
    monkeypatch.setenv(KAFKA_OPTS_ENV, "-XX:TieredStopAtLevel=4 -Dx=y")
    argv = KafkaNode(tmp_path).argv()
    tiers = [a for a in argv if a.startswith("-XX:TieredStopAtLevel")]
    assert tiers[-1] == "-XX:TieredStopAtLevel=4" and "-Dx=y" in argv
    assert argv.index("-Dx=y") < argv.index("-cp"), "JVM options go before the class path and main class"
