"""Run one benchmark on each broker of the local stack (``--broker kafka|tansu|both``), side by side.

Each broker gets a throw-away local stack of its own, started and stopped around its measurement, so
neither run shares a broker, a log or a JVM warm-up with the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Awaitable, Callable

from rollart.config import RollartConfig
from rollart.local.brokers import BROKER_ENV, BROKER_KINDS, BrokerKind

BENCH_BROKER_CHOICES = (*BROKER_KINDS, "both")


def brokers_of(choice: str) -> tuple[BrokerKind, ...]:
    if choice not in BENCH_BROKER_CHOICES:
        raise ValueError(f"--broker must be one of {', '.join(BENCH_BROKER_CHOICES)}, not {choice!r}")
    return BROKER_KINDS if choice == "both" else (choice,)  # type: ignore[return-value]


def on_local_stack(config: RollartConfig, kind: BrokerKind, work_dir: Path):
    """A local stack on ``kind`` for the duration, and ``config`` pointed at it."""
    import contextlib

    from rollart.local.stack import LocalStack

    @contextlib.contextmanager
    def stack():
        with LocalStack(log_dir=work_dir / kind / "logs", broker=kind, mooncake=False) as state:
            yield config.model_copy(update={
                "kafka": config.kafka.model_copy(update={"bootstrap": state.kafka_bootstrap, "broker": kind}),
                "redis": config.redis.model_copy(update={"url": state.redis_url}),
            })

    return stack()


async def per_broker(choice: str, measure: Callable[[BrokerKind], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """``measure`` on each chosen broker. One broker: its result with ``broker`` added; both: each
    under ``brokers`` and the Apache Kafka figures also at the top level."""
    results = {}
    for kind in brokers_of(choice):
        previous = os.environ.get(BROKER_ENV)
        os.environ[BROKER_ENV] = kind  # for stacks the measurement starts itself (job_endpoints)
        try:
            results[kind] = {**await measure(kind), "broker": kind}
        finally:
            if previous is None:
                os.environ.pop(BROKER_ENV, None)
            else:
                os.environ[BROKER_ENV] = previous
    if len(results) == 1:
        return next(iter(results.values()))
    return {**results["kafka"], "brokers": results}
