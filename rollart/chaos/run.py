"""``rollart chaos CONFIG --faults ... --out FILE.json``: train under injected faults, then audit.

The job runs as ``rollart run`` does (every stage a supervised process) on a stack started for the
campaign. Faults configured up front: ``env-hang`` / ``env-raise`` (each env step may hang until the
step timeout or raise), ``reward-fail`` / ``reward-slow`` (every tag is scored by a flaky HTTP function
that returns the env's reward, fails with 503 or 400, or stalls). Faults injected while it trains,
one every ``interval_s`` once training runs: ``kill`` (SIGKILL a random stage process; a schedule's
``kill:broker`` SIGKILLs the campaign's own Apache Kafka and restarts it on its log),
``redis-flush`` (delete the job's Redis keys), ``bad-messages`` (undecodable, unknown-kind and
oversized records into every consumed topic). Recovery time of a fault = until the next training
step is recorded after it.

Goodput: trajectories trained per minute under the faults beside the same job's fault-free rate,
measured first on the same stack (``baseline_steps``): ``goodput_ratio``. The audit fails a run that
trained nothing for longer than ``stall_limit_s``.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from rollart.chaos import inject
from rollart.chaos.audit import audit_run
from rollart.chaos.reward_server import FlakyRewardServer
from rollart.config import RollartConfig, load_config
from rollart.local.stack import STACK_FILE, pid_alive
from rollart.training.checkpoint import CheckpointStore

CONFIGURED = ("env-hang", "env-raise", "reward-fail", "reward-slow")
INJECTED = ("kill", "redis-flush", "bad-messages")
FAULTS = CONFIGURED + INJECTED
# The job when no config is given (chaos and soak): FrozenLake scored by the env's own reward.
DEFAULT_TAGS = {"frozenlake": {"env": "frozenlake", "reward": {"type": "env"}}}


@dataclass
class FaultEvent:
    kind: str
    target: str
    at: float
    recovered_s: float | None = None


def chaos_job(base: dict[str, Any], faults: set[str], reward_url: str | None,
              env_failure_rate: float = 0.01) -> dict[str, Any]:
    """The job config with the configured faults applied (``env_failure_rate``: per env step, each of
    hang and raise)."""
    data = json.loads(json.dumps(base))
    tags = data.setdefault("tags", json.loads(json.dumps(DEFAULT_TAGS)))
    for spec in tags.values():
        env_faults = spec.setdefault("faults", {})
        if "env-hang" in faults:
            env_faults["hang_rate"] = env_failure_rate
        if "env-raise" in faults:
            env_faults["step_failure_rate"] = env_failure_rate
        if reward_url:
            spec["reward"] = {"type": "http", "url": reward_url, "include_env_reward": False, "attempts": 4,
                              "backoff_s": 0.05, "timeout_s": 5}
    env = data.setdefault("env", {})
    env.setdefault("step_timeout_s", 2.0)
    feeder = data.setdefault("feeder", {})
    # Crashes and flushes leave the admission counters over-counted (see feeder.starvation_release_s);
    # a short fuse keeps a short campaign moving.
    feeder.setdefault("starvation_release_s", 5.0)
    data.setdefault("bus", {}).setdefault("max_value_bytes", 1 << 20)  # oversized records stay small
    return data


class ChaosDriver:
    def __init__(self, config: RollartConfig, endpoints, out: Path, faults: set[str], *, interval_s: float,
                 seed: int, target_steps: int, schedule: list[str] | None = None):
        self.config, self.endpoints, self.out = config, endpoints, out
        self.kinds = [f for f in INJECTED if f in faults]
        self.schedule = list(schedule) if schedule else None  # e.g. ["kill:trainer", "redis-flush"], in order
        self.interval_s, self.rng, self.target_steps = interval_s, random.Random(seed), target_steps
        self.events: list[FaultEvent] = []
        self.injected: list[inject.Injected] = []
        self.stages_alive_at_end: bool | None = None
        self.error: str | None = None  # why the driver stopped early
        # The trainer appends to its record while the driver reads it: a line still being written
        # is left for the next poll.
        self.record = CheckpointStore(out / "checkpoints").follow()

    def steps(self) -> list[dict]:
        self.record.poll()
        return [r for r in self.record.rows if "event" not in r]

    def job(self) -> str:
        return json.loads((self.out / "run.json").read_text())["job"]

    async def run(self) -> None:
        while len(self.steps()) < 1:
            await asyncio.sleep(0.5)
        while (self.schedule if self.schedule is not None else self.kinds) and \
                len(self.steps()) < self.target_steps - 1:
            await asyncio.sleep(self.interval_s * self.rng.uniform(0.5, 1.5))
            if len(self.steps()) >= self.target_steps - 1:
                break
            event = await self.inject(self.schedule.pop(0) if self.schedule is not None else self.rng.choice(self.kinds))
            if event is not None:
                await self.wait_recovery(event)
        # Before the last step (the trainer exits after it and the runner then stops the rest):
        # every stage, the killed ones restarted, is running.
        while len(self.steps()) < self.target_steps - 1:
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the runner refreshes pids.json every 0.5 s
        pids = inject.stage_pids(self.out)
        self.stages_alive_at_end = bool(pids) and all(pid_alive(p) for p in pids.values())

    async def inject(self, kind: str) -> FaultEvent | None:
        job_cfg = self.config.with_updates(job=self.job())
        at = time.time()
        kind, _, stage = kind.partition(":")  # "kill:trainer" names the stage; "kill" picks one
        if kind == "kill" and stage == inject.BROKER:
            target = await inject.kill_broker(self.out / "stack" / STACK_FILE)
        elif kind == "kill":
            target = inject.kill_stage(self.out, stage or self.rng.choice(inject.killable(job_cfg)))
            if target is None:
                return None
        elif kind == "redis-flush":
            target = f"{inject.flush_redis(self.endpoints.redis_url, job_cfg, job_cfg.job)} keys"
        else:
            records = await inject.inject_bad_messages(job_cfg, self.endpoints)
            self.injected.extend(records)
            target = f"{len(records)} records"
        event = FaultEvent(kind, target, at)
        self.events.append(event)
        return event

    async def wait_recovery(self, event: FaultEvent, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            after = [r["time"] for r in self.steps() if r["time"] > event.at]
            if after:
                event.recovered_s = min(after) - event.at
                return
            await asyncio.sleep(0.2)


def check_faults(faults: set[str], schedule: list[str] | None) -> None:
    unknown = faults - set(FAULTS)
    for entry in schedule or ():
        kind, _, stage = entry.partition(":")
        if kind not in INJECTED or (stage and (kind != "kill" or stage not in (*inject.KILL_TARGETS, inject.BROKER))):
            unknown.add(entry)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {list(FAULTS)} "
                         f"(a schedule may name kill:<{'|'.join((*inject.KILL_TARGETS, inject.BROKER))}>)")


def trained_per_minute(record: list[dict]) -> float | None:
    """Trajectories trained per minute from the first training step to the last (start-up excluded:
    goodput is about the loop, not how long the engines took to load)."""
    steps = [row for row in record if "event" not in row]
    if len(steps) < 2 or steps[-1]["time"] <= steps[0]["time"]:
        return None
    return 60.0 * sum(row["samples"] for row in steps[1:]) / (steps[-1]["time"] - steps[0]["time"])


def goodput_ratio(per_min: float | None, fault_free: float | None) -> float | None:
    """Trained per minute under faults ÷ the fault-free rate (None without both)."""
    return round(per_min / fault_free, 3) if per_min and fault_free else None


def with_stack(data: dict[str, Any], endpoints) -> dict[str, Any]:
    """The job config pointed at the campaign's stack."""
    data = {**data, "kafka": {**data.get("kafka", {}), "bootstrap": endpoints.kafka_bootstrap},
            "redis": {**data.get("redis", {}), "url": endpoints.redis_url}}
    if endpoints.mooncake_master:
        data["mooncake"] = {"master": endpoints.mooncake_master, "metadata_server": endpoints.mooncake_metadata}
    return data


