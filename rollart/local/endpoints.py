"""A local run's endpoints and config: the configured (or `rollart local up`'s recorded) broker and
Redis, else a stack started for the run; the run's config naming its job and those endpoints."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, NoEndpointError, resolve_endpoints
from rollart.local.security import LocalSecurity
from rollart.local.stack import STACK_FILE, LocalStack


@contextlib.contextmanager
def job_endpoints(config: RollartConfig, log_dir: Path, *, mooncake: bool | None = False, secure: bool = False):
    """Configured/recorded endpoints, or a local stack started for the duration of the run (recorded
    in ``log_dir/stack.json``). ``secure``: always the run's own stack, a SASL_SSL Kafka with ACLs."""
    if not secure:
        try:
            yield resolve_endpoints(config)
            return
        except NoEndpointError:
            pass
    with LocalStack(log_dir=log_dir, mooncake=mooncake, state_file=log_dir / STACK_FILE,
                    broker="kafka" if secure else None, secure=secure) as state:
        yield Endpoints(state.kafka_bootstrap, state.redis_url, "local stack (this run)", state.mooncake_master,
                        state.mooncake_metadata, state.broker_kind, kafka_security=state.kafka_security)


def run_config(config: RollartConfig, endpoints: Endpoints, job: str, **updates) -> RollartConfig:
    """The run's config: its job name and endpoints (on a secured stack, logged in as its admin)."""
    kafka = {"bootstrap": endpoints.kafka_bootstrap, "broker": endpoints.broker}
    if endpoints.kafka_security:
        kafka.update(LocalSecurity(Path(endpoints.kafka_security)).kafka_config())
    return config.with_updates(f"the run's config (job {job})", job=job, kafka=kafka,
                               redis={"url": endpoints.redis_url}, **updates)


async def stage_logins(config: RollartConfig, endpoints: Endpoints) -> dict[tuple[str, str | None], dict[str, str]]:
    """On a secured stack: a user and ACLs per stage of the job, as each stage's environment."""
    if not endpoints.kafka_security:
        return {}
    security = LocalSecurity(Path(endpoints.kafka_security))
    logins = await asyncio.to_thread(security.secure_job, config, endpoints.kafka_bootstrap)
    return {stage: security.stage_env(user, password) for stage, (user, password) in logins.items()}
