"""Shared fixtures: one real broker and one real Redis for the whole session.

The broker is Apache Kafka ($ROLLART_TEST_BROKER=tansu runs the suite on Tansu instead). The broker
contract (the consumer loop, groups, DLQ, backpressure, the log reader, replay, lag, TLS) runs on both:
a contract module says ``pytestmark = BOTH_BROKERS`` and each of its tests runs once per broker, each
broker started once for the session. Redis is the machine's own when it answers on 127.0.0.1:6379
(CI starts it), otherwise an embedded Valkey. Each test gets its own job name, so topics, consumer
groups and Redis keys never collide; the ``topics`` fixture deletes its job's topics afterwards.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from rollart.bench.harness import RunningLoops, eventually  # noqa: F401 - shared with the tests
from rollart.config import RollartConfig, build_config
from rollart.endpoints import Endpoints
from rollart.local.stack import LocalStack, StackState
from rollart.runtime import open_runtime
from rollart.state import connect_redis
from rollart.topics import expand_catalog
from rollart.topics.admin import admin_client, apply_topics

REPO = Path(__file__).resolve().parents[1]

pytest_plugins = ["pytester", "tests.async_timeout"]


SUITE_BROKER = os.environ.get("ROLLART_TEST_BROKER", "kafka")
# Parametrizes a module's tests over both brokers (the fixtures below start each one once).
BOTH_BROKERS = pytest.mark.parametrize("broker", ["kafka", "tansu"], indirect=True, scope="session")
# The consumer-group contract (through ConsumerLoop, the producer and the log reader) also holds on
# the in-process broker of rollart.bus.memory; tests that use aiokafka clients directly, kcat, TLS or
# subprocesses stay on the real brokers.
ALL_BROKERS = pytest.mark.parametrize("broker", ["kafka", "tansu", "memory"], indirect=True, scope="session")
KAFKA_ONLY = pytest.mark.parametrize("broker", ["kafka"], indirect=True, scope="session")


@pytest.fixture(scope="session")
def rollart_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("rollart-home")
    os.environ["ROLLART_HOME"] = str(home)  # never touch a developer's real local stack
    return home


def _session_stack(home: Path, kind: str):
    with LocalStack(log_dir=home / kind / "logs", broker=kind) as state:
        yield state


@pytest.fixture(scope="session")
def kafka_stack(rollart_home) -> StackState:
    yield from _session_stack(rollart_home, "kafka")


@pytest.fixture(scope="session")
def tansu_stack(rollart_home) -> StackState:
    yield from _session_stack(rollart_home, "tansu")


@pytest.fixture(scope="session")
def memory_stack(rollart_home) -> StackState:
    """The in-memory broker (nothing to start) and a Redis: the machine's, or an embedded one."""
    from rollart.local.stack import DEFAULT_REDIS_URL, redis_answers, start_redis

    proc, redis_url = None, DEFAULT_REDIS_URL
    if not redis_answers(redis_url):
        (rollart_home / "memory").mkdir(exist_ok=True)
        proc, redis_url = start_redis(rollart_home / "memory")
    yield StackState(kafka_bootstrap="memory://rollart-tests", redis_url=redis_url, broker_pid=None,
                     redis_pid=None, log_dir=str(rollart_home), started_at=0.0, broker_kind="memory")
    if proc is not None:
        proc.terminate()
        proc.wait()


@pytest.fixture(scope="session")
def broker(request) -> str:
    """The broker a test runs on: the suite's, or each of both in a BOTH_BROKERS module."""
    return getattr(request, "param", SUITE_BROKER)


@pytest.fixture(scope="session")
def stack(request, broker) -> StackState:
    return request.getfixturevalue(f"{broker}_stack")


@pytest.fixture(scope="session")
def endpoints(stack: StackState) -> Endpoints:
    return Endpoints(stack.kafka_bootstrap, stack.redis_url, "test stack", stack.mooncake_master,
                     stack.mooncake_metadata, stack.broker_kind)


def make_config(endpoints: Endpoints, **overrides: Any) -> RollartConfig:
    data: dict[str, Any] = {
        "job": f"t{uuid.uuid4().hex[:10]}",
        "kafka": {"bootstrap": endpoints.kafka_bootstrap, "broker": endpoints.broker},
        "redis": {"url": endpoints.redis_url},
        "mooncake": {"master": endpoints.mooncake_master, "metadata_server": endpoints.mooncake_metadata},
        "bus": {"commit_interval_s": 0.1, "session_timeout_ms": 6000, "heartbeat_interval_ms": 300,
                "fetch_max_wait_ms": 20, "retry_backoff_s": 0.01, "drain_timeout_s": 5},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return build_config(data, "test")


@pytest.fixture
def config(endpoints: Endpoints) -> RollartConfig:
    return make_config(endpoints)


@pytest.fixture
async def topics(config: RollartConfig, endpoints: Endpoints) -> RollartConfig:
    """The job's catalog topics exist (and are deleted afterwards: a session broker holding every
    test's topics would grow by thousands of partitions)."""
    await apply_topics(config, endpoints, expand_catalog(config))
    yield config
    if endpoints.broker == "kafka":  # Tansu's memory storage is dropped with the broker
        await delete_job_topics(config, endpoints)


async def delete_job_topics(config: RollartConfig, endpoints: Endpoints) -> None:
    admin = admin_client(config, endpoints)
    await admin.start()
    try:
        names = [t for t in await admin.list_topics() if t.startswith(f"{config.job}.")]
        if names:
            await admin.delete_topics(names)
    finally:
        await admin.close()


@pytest.fixture
async def runtime(topics: RollartConfig):
    async with open_runtime(topics, serve=False) as rt:
        yield rt


@pytest.fixture
async def redis(endpoints: Endpoints) -> Redis:
    client = connect_redis(endpoints)
    yield client
    await client.aclose()


@pytest.fixture
async def loops():
    running = RunningLoops()
    yield running
    await running.stop_all()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 + tokenizer trained on the envs' text, created locally once per session."""
    from rollart.models.tiny import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def chat(tiny_model):
    from rollart.rollout.chat import ChatFormat

    return ChatFormat.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
async def engine(tiny_model):
    from rollart.config import GenerationConfig
    from rollart.engines.vllm_engine import VLLMEngine

    # uni: the engine starts ~10 s sooner (its pace is not what the tests measure)
    engine = VLLMEngine(tiny_model, GenerationConfig(max_concurrency=64, max_model_len=2048, executor="uni"))
    await engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> dict[str, Path]:
    """A throwaway CA (trustme) and a server certificate for 127.0.0.1, as PEM files; plus a second CA
    that signed nothing, to show verification fails."""
    import trustme

    folder = tmp_path_factory.mktemp("tls")
    ca, stranger = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server.key",
             "stranger_ca": folder / "stranger.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    stranger.cert_pem.write_to_path(str(files["stranger_ca"]))
    return files