async def fault_free_rate(base: dict[str, Any], endpoints, out: Path, steps: int) -> float | None:
    """The same job without faults, ``steps`` steps on the campaign's stack: its trained per minute."""
    from rollart.job.run import RunOptions, run_job

    out.mkdir(parents=True, exist_ok=True)
    path = out / "baseline-job.yaml"
    path.write_text(yaml.safe_dump(with_stack(chaos_job(base, set(), None), endpoints)))
    await run_job(path, load_config(path), RunOptions(steps=steps, out=out, timeout_s=1800))
    return trained_per_minute(CheckpointStore(out / "checkpoints").read_record())


async def run_chaos(config_path: Path | None, faults: set[str], *, steps: int, out: Path, interval_s: float = 20.0,
                    seed: int = 0, schedule: list[str] | None = None, baseline_steps: int = 0,
                    stall_limit_s: float = 300.0, env_failure_rate: float = 0.01) -> dict[str, Any]:
    from rollart.job.run import RunOptions, run_job
    from rollart.local.endpoints import job_endpoints

    check_faults(faults, schedule)
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(config_path.read_text()) if config_path else {}
    server = FlakyRewardServer(transient_rate=0.2 if "reward-fail" in faults else 0.0,
                               permanent_rate=0.01 if "reward-fail" in faults else 0.0,
                               slow_rate=0.1 if "reward-slow" in faults else 0.0, seed=seed)
    reward_url = await server.start() if {"reward-fail", "reward-slow"} & faults else None
    try:
        with job_endpoints(load_config(config_path), out / "stack", mooncake=None) as endpoints:
            if any(entry == f"kill:{inject.BROKER}" for entry in schedule or ()) and \
                    not (out / "stack" / STACK_FILE).exists():
                raise ValueError("kill:broker kills the campaign's own broker: configure no Kafka endpoint "
                                 "(ROLLART_KAFKA_BOOTSTRAP) so that the campaign starts one")
            baseline = await fault_free_rate(base, endpoints, out / "baseline", baseline_steps) \
                if baseline_steps >= 2 else None
            data = with_stack(chaos_job(base, faults, reward_url, env_failure_rate), endpoints)
            path = out / "chaos-job.yaml"
            path.write_text(yaml.safe_dump(data))
            config = load_config(path)
            driver = ChaosDriver(config, endpoints, out, faults, interval_s=interval_s, seed=seed, target_steps=steps,
                                 schedule=schedule)
            drive = asyncio.create_task(driver.run())
            try:
                report = await run_job(path, config, RunOptions(steps=steps, out=out, timeout_s=3600))
            finally:
                drive.cancel()
                outcome, = await asyncio.gather(drive, return_exceptions=True)
            if isinstance(outcome, Exception):  # a fault that could not be injected is a failed campaign
                driver.error = f"{type(outcome).__name__}: {outcome}"
            job_cfg = config.with_updates(job=report["job"])
            record = CheckpointStore(out / "checkpoints").read_record()
            audit = await audit_run(job_cfg, endpoints, record, report["alpha"], driver.injected,
                                    stall_limit_s=stall_limit_s, ended_at=time.time())
    finally:
        await server.stop()
    result = chaos_result(driver, audit, report, faults, server.counts)
    rate = trained_per_minute(record)
    result.update(trained_per_min=rate, fault_free_trained_per_min=baseline,
                  goodput_ratio=goodput_ratio(rate, baseline))
    return result


