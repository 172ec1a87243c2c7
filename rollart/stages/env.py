"""The env stage (EnvManager): runs trajectories, each on its own timeline.

Two consumer loops per member:

* ``env`` consumes ``tasks``. A TaskSpec's handler runs the whole group: ``group_size + redundancy``
  trajectories concurrently, emitting each completion at once (scoring starts immediately),
  replacing members that end for a fault (``feeder.max_replacements``), aborting the extras as soon
  as ``group_size`` completed, and ending with the group's GroupEnded. The task's offset is committed only when
  its group is over, so a crashed member's groups are redelivered and rerun by a survivor (the
  rerun reuses the trajectory ids, so the reward stage drops any second copy). ``env.max_groups``
  bounds the groups a member runs at once; beyond it the loop pauses ``tasks``.
* ``env-actions`` consumes ``env.actions``: generation results, produced by the generation stage to
  the partition the requesting member owns (see :mod:`rollart.rollout.replies`).

Every trajectory ends on the log: an Abort with a reason (reset failed, step timeout, generation
timeout, redundant, stale, ...) on ``trajectories.completed``, counted in metrics; a completed one
there too when the reward stage scores its tag, or, when its reward is ``scored_by: env`` (the
default for ``env`` and ``rule`` rewards), scored by this member and produced as a ScoredTrajectory
straight to ``rewards.results`` (``eval.results`` for an eval task) with its group's end: one hop and
one consumer group fewer per trajectory for a reward that costs microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from dataclasses import replace
from typing import Awaitable, Callable
from zlib import crc32

from prometheus_client import Counter, Gauge, Histogram

from rollart.bus import MessageContext, StopRequest
from rollart.config import RewardSpec, RollartConfig
from rollart.envs import FaultyEnv, make_env
from rollart.messages import Abort, CompletedTrajectory, Envelope, GenerationRequest, GenerationResult, GroupEnded, \
    SamplingParams, ScoredTrajectory, TaskSpec
from rollart.rewards.http import RewardCallFailed
from rollart.rewards.scoring import SCORED, LocalScorer, count_scored, reward_spec, results_topic, scored_trajectory
from rollart.rollout.chat import ChatFormat
from rollart.rollout.direct import DirectClient
from rollart.rollout.replies import Delivery, NoReplyPartition, ReplyChannel
from rollart.rollout.routing import PoolRouter, init_fallback_metrics
from rollart.rollout.trajectory import TrajectoryBuilder
from rollart.runtime import Runtime
from rollart.state import AdmissionCounters, PoolRegistry, VersionStore
from rollart.names import ENV_ACTIONS, TASKS, TRAJECTORIES_COMPLETED
from rollart.stages.runner import Member, run_member
from rollart.timeouts import wait_for

log = logging.getLogger(__name__)

_L = ("job", "tag")
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
COMPLETED = Counter("rollart_env_trajectories_completed_total", "Trajectories completed", (*_L, "status"))
ABORTED = Counter("rollart_env_trajectories_aborted_total", "Trajectories aborted, by reason", (*_L, "reason"))
INTERRUPTED = Counter("rollart_env_trajectories_interrupted_total",
                      "Trajectories cut off by a rebalance or shutdown; their group reruns elsewhere", _L)
TURNS = Histogram("rollart_env_trajectory_turns", "LLM turns per completed trajectory", _L,
                  buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 32))
TRAJ_LATENCY = Histogram("rollart_env_trajectory_latency_seconds", "Start to end of a completed trajectory", _L,
                         buckets=_SECONDS)
RESET_LATENCY = Histogram("rollart_env_reset_latency_seconds", "env.reset time", _L, buckets=_SECONDS)
STEP_LATENCY = Histogram("rollart_env_step_latency_seconds", "env.step time", _L, buckets=_SECONDS)
RUNNING = Gauge("rollart_env_running_trajectories", "Trajectories in progress in this member", ("job",))
# Per LLM turn: from the env's request to its result reaching the member, minus the engine's own time
# for the request, i.e. what the transport (bus: produce, fetch, dispatch, reply; or the direct socket)
# and the generation member add on top of the engine. The member's own wait after that (its event loop
# busy with other trajectories' turns) is RESUME_WAIT: a saturated env member is not a slow transport.
_FAST = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
GENERATION_OVERHEAD = Histogram("rollart_env_generation_overhead_seconds",
                                "Per turn: request to result's arrival at the env minus the engine's time "
                                "(the transport's and the generation member's tax)", ("job", "pool"), buckets=_FAST)
RESUME_WAIT = Histogram("rollart_env_turn_resume_wait_seconds",
                        "Per turn: result's arrival at the env member to its trajectory resuming (the member's "
                        "event loop busy with other trajectories)", ("job",), buckets=_FAST)
TURNS_BY_TRANSPORT = Counter("rollart_env_generation_turns_total", "LLM turns, by the path they took (direct or bus)",
                             ("job", "pool", "transport"))
GROUPS = Counter("rollart_env_groups_total", "Task groups finished, complete or not", ("job", "tag", "outcome"))
REPLACEMENTS = Counter("rollart_env_replacements_total", "Replacement rollouts started for members ended by a fault, "
                       "by the fault", ("job", "tag", "reason"))


ABORT_REASONS = ("env_reset_failed", "env_step_timeout", "env_step_failed", "generation_timeout", "ownership_lost",
                 "stale", "redundant")
GROUP_OUTCOMES = ("complete", "incomplete")
# Ends for a fault of the rollout, not of the task's data: worth a fresh trajectory of the same task.
REPLACEABLE = ("env_reset_failed", "env_step_timeout", "env_step_failed", "generation_timeout", "ownership_lost")


def init_metrics(config: RollartConfig) -> None:
    """Every (tag, reason) and (tag, outcome) series at 0 from the start: a panel shows no aborts
    yet instead of no data (Prometheus' advice for label values known in advance)."""
    for tag in config.tags:
        for reason in ABORT_REASONS:
            ABORTED.labels(config.job, tag, reason)
        for reason in REPLACEABLE:
            REPLACEMENTS.labels(config.job, tag, reason)
        for outcome in GROUP_OUTCOMES:
            GROUPS.labels(config.job, tag, outcome)
        if reward_spec(config, tag).scored_by == "env":
            SCORED.labels(config.job, tag)
    RUNNING.labels(config.job).set(0)
    init_fallback_metrics(config)


class TrajectoryAborted(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


GenerateTurn = Callable[[TaskSpec, str, int, TrajectoryBuilder], Awaitable[GenerationResult]]


def turn_sampling(config: RollartConfig, chat: ChatFormat, *, evaluation: bool = False) -> SamplingParams:
    """The sampling parameters of every LLM turn (``env.sampling``, or ``eval.sampling`` for an eval
    task; the chat's end of turn stops)."""
    sampling = config.eval_sampling() if evaluation else config.env.sampling
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_tokens=sampling.max_tokens, stop_token_ids=chat.stop_token_ids)


class TrajectoryRunner:
    """Runs one trajectory on its own timeline: reset, then turns of generate → step until the env
    is done, the turns run out or the context is full. Where a turn's tokens come from is given:
    the env stage asks a generation pool over the bus, the in-process loop (``rollart bench
    time-to-quality``) asks its engine. ``check_staleness`` may abort a trajectory between turns."""

    def __init__(self, config: RollartConfig, chat: ChatFormat, generate: GenerateTurn,
                 check_staleness: Callable[[TrajectoryBuilder], Awaitable[None]] | None = None):
        self.config = config
        self.chat = chat
        self.generate = generate
        self.check_staleness = check_staleness

    def _make_env(self, task: TaskSpec, traj_id: str):
        spec = self.config.tags.get(task.tag)
        env = make_env(task.env, spec.env_kwargs if spec else None)
        if spec is not None and spec.faults is not None:
            env = FaultyEnv(env, spec.faults, rng_seed=crc32(traj_id.encode()))
        return env

    async def run(self, task: TaskSpec, traj_id: str) -> CompletedTrajectory | Abort:
        builder = TrajectoryBuilder(traj_id, task)
        RUNNING.labels(self.config.job).inc()
        try:
            env = self._make_env(task, traj_id)
            observation = await self._reset(env, task, builder)
            builder.add_context(self.chat.initial(env.system_prompt, observation))
            spec = self.config.tags.get(task.tag)
            max_turns = (spec.max_turns if spec and spec.max_turns else None) or env.max_turns
            for turn in range(max_turns):
                result = await self.generate(task, traj_id, turn, builder)
                builder.add_generation(result)
                step = await self._step(env, self.chat.decode_action(result.token_ids), task, builder)
                builder.env_reward += step.reward
                builder.invalid_actions += int(bool(step.info.get("invalid_action")))
                if step.done:
                    builder.success = bool(step.info.get("success", step.reward > 0))
                    return self._finish(builder, env, "done")
                if turn == max_turns - 1:
                    break  # no next turn: the context ends with the last generated tokens
                continuation = self.chat.continuation(step.observation, result.token_ids)
                if len(builder.tokens) + len(continuation) + self.config.env.sampling.max_tokens > \
                        self.config.generation.max_model_len:
                    return self._finish(builder, env, "truncated")
                builder.add_context(continuation)
                if self.check_staleness is not None:
                    await self.check_staleness(builder)
            return self._finish(builder, env, "max_turns")
        except TrajectoryAborted as exc:
            return abort(task, traj_id, builder.turns, exc.reason)
        finally:
            RUNNING.labels(self.config.job).dec()

    def _finish(self, builder: TrajectoryBuilder, env, status: str) -> CompletedTrajectory:
        labels = getattr(env, "episode_labels", None)
        if callable(labels):
            builder.task = _with_labels(builder.task, labels())
        return builder.build(status)

    async def _reset(self, env, task: TaskSpec, builder: TrajectoryBuilder) -> str:
        cfg = self.config.env
        for attempt in range(cfg.reset_attempts):
            started = time.perf_counter()
            try:
                observation = await wait_for(env.reset(task.seed, task.prompt, dict(task.labels)),
                                                     cfg.reset_timeout_s)
                RESET_LATENCY.labels(self.config.job, task.tag).observe(time.perf_counter() - started)
                builder.add_time("env_reset", time.perf_counter() - started)
                return observation
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - any env failure is retried
                builder.add_time("env_reset", time.perf_counter() - started)
                log.info("%s: reset attempt %d failed: %s", builder.traj_id, attempt + 1, exc)
        raise TrajectoryAborted("env_reset_failed")

    async def _step(self, env, action: str, task: TaskSpec, builder: TrajectoryBuilder):
        started = time.perf_counter()
        try:
            return await wait_for(env.step(action), self.config.env.step_timeout_s)
        except asyncio.TimeoutError:
            raise TrajectoryAborted("env_step_timeout") from None
        except Exception as exc:  # noqa: BLE001
            log.info("%s: step failed: %s", builder.traj_id, exc)
            raise TrajectoryAborted("env_step_failed") from None
        finally:
            elapsed = time.perf_counter() - started
            STEP_LATENCY.labels(self.config.job, task.tag).observe(elapsed)
            builder.add_time("env_step", elapsed)


def abort(task: TaskSpec, traj_id: str, turn: int, reason: str) -> Abort:
    return Abort(traj_id=traj_id, turn=turn, reason=reason, group_id=task.group_id, tag=task.tag,
                 created_at=time.time())


class EnvManager:
    def __init__(self, runtime: Runtime, chat: ChatFormat, member: str):
        self.rt = runtime
        self.config: RollartConfig = runtime.config
        self.chat = chat
        self.member = member
        self.replies = ReplyChannel(runtime, ENV_ACTIONS, timeout_s=self.config.env.generation_timeout_s)
        registry = PoolRegistry(runtime.redis, prefix=self.config.redis.key_prefix, job=self.config.job)
        self.router = PoolRouter(self.config, registry)
        self.versions = VersionStore(self.config, runtime.endpoints, runtime.redis)
        self.admission = AdmissionCounters(runtime.redis, prefix=self.config.redis.key_prefix, job=self.config.job)
        self.trajectories = TrajectoryRunner(self.config, chat, self._generate, self._check_staleness)
        self.sampling = turn_sampling(self.config, chat)
        self.eval_sampling = turn_sampling(self.config, chat, evaluation=True) if self.config.eval else None
        self._version = (0, 0.0)  # (value, read at)
        self.direct = DirectClient(timeout_s=self.config.env.generation_timeout_s) \
            if self.config.generation.transport == "direct" else None
        self._retained_at = 0  # the router's refresh the direct client's sockets were last pruned at
        self.scorer = LocalScorer(chat)  # for the tags whose reward is scored_by: env

    async def close(self) -> None:
        await self.scorer.close()
        if self.direct is not None:
            await self.direct.close()

    # -- tasks: groups --------------------------------------------------------------------------

    async def handle_task(self, envelope: Envelope, ctx: MessageContext) -> None:
        task: TaskSpec = envelope.message
        completed = len((await self.run_group(task, ctx)).completed)
        if task.replaces or task.eval_version is not None:  # a replacement or an eval task: never admitted
            return
        GROUPS.labels(self.config.job, task.tag, "complete" if completed >= task.group_size else "incomplete").inc()
        if self.config.feeder.alpha is not None:  # accepted: the trainer will train it (see min_group_size)
            await self.admission.finish(groups=1, accepted=completed >= self.config.min_group_size(),
                                        group_id=task.group_id)

    async def run_group(self, task: TaskSpec, ctx: MessageContext) -> GroupEnded:
        """Run the group's trajectories (see :class:`GroupRun`)."""

        async def emit(outcome: CompletedTrajectory | Abort | GroupEnded) -> None:
            await self._emit(outcome, task, ctx)

        return await run_group(self.trajectories, task, emit)

    async def _emit(self, outcome: CompletedTrajectory | Abort | GroupEnded, task: TaskSpec,
                    ctx: MessageContext) -> None:
        """Each outcome to its topic, in the task's transaction: a trajectory this member scores (its
        tag's reward is ``scored_by: env``) and its group's end straight to the results the trainer
        (or the eval stage) reads; the rest, and every abort, to ``trajectories.completed``."""
        spec = reward_spec(self.config, task.tag)
        scored_here = spec.scored_by == "env"
        if isinstance(outcome, GroupEnded):
            topic = results_topic(outcome.eval_version) if scored_here else TRAJECTORIES_COMPLETED
            await ctx.produce(topic, outcome, key=outcome.group_id)
            return
        if isinstance(outcome, Abort):
            ABORTED.labels(self.config.job, task.tag, outcome.reason).inc()
            await ctx.produce(TRAJECTORIES_COMPLETED, outcome, key=outcome.traj_id)
            return
        COMPLETED.labels(self.config.job, task.tag, outcome.status).inc()
        TURNS.labels(self.config.job, task.tag).observe(outcome.turns)
        TRAJ_LATENCY.labels(self.config.job, task.tag).observe(outcome.timings.get("total", 0.0))
        scored = await self._score(outcome, spec) if scored_here else None
        if scored is not None:
            await ctx.produce(results_topic(outcome.eval_version), scored, key=outcome.group_id,
                              policy_version=outcome.start_version)
        else:
            await ctx.produce(TRAJECTORIES_COMPLETED, outcome, key=outcome.traj_id, policy_version=outcome.start_version)

    async def _score(self, trajectory: CompletedTrajectory, spec: RewardSpec) -> ScoredTrajectory | None:
        """The trajectory scored here, or None when its reward cannot be computed: it then goes to the
        reward stage, which dead-letters it with its reason and asks for its replacement."""
        started = time.perf_counter()
        try:
            reward, components = await self.scorer.score(trajectory, spec)
        except (RewardCallFailed, ValueError) as exc:
            log.warning("%s: not scored here (%s); the reward stage takes it", trajectory.traj_id, exc)
            return None
        count_scored(self.config.job, trajectory, spec, started)
        return scored_trajectory(trajectory, reward, components, spec)

    # -- one turn, over the bus -----------------------------------------------------------------

    async def _generate(self, task: TaskSpec, traj_id: str, turn: int, builder: TrajectoryBuilder) -> GenerationResult:
        evaluation = task.eval_version is not None  # served by the eval pool, with exactly that version
        pool = await self.router.pool_for(task.tag, wait_s=self.config.env.pool_wait_s, evaluation=evaluation)
        sampling = self.eval_sampling if evaluation else self.sampling

        def build(partition: int, attempt: int) -> GenerationRequest:
            return GenerationRequest(traj_id=traj_id, turn=turn, attempt=attempt, episode=builder.episode,
                                     group_id=task.group_id, tag=task.tag, pool=pool, prompt_ids=builder.tokens,
                                     reply_partition=partition, owner=self.member, sampling=sampling,
                                     created_at=time.time(), min_version=task.admitted_version,
                                     exact_version=task.eval_version, admitted_at=task.created_at)

        started = time.perf_counter()
        try:
            (result, arrived), transport = await self._exchange(pool, build)
        except asyncio.TimeoutError:
            raise TrajectoryAborted("generation_timeout") from None
        except NoReplyPartition:
            raise TrajectoryAborted("ownership_lost") from None
        resumed = time.perf_counter()
        TURNS_BY_TRANSPORT.labels(self.config.job, pool, transport).inc()
        builder.add_time("generation", resumed - started)
        GENERATION_OVERHEAD.labels(self.config.job, pool).observe(max(0.0, arrived - started - result.latency_s))
        RESUME_WAIT.labels(self.config.job).observe(resumed - arrived)
        return result

    async def _exchange(self, pool: str, build: Callable[[int, int], GenerationRequest]) -> tuple[Delivery, str]:
        """The turn's result and the path it took: direct to a member when one advertises it, else
        (and for what the direct path hands back) over the bus."""
        if self.direct is None:
            return await self.replies.request(build), "bus"
        if self.router.refreshes != self._retained_at:
            self._retained_at = self.router.refreshes
            await self.direct.retain(self.router.all_direct_addresses())
        attempt = 0
        addresses = self.router.direct_addresses(pool)
        if addresses:
            delivery, attempt = await self.direct.request(addresses, lambda attempt: build(0, attempt))
            if delivery is not None:
                return delivery, "direct"
        return await self.replies.request(build, first_attempt=attempt), "bus"

    async def _check_staleness(self, builder: TrajectoryBuilder) -> None:
        alpha = self.config.feeder.alpha
        start = builder.start_version
        if alpha is None or start is None or builder.task.eval_version is not None:
            return  # an eval trajectory is pinned to its version: it is meant to be "stale"
        value, read_at = self._version
        if time.monotonic() - read_at > 1.0:
            value = await self.versions.current()
            self._version = (value, time.monotonic())
        if value - start > alpha:
            raise TrajectoryAborted("stale")


Emit = Callable[[CompletedTrajectory | Abort | GroupEnded], Awaitable[None]]


class GroupRun:
    """One group's rollouts: ``group_size + redundancy`` trajectories concurrently, each outcome emitted
    as it ends. A member that ends for a fault while the rest could no longer fill the group is replaced
    (``<group>-r<k>``, at most ``feeder.max_replacements``); once ``group_size`` completed the extras are
    cancelled and emitted as redundant aborts. The last record emitted is the group's GroupEnded. A
    dead-lettered member's replacement task (``replaces``) runs the same way, its ids ``<traj>.d-<i>``."""

    def __init__(self, trajectories: TrajectoryRunner, task: TaskSpec, emit: Emit):
        self.trajectories, self.task, self.emit = trajectories, task, emit
        self.max_replacements = trajectories.config.feeder.max_replacements
        self.runners: dict[asyncio.Task, str] = {}
        self.completed: list[str] = []
        self.aborted = self.replacements = 0

    def start(self, traj_id: str) -> asyncio.Task:
        runner = asyncio.create_task(self.trajectories.run(self.task, traj_id))
        self.runners[runner] = traj_id
        return runner

    async def run(self) -> GroupEnded:
        task = self.task
        prefix = task.member_prefix()
        waiting = {self.start(f"{prefix}-{i}") for i in range(task.group_size + task.redundancy)}
        try:
            while waiting and len(self.completed) < task.group_size:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                # completions first: an abort ending at the same moment needs no replacement if they fill the group
                for runner in sorted(done, key=lambda r: isinstance(r.result(), Abort)):
                    await self.emit(self._settle(runner.result(), waiting))
            for runner in waiting:  # the group is complete: the extras are not needed
                runner.cancel()
            for runner in waiting:
                with contextlib.suppress(asyncio.CancelledError):
                    await runner
                await self.emit(abort(task, self.runners[runner], 0, "redundant"))
        except BaseException:  # revoked, shutting down, or a bug: the task is redelivered (or dead-lettered)
            for runner in self.runners:
                if not runner.done():
                    runner.cancel()
                    INTERRUPTED.labels(self.trajectories.config.job, task.tag).inc()
            raise
        ended = GroupEnded(group_id=task.group_id, tag=task.tag, completed=tuple(self.completed),
                           aborted=self.aborted, replacements=self.replacements, created_at=time.time(),
                           replaces=task.replaces, eval_version=task.eval_version)
        await self.emit(ended)
        return ended

    def _settle(self, outcome: CompletedTrajectory | Abort, waiting: set[asyncio.Task]) -> CompletedTrajectory | Abort:
        """The record to emit for a finished member; starts its replacement when the group needs one."""
        if isinstance(outcome, CompletedTrajectory):
            if len(self.completed) >= self.task.group_size:
                return abort(self.task, outcome.traj_id, outcome.turns, "redundant")
            self.completed.append(outcome.traj_id)
            return outcome
        if outcome.reason == "redundant":
            return outcome
        self.aborted += 1
        short = len(self.completed) + len(waiting) < self.task.group_size
        if outcome.reason not in REPLACEABLE or not short or self.replacements >= self.max_replacements:
            return outcome
        traj_id = f"{self.task.member_prefix()}-r{self.replacements}"
        self.replacements += 1
        waiting.add(self.start(traj_id))
        REPLACEMENTS.labels(self.trajectories.config.job, self.task.tag, outcome.reason).inc()
        return replace(outcome, replacement=traj_id)


async def run_group(trajectories: TrajectoryRunner, task: TaskSpec, emit: Emit) -> GroupEnded:
    """Run a group's rollouts (see :class:`GroupRun`); returns its GroupEnded (also emitted last)."""
    return await GroupRun(trajectories, task, emit).run()


def _with_labels(task: TaskSpec, labels: dict[str, str]) -> TaskSpec:
    return replace(task, labels={**task.labels, **labels})


async def run_env(config: RollartConfig, stop: StopRequest) -> None:
    """Run one env consumer (both loops) until ``stop`` (SIGTERM)."""
    from rollart.models.tiny import ensure_model

    member = f"env-{socket.gethostname()}-{os.getpid()}"
    chat = ChatFormat.from_pretrained(ensure_model(config.model))
    init_metrics(config)
    await run_member(config, stop, lambda rt: env_member(EnvManager(rt, chat, member)), client_id=member)


def env_member(manager: EnvManager) -> Member:
    return Member(loops=env_loops(manager.rt, manager), cleanup=[manager.close])


def env_loops(rt: Runtime, manager: EnvManager):
    """The member's two loops in stop order: (tasks → groups, env.actions → results); the task
    loop's groups wait on the results the actions loop delivers, so it drains first."""
    config = rt.config
    actions = manager.replies.consumer_loop("env-actions")
    tasks = rt.consumer_loop("env", [TASKS], manager.handle_task, ordering="none",
                             max_in_flight=config.env.max_groups, drain_timeout_s=config.env.shutdown_grace_s,
                             transactional=True)  # a group's completions commit with its task
    return tasks, actions
