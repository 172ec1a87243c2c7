"""Security on a real Apache Kafka: SASL/SCRAM-SHA-512 over TLS the broker terminates itself, and one
ACL'd principal per stage, derived from the topic catalog.

The broker here is its own (module scope): SASL_SSL only, a throwaway CA, ACLs enforced with nothing
allowed that no ACL allows. Each stage's user may do exactly what rollart.topics.access lists.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError
from aiokafka.structs import TopicPartition

from rollart.bus import NotAuthorized
from rollart.config import KafkaConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.local.security import LocalSecurity
from rollart.local.stack import serves_metadata_to, start_kafka, stop_pid
from rollart.messages import CompletedTrajectory, TaskSpec
from rollart.messages.samples import sample_trajectory
from rollart.runtime import open_runtime
from rollart.topics import expand_catalog
from rollart.topics.access import job_access, stage_access
from rollart.topics.admin import apply_topics
from rollart.timeouts import wait_for
from tests.conftest import make_config


PASSWORDS: dict[str, str] = {}  # principal -> password, of every job secured here


def password(principal: str) -> str:
    return PASSWORDS[principal]


@pytest.fixture(scope="module")
def secure_kafka(tmp_path_factory, endpoints):
    """(security, bootstrap, new_job): a SASL_SSL broker with ACLs; ``new_job()`` gives a fresh job's
    config (as admin) with its topics, a SCRAM user per stage and the stages' ACLs."""
    folder = tmp_path_factory.mktemp("secure-kafka")
    security = LocalSecurity.create(folder / "security")
    proc, bootstrap, _ = start_kafka(folder / "kafka", folder, security.broker_tls(), serves_metadata_to(security),
                                     security.broker_sasl())
    try:
        yield security, bootstrap, lambda: secured_job(security, bootstrap, endpoints)
    finally:
        stop_pid(proc.pid, timeout=30)


async def secured_job(security: LocalSecurity, bootstrap: str, endpoints: Endpoints):
    """A new job's config (as admin) whose topics, stage users and ACLs exist on the secure broker."""
    config = make_config(endpoints, kafka={"bootstrap": bootstrap, "broker": "kafka", **security.kafka_config()})
    secure = Endpoints(bootstrap, endpoints.redis_url, "secure test", broker="kafka")
    await apply_topics(config, secure, expand_catalog(config))
    logins = await asyncio.to_thread(security.secure_job, config, bootstrap)
    PASSWORDS.update(logins.values())
    return config


def as_user(config, security: LocalSecurity, principal: str):
    kafka = {**config.kafka.model_dump(), **security.kafka_config(principal, password(principal)),
             "request_timeout_ms": 5000}
    return config.model_copy(update={"kafka": KafkaConfig(**kafka)})


def test_stage_access_follows_the_catalog():
    config = make_config(Endpoints("unused:9092", "redis://unused", "unit"), pools=["h20", "h800"])
    job = config.job
    env = stage_access(config, "env")
    assert env.groups == (f"{job}.env", f"{job}.env-actions")
    assert set(env.read) == {f"{job}.tasks", f"{job}.env.actions", f"{job}.policy.versions"}
    assert {f"{job}.gen.requests.h20", f"{job}.gen.requests.h800", f"{job}.trajectories.completed",
            f"{job}.tasks.dlq"} <= set(env.write)
    gen = stage_access(config, "generation", "h20")
    assert gen.principal == f"{job}-gen-h20" and gen.groups == (f"{job}.gen-h20",)
    assert f"{job}.gen.requests.h800" not in gen.read, "a pool reads only its own requests"
    writers = {a.component for a in job_access(config) if f"{job}.policy.versions" in a.write}
    assert writers == {"trainer"}, "only the trainer announces policy versions"
    with pytest.raises(ValueError, match="pool"):
        stage_access(config, "env", "h20")