def chaos_result(driver: ChaosDriver, audit, report: dict, faults: set[str], reward_calls: dict) -> dict[str, Any]:
    recovery: dict[str, list[float]] = {}
    for event in driver.events:
        if event.recovered_s is not None:
            recovery.setdefault(event.kind, []).append(event.recovered_s)
            if event.kind == "kill":  # also per stage: an engine reload is not a feeder restart
                stage = inject.BROKER if event.target.startswith("kafka pid") else inject.stage_of(event.target)
                recovery.setdefault(f"kill:{stage}", []).append(event.recovered_s)
    configured = [f for f in CONFIGURED if f in faults]
    survived = sum(1 for e in driver.events if e.recovered_s is not None) + (len(configured) if audit.holds else 0)
    return {
        "faults_injected": len(driver.events) + len(configured),
        "faults_survived": survived,
        "trajectories_lost": len(audit.trajectories_lost) + len(audit.unscored),
        "duplicates_trained": len(audit.duplicates_trained),
        "duplicates_produced": audit.duplicates_produced,
        "recovery_s": {kind: statistics.mean(values) for kind, values in recovery.items()},
        "stages_alive": driver.stages_alive_at_end,
        "steps": len(report["steps"]), "restarts": report["restarts"],
        "aborted": audit.trajectories_aborted, "reward_calls": reward_calls,
        "events": [asdict(e) for e in driver.events], "audit": audit.as_dict(), "driver_error": driver.error,
    }
