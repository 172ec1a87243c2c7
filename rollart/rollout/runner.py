"""``rollart rollout``: start the stack and every stage as processes, collect N scored trajectories.

The run gets its own job name (``<job>-<run id>``), so its topics and state never mix with an
earlier run's. A collector consumes ``rewards.results`` (scored trajectories, de-duplicated by id)
and ``trajectories.completed`` (aborts with reasons) until N trajectories are scored, then the
stages are stopped with SIGTERM and ``summary.json`` is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, NoEndpointError, resolve_endpoints
from rollart.local.processes import StageProcesses
from rollart.local.security import LocalSecurity
from rollart.local.stack import STACK_FILE, LocalStack
from rollart.messages import Abort, Envelope, ScoredTrajectory
from rollart.models.tiny import ensure_model
from rollart.runtime import open_runtime
from rollart.topics.admin import apply_topics
from rollart.names import REWARDS_RESULTS, TRAJECTORIES_COMPLETED


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


class Collector:
    """Collects scored trajectories until ``target`` and, with ``shares`` (tag -> trajectories, the tags'
    weights applied to the target), until every tag has its share: a fast tag does not fill the
    rollout alone."""

    def __init__(self, target: int, shares: dict[str, int] | None = None):
        self.target = target
        self.shares = shares or {}
        self.scored: dict[str, ScoredTrajectory] = {}
        self.per_tag: Counter = Counter()
        self.aborted: Counter = Counter()
        self.aborted_ids: set[str] = set()
        self.done = asyncio.Event()

    def complete(self) -> bool:
        return len(self.scored) >= self.target and all(self.per_tag[t] >= n for t, n in self.shares.items())

    async def handle(self, envelope: Envelope, ctx) -> None:
        message = envelope.message
        if isinstance(message, ScoredTrajectory):
            if message.trajectory.traj_id not in self.scored:
                self.scored[message.trajectory.traj_id] = message
                self.per_tag[message.trajectory.tag] += 1
            if self.complete():
                self.done.set()
        elif isinstance(message, Abort) and message.traj_id not in self.aborted_ids:
            self.aborted_ids.add(message.traj_id)
            self.aborted[message.reason] += 1

    def summary(self, elapsed_s: float) -> dict:
        by_tag: dict[str, list[ScoredTrajectory]] = defaultdict(list)
        for scored in self.scored.values():
            by_tag[scored.trajectory.tag].append(scored)
        tokens = sum(sum(s.trajectory.loss_mask) for s in self.scored.values())
        return {
            "completed": len(self.scored),
            "aborted": dict(self.aborted),
            "by_tag": {tag: {
                "completed": len(items),
                "share": self.shares.get(tag),
                "reward_mean": sum(s.reward for s in items) / len(items),
                "turns_mean": sum(s.trajectory.turns for s in items) / len(items),
                "success_rate": sum(s.trajectory.metrics.get("success", 0.0) for s in items) / len(items),
            } for tag, items in sorted(by_tag.items())},
            "tokens_generated": tokens,
            "elapsed_s": round(elapsed_s, 3),
            "trajectories_per_s": round(len(self.scored) / elapsed_s, 3) if elapsed_s else 0.0,
        }


async def collect(config: RollartConfig, target: int, procs: StageProcesses, timeout_s: float) -> Collector:
    collector = Collector(target, config.tag_shares(target))
    async with open_runtime(config, client_id="rollout-collector", serve=False) as rt:
        loop = rt.consumer_loop("rollout-collector", [REWARDS_RESULTS, TRAJECTORIES_COMPLETED], collector.handle,
                                ordering="none", dedup=False)
        runner = asyncio.create_task(loop.run())
        deadline = time.monotonic() + timeout_s
        try:
            while not collector.done.is_set():
                failed = procs.failed()
                if failed:
                    raise RuntimeError(f"stage(s) {failed} failed; last log lines:\n" + procs.tail(failed[0]))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"collected {len(collector.scored)} of {target} trajectories in {timeout_s}s "
                                       f"(per tag {dict(collector.per_tag)}, shares {collector.shares})")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(collector.done.wait(), 0.5)
        finally:
            loop.stop()
            await runner
    return collector


async def rollout(config_path: Path, config: RollartConfig, *, trajectories: int, out: Path,
                  timeout_s: float = 900.0, env_members: int = 1, gen_members: int = 1, secure: bool = False) -> dict:
    """``secure``: on the run's own SASL_SSL Kafka, each stage logged in as its own ACL'd user."""
    from rollart.stages.feeder import sources_from
    from rollart.stages.registry import local_processes
    from rollart.stages.reward import check_rewards

    check_rewards(config)  # a reward or dataset that cannot load fails here, naming its tag
    sources_from(config)
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(config.model)  # once, before the stages race to create it
    # tags are drawn at random by weight: room for the rarest tag to reach its share (the collector stops
    # the rollout once every tag has it, so the slack is rarely released)
    groups = 3 * math.ceil(trajectories / config.feeder.group_size) + 2 * env_members * config.env.max_groups
    with job_endpoints(config, out / "stack", secure=secure) as endpoints:
        job = f"{config.job}-{uuid.uuid4().hex[:6]}"
        cfg = run_config(config, endpoints, job)
        await apply_topics(cfg, endpoints)
        procs = StageProcesses(config_path, endpoints, job, out / "logs",
                               extra_env={"ROLLART_FEEDER_ALPHA": "null", "ROLLART_FEEDER_MAX_GROUPS": str(groups)},
                               stage_env=await stage_logins(cfg, endpoints))
        started = time.monotonic()
        try:
            members = {"generation": gen_members, "env": env_members}
            for name, argv in local_processes(cfg, training=False, members=members):
                procs.start(name, *argv)
            collector = await collect(cfg, trajectories, procs, timeout_s)
        finally:
            exit_codes = procs.stop_all()
        summary = {"job": job, **collector.summary(time.monotonic() - started), "exit_codes": exit_codes,
                   "stage_users": sorted(env["ROLLART_KAFKA_SASL_USERNAME"] for env in procs.stage_env.values())}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