async def test_a_wrong_password_or_a_stranger_ca_is_refused(secure_kafka, tls_files):
    security, bootstrap, new_job = secure_kafka
    config = await new_job()
    principal = stage_access(config, "env").principal
    wrong = KafkaConfig(**security.kafka_config(principal, "not-the-password"), request_timeout_ms=3000)
    stranger = KafkaConfig(**{**security.kafka_config(principal, password(principal)),
                              "ssl_cafile": str(tls_files["stranger_ca"])}, request_timeout_ms=3000)
    for kafka in (wrong, stranger):
        producer = AIOKafkaProducer(**kafka_client_kwargs(kafka, bootstrap))
        with pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()


async def test_every_stage_user_can_do_its_job_and_nothing_else(secure_kafka):
    security, bootstrap, new_job = secure_kafka
    config = await new_job()
    everything = {t.name for t in expand_catalog(config)}
    for access in job_access(config):
        kafka = as_user(config, security, access.principal).kafka
        producer = AIOKafkaProducer(**kafka_client_kwargs(kafka, bootstrap), acks="all", enable_idempotence=True)
        await producer.start()
        try:
            for topic in access.write:
                await producer.send_and_wait(topic, b"allowed", key=b"k", partition=0)  # compacted: keyed
            outside = sorted(everything - set(access.write))[0]
            with pytest.raises(TopicAuthorizationFailedError):
                await producer.send_and_wait(outside, b"refused", key=b"k", partition=0)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(**kafka_client_kwargs(kafka, bootstrap), enable_auto_commit=False,
                                    group_id=access.groups[0] if access.groups else None)
        await consumer.start()
        try:
            partitions = [TopicPartition(topic, 0) for topic in access.read]
            consumer.assign(partitions)
            await consumer.seek_to_beginning(*partitions)
            await consumer.getmany(timeout_ms=500)  # a refused fetch raises here
            if access.groups:
                await consumer.commit({partitions[0]: 0})  # Read on the group
        finally:
            await consumer.stop()


async def test_a_stage_writing_outside_its_acl_stops_clearly_and_loses_nothing(secure_kafka):
    security, bootstrap, new_job = secure_kafka
    config = await new_job()
    dlq = TopicPartition(f"{config.job}.tasks.dlq", 0)
    dead_before = await end_offset(config, bootstrap, dlq)
    env = stage_access(config, "env")
    feeder = as_user(config, security, stage_access(config, "feeder").principal)
    async with open_runtime(feeder, serve=False) as rt:
        await rt.producer.send_and_wait("tasks", TaskSpec(group_id="g-acl", env="e", tag="t", group_size=1),
                                        key="g-acl")

    env_config = as_user(config, security, env.principal)
    async with open_runtime(env_config, serve=False) as rt:
        async def writes_tasks(envelope, ctx) -> None:  # the feeder's output: not the env stage's to write
            await ctx.produce("tasks", envelope.message, key="g-acl")

        loop = rt.consumer_loop("env", ["tasks"], writes_tasks)
        with pytest.raises(NotAuthorized) as refused:
            await wait_for(loop.run(), 60)
        assert f"User:{env.principal}" in str(refused.value) and f"{config.job}.tasks" in str(refused.value)

        handled = []

        async def completes(envelope, ctx) -> None:  # the fixed stage: what the env stage may write
            handled.append(envelope.message.group_id)
            trajectory: CompletedTrajectory = sample_trajectory("g-acl-t0")
            await ctx.produce("trajectories.completed", trajectory, key=trajectory.traj_id)
            loop.stop()

        loop = rt.consumer_loop("env", ["tasks"], completes)
        await wait_for(loop.run(), 60)
    assert handled == ["g-acl"], "the refused message was not committed, dead-lettered or lost: it is redone"
    assert await end_offset(config, bootstrap, dlq) == dead_before, "an ACL refusal is not the message's fault"


async def end_offset(config, bootstrap: str, tp: TopicPartition) -> int:
    consumer = AIOKafkaConsumer(**kafka_client_kwargs(config.kafka, bootstrap), enable_auto_commit=False)
    await consumer.start()
    try:
        return (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()
