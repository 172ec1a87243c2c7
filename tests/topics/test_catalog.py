"""The topic catalog: expansion per job and pool, idempotent apply, differences reported."""

from __future__ import annotations

import pytest
from aiokafka.admin import NewTopic

from rollart.config import ConfigError
from rollart.topics import expand_catalog, load_catalog, spec_for
from rollart.topics.admin import admin_client, apply_topics
from tests.conftest import make_config


def test_catalog_describes_every_architecture_topic():
    catalog = load_catalog()
    assert set(catalog) == {"tasks", "gen.requests.{pool}", "env.actions", "trajectories.completed",
                            "rewards.results", "rewards.judge", "policy.versions", "eval.results", "eval.summaries"}
    assert catalog["policy.versions"].cleanup_policy == "compact"
    assert catalog["gen.requests.{pool}"].kinds == ("GenerationRequest", "Abort")
    assert spec_for("gen.requests.h20", catalog) is catalog["gen.requests.{pool}"]
    with pytest.raises(KeyError):
        spec_for("gen.requests.", catalog)


def test_expansion_prefixes_job_and_expands_pools(endpoints):
    config = make_config(endpoints, job="myjob", pools=["h20", "h800"])
    names = {t.name for t in expand_catalog(config)}
    assert {"myjob.gen.requests.h20", "myjob.gen.requests.h800", "myjob.gen.requests.h20.dlq",
            "myjob.tasks", "myjob.tasks.dlq", "myjob.policy.versions"} <= names
    assert len(names) == 2 * (6 + 2), "no eval topics for a job without eval:"
    evaluated = make_config(endpoints, job="myjob", pools=["h20", "h800"],
                            tags={"grid": {"env": "frozenlake", "weight": 0}}, eval={"tags": ["grid"], "pool": "h800"})
    assert {t.name for t in expand_catalog(evaluated)} - names == {
        "myjob.eval.results", "myjob.eval.results.dlq", "myjob.eval.summaries", "myjob.eval.summaries.dlq"}


def test_bad_catalog_entry_names_the_file_and_field(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: x\nkey: k\nkinds: [NoSuchKind]\npartitions: 0\nretention_ms: 1\n")
    with pytest.raises(ConfigError) as err:
        load_catalog(tmp_path)
    assert "broken.yaml" in str(err.value) and "partitions" in str(err.value) and "NoSuchKind" in str(err.value)


async def test_apply_is_idempotent_and_reports_differences(config, endpoints):
    topics = expand_catalog(config)
    first = await apply_topics(config, endpoints, topics)
    assert {r.action for r in first} == {"created"}
    second = await apply_topics(config, endpoints, topics)
    assert {r.action for r in second} == {"exists"}

    other = make_config(endpoints)
    admin = admin_client(other, endpoints)
    await admin.start()
    try:  # someone created this job's tasks topic by hand, with other settings
        await admin.create_topics([NewTopic(f"{other.job}.tasks", 3, 1, topic_configs={"retention.ms": "1000"})])
    finally:
        await admin.close()
    reports = {r.name: r for r in await apply_topics(other, endpoints)}
    tasks = reports[f"{other.job}.tasks"]
    assert tasks.action == "differs"
    assert "partitions: catalog 8, broker 3" in tasks.differences
    assert "retention.ms: catalog 604800000, broker 1000" in tasks.differences


async def test_created_topics_serve_offsets_when_apply_returns(config, endpoints, caplog):
    """A consumer that looks up its start right after the topics are created gets an answer from every
    partition's leader: no NOT_LEADER answers, which aiokafka logs as ERRORs before retrying."""
    import logging

    from aiokafka import AIOKafkaConsumer, TopicPartition

    from rollart.endpoints import kafka_client_kwargs

    topics = expand_catalog(config)
    assert {r.action for r in await apply_topics(config, endpoints, topics)} == {"created"}
    consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest",
                                **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap))
    caplog.set_level(logging.WARNING, logger="aiokafka")
    await consumer.start()
    try:
        partitions = [TopicPartition(t.name, p) for t in topics for p in range(t.partitions)]
        consumer.assign(partitions)
        assert [await consumer.position(tp) for tp in partitions] == [0] * len(partitions)
    finally:
        await consumer.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
