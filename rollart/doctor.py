"""``rollart doctor``: is everything a job needs reachable and working? Each check says what to fix."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

from rollart.bus import BusProducer
from rollart.bus.reader import ReadStart, read_to_end
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, NoEndpointError, resolve_endpoints
from rollart.local.stack import StackState, port_open
from rollart.messages import DEFAULT_CODEC
from rollart.messages.samples import sample_messages
from rollart.state import VersionStore, connect_redis
from rollart.topics import PhysicalTopic, expand_catalog, load_catalog
from rollart.topics.admin import admin_client, apply_topics
from rollart.timeouts import wait_for

CHECK_TIMEOUT_S = 10.0
SCRATCH_TOPIC = "_doctor"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    latency_s: float


class Doctor:
    def __init__(self, config: RollartConfig):
        self.config = config
        self.checks: list[Check] = []
        self.broker: dict[str, str | None] | None = None  # {"kind", "version"} of the resolved broker

    async def _run(self, name: str, check: Callable[[], Awaitable[str]]) -> bool:
        started = time.perf_counter()
        try:
            detail, ok = await wait_for(check(), CHECK_TIMEOUT_S), True
        except asyncio.TimeoutError:
            detail, ok = f"timed out after {CHECK_TIMEOUT_S:.0f}s", False
        except Exception as exc:  # noqa: BLE001 - every failure becomes a reported check
            detail, ok = f"{type(exc).__name__}: {exc}", False
        self.checks.append(Check(name, ok, detail, round(time.perf_counter() - started, 6)))
        return ok

    def _skip(self, name: str, why: str) -> None:
        self.checks.append(Check(name, False, f"skipped: {why}", 0.0))

    async def run(self) -> list[Check]:
        try:
            endpoints = resolve_endpoints(self.config)
        except NoEndpointError as exc:
            self.checks.append(Check("endpoints", False, str(exc), 0.0))
            return self.checks
        self.checks.append(Check("endpoints", True, f"kafka {endpoints.kafka_bootstrap}, redis {endpoints.redis_url} "
                                                    f"(from {endpoints.source})", 0.0))
        self.broker = broker_info(endpoints)
        broker_ok = await self._run("broker", lambda: self._broker(endpoints))
        if broker_ok:
            await self._run("topics", lambda: self._topics(endpoints))
        else:
            self._skip("topics", "broker unreachable")
        redis_ok = await self._run("redis", lambda: self._redis(endpoints))
        if broker_ok and redis_ok:
            await self._run("version_store", lambda: self._version_store(endpoints))
        else:
            self._skip("version_store", "needs both the broker and Redis")
        if self.config.mooncake.master:
            await self._run("mooncake", self._mooncake)
        if broker_ok:
            await self._roundtrip(endpoints)
        else:
            for message in sample_messages():
                self._skip(f"roundtrip:{message.KIND}", "broker unreachable")
        return self.checks

    async def _broker(self, endpoints: Endpoints) -> str:
        admin = admin_client(self.config, endpoints)
        try:
            await admin.start()
        except Exception as exc:
            raise RuntimeError(
                f"cannot reach the Kafka broker at {endpoints.kafka_bootstrap} ({endpoints.source}): {exc}. "
                "Fix: start it with `rollart local up`, or point ROLLART_KAFKA_BOOTSTRAP at a running broker"
            ) from None
        try:
            cluster = await admin.describe_cluster()
            return f"{len(cluster['brokers'])} broker(s) at {endpoints.kafka_bootstrap}"
        finally:
            await admin.close()

    async def _topics(self, endpoints: Endpoints) -> str:
        expected = expand_catalog(self.config, load_catalog(self.config.topics))
        admin = admin_client(self.config, endpoints)
        await admin.start()
        try:
            existing = set(await admin.list_topics())
        finally:
            await admin.close()
        missing = [t.name for t in expected if t.name not in existing]
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(expected)} topics of job {self.config.job!r} are missing "
                               f"({', '.join(missing[:4])}{'...' if len(missing) > 4 else ''}). "
                               "Fix: run `rollart topics apply`")
        return f"all {len(expected)} topics of job {self.config.job!r} exist"

    async def _redis(self, endpoints: Endpoints) -> str:
        redis = connect_redis(endpoints, timeout_s=3)
        try:
            await redis.ping()
        except Exception as exc:
            raise RuntimeError(f"cannot reach Redis at {endpoints.redis_url}: {exc}. Fix: start Redis "
                               "(`rollart local up` starts one if none runs) or set ROLLART_REDIS_URL") from None
        finally:
            await redis.aclose()
        return f"PING ok at {endpoints.redis_url}"

    async def _version_store(self, endpoints: Endpoints) -> str:
        redis = connect_redis(endpoints, timeout_s=3)
        try:
            store = VersionStore(self.config, endpoints, redis)
            cached = await redis.get(store.key)
            version = await store.current()
            return f"policy version {version} ({'cached in Redis' if cached is not None else 'rebuilt from the log'})"
        finally:
            await redis.aclose()

    async def _mooncake(self) -> str:
        host, _, port = (self.config.mooncake.master or "").rpartition(":")
        if not port.isdigit() or not port_open(host or "127.0.0.1", int(port), timeout=2):
            raise RuntimeError(f"Mooncake master {self.config.mooncake.master} does not accept connections. "
                               "Fix: start mooncake_master or correct mooncake.master")
        return f"master {self.config.mooncake.master} accepts connections"

    async def _roundtrip(self, endpoints: Endpoints) -> None:
        """Produce one message of every kind to a scratch topic, read them back, compare."""
        messages = sample_messages()
        scratch = PhysicalTopic(logical=SCRATCH_TOPIC, name=f"{self.config.job}.{SCRATCH_TOPIC}", partitions=1,
                                configs={"retention.ms": "3600000", "cleanup.policy": "delete"})
        await apply_topics(self.config, endpoints, [scratch])
        async with BusProducer(self.config, endpoints) as producer:
            for message in messages:
                await self._run(f"roundtrip:{message.KIND}",
                                lambda m=message: self._roundtrip_one(producer, endpoints, scratch.name, m))

    async def _roundtrip_one(self, producer: BusProducer, endpoints: Endpoints, topic: str, message) -> str:
        meta = await producer.send_and_wait(SCRATCH_TOPIC, message, key=message.message_id(), policy_version=3)
        at = ReadStart(offset=meta.offset, partition=meta.partition)
        records = [r async for r in read_to_end(self.config, endpoints, topic, start=at, fetch_max_wait_ms=5)]
        record = next((r for r in records if r.offset == meta.offset), None)
        if record is None:
            raise RuntimeError(f"{message.KIND} was acknowledged at {topic}[0]@{meta.offset} but not read back")
        decoded = DEFAULT_CODEC.decode(record.value, record.headers).message
        if decoded != message:
            raise RuntimeError(f"{message.KIND} changed on the way: {decoded!r}")
        return f"{len(record.value)} bytes via {topic}[0]@{meta.offset}"


def broker_info(endpoints: Endpoints) -> dict[str, str | None]:
    """Which broker serves the endpoints: the local stack knows its kind and version; of a configured
    broker only the kind it is configured as is known (Kafka's protocol does not carry a version), and
    the local stack's state file is not read for it."""
    if endpoints.source == "config":
        return {"kind": endpoints.broker, "version": None}
    state = StackState.read()
    if state is not None and state.alive() and state.kafka_bootstrap == endpoints.kafka_bootstrap:
        return {"kind": state.broker_kind, "version": state.broker_version}
    return {"kind": endpoints.broker, "version": None}


async def run_doctor(config: RollartConfig) -> tuple[bool, list[Check], dict | None]:
    doctor = Doctor(config)
    checks = await doctor.run()
    return all(c.ok for c in checks), checks, doctor.broker


def doctor_json(ok: bool, checks: list[Check], broker: dict | None = None) -> dict:
    return {"ok": ok, "broker": broker, "checks": [asdict(c) for c in checks]}
