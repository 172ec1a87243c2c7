"""The reward bridge: scores each completed trajectory as soon as it arrives (the trajectories of
tags whose reward is ``scored_by: env`` are scored by their env member and never come here, unless
their reward could not be computed there: then this stage dead-letters them as below).

Per task tag a :class:`RewardSpec` says how: ``env`` (the env's own rewards), ``rule`` (a local rule
such as the math answer check), ``python`` (a function by import path, :mod:`rollart.rewards.python`),
``http`` (a serverless function) or ``judge`` (an LLM judge served by a
generation pool, asked over the bus like the env stage asks for actions: the verdict comes back on a
``rewards.judge`` partition this member owns). The env reward is kept as a
component (and added, unless ``include_env_reward`` is off). A trajectory whose reward cannot be
computed (the endpoint keeps failing, a rule cannot apply) is dead-lettered with the reason and
the bridge goes on; the trainer gets an Abort (``reward_failed``) for it and, while the member's
lineage has replacements left (``feeder.max_replacements``), the env stage a replacement task. Aborts on
``trajectories.completed`` are counted and not scored; a group's GroupEnded is passed on to the trainer.
An eval trajectory (``eval_version`` set) is scored the same way and goes, with its group's end, to
``eval.results`` for the eval stage instead (a dead-lettered one is not replaced: the summary counts it).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
import os
import socket
import time
import uuid

from prometheus_client import Counter

from rollart.bus import MessageContext, PermanentError, StopRequest
from rollart.config import DEFAULT_REWARD_CONCURRENCY, ConfigError, JudgeReward, PythonReward, RewardSpec, \
    RollartConfig
from rollart.envs.math import extract_answer
from rollart.messages import REPLACEMENT_MARK, Abort, CompletedTrajectory, Envelope, GenerationRequest, GroupEnded, \
    Int32Array, SamplingParams, TaskSpec
from rollart.rewards.http import RewardCallFailed
from rollart.rewards.rules import last_turn_tokens
from rollart.rewards.scoring import SCORED, LocalScorer, count_scored, reward_spec, results_topic, scored_trajectory
from rollart.rollout.chat import ChatFormat
from rollart.rollout.replies import NoReplyPartition, ReplyChannel
from rollart.runtime import Runtime
from rollart.stages.feeder import sources_from, task_spec
from rollart.stages.runner import Member, run_member
from rollart.names import REWARDS_JUDGE, TASKS, TRAJECTORIES_COMPLETED
from rollart.timeouts import wait_for

FAILURES = Counter("rollart_reward_failures_total", "Trajectories that could not be scored", ("job", "tag", "type"))
REWARD_FAILED = "reward_failed"  # the reason of the Abort the trainer gets for a dead-lettered member
REPLACEMENTS = Counter("rollart_reward_replacements_total",
                       "Replacement rollouts released for dead-lettered trajectories", ("job", "tag"))
ABORTS_SEEN = Counter("rollart_reward_aborts_seen_total", "Aborted trajectories passed over", ("job", "tag", "reason"))

class RewardBridge:
    def __init__(self, runtime: Runtime, chat: ChatFormat):
        self.rt = runtime
        self.config: RollartConfig = runtime.config
        self.chat = chat
        self.scorer = LocalScorer(chat)
        self.sources = sources_from(self.config) if self.config.tags else []  # to rebuild a task to replace
        judges = [t.reward for t in self.config.tags.values() if isinstance(t.reward, JudgeReward)]
        self.judge = ReplyChannel(runtime, REWARDS_JUDGE, timeout_s=max(j.timeout_s for j in judges)) \
            if judges else None

    async def handle(self, envelope: Envelope, ctx: MessageContext) -> None:
        message = envelope.message
        if isinstance(message, Abort):
            ABORTS_SEEN.labels(self.config.job, message.tag, message.reason).inc()
            return
        if isinstance(message, GroupEnded):  # the trainer needs it to tell a group that will not fill
            await ctx.produce(results_topic(message.eval_version), message, key=message.group_id)
            return
        spec = reward_spec(self.config, message.tag)
        started = time.perf_counter()
        try:
            reward, components = await self.score(message, spec)
        except (RewardCallFailed, ValueError) as exc:
            FAILURES.labels(self.config.job, message.tag, spec.type).inc()
            raise PermanentError(f"{spec.type} reward for {message.tag}: {exc}", notify=self._failed(message)) from None
        count_scored(self.config.job, message, spec, started)
        await ctx.produce(results_topic(message.eval_version), scored_trajectory(message, reward, components, spec),
                          key=message.group_id, policy_version=message.start_version)

    def _failed(self, trajectory: CompletedTrajectory) -> list[tuple[str, object, str]]:
        """What goes out with a dead-lettered trajectory: an Abort telling the trainer (so its group need
        not wait for it) and, while its lineage has replacements left, a replacement task on ``tasks``
        (the same task, one rollout) that the Abort names; both in this input's transaction."""
        task = replacement_task(self.config, self.sources, trajectory) if trajectory.eval_version is None else None
        failed = Abort(traj_id=trajectory.traj_id, turn=trajectory.turns, reason=REWARD_FAILED,
                       group_id=trajectory.group_id, tag=trajectory.tag, created_at=time.time(),
                       replacement=f"{task.member_prefix()}-0" if task else "")
        if task is not None:
            REPLACEMENTS.labels(self.config.job, trajectory.tag).inc()
        return [(results_topic(trajectory.eval_version), failed, trajectory.group_id),
                *([(TASKS, task, task.group_id)] if task is not None else [])]

    async def score(self, trajectory: CompletedTrajectory, spec: RewardSpec) -> tuple[float, dict[str, float]]:
        if not isinstance(spec, JudgeReward):
            return await self.scorer.score(trajectory, spec)
        components = {"env": trajectory.env_reward, **await self._judge(trajectory, spec)}
        return components["judge"] + (trajectory.env_reward if spec.include_env_reward else 0.0), components

    async def _judge(self, trajectory: CompletedTrajectory, spec: JudgeReward) -> dict[str, float]:
        """Ask the judge pool for a 0..1 score of the final answer; unparseable verdicts score 0."""
        prompt = spec.judge_prompt.format(question=trajectory.labels.get("question", ""), text=self.chat.decode(
            trajectory.token_ids), final_text=self.chat.decode_action(last_turn_tokens(trajectory)))
        prompt_ids = Int32Array(self.chat.initial("", prompt))
        episode = uuid.uuid4().hex[:12]
        sampling = SamplingParams(temperature=0.0, max_tokens=spec.judge_max_tokens,
                                  stop_token_ids=self.chat.stop_token_ids)

        def build(partition: int, attempt: int) -> GenerationRequest:
            return GenerationRequest(traj_id=trajectory.traj_id, turn=0, attempt=attempt, episode=episode,
                                     group_id=trajectory.group_id, tag=trajectory.tag, pool=spec.pool,
                                     prompt_ids=prompt_ids, reply_partition=partition, reply_topic=REWARDS_JUDGE,
                                     sampling=sampling, created_at=time.time())

        try:
            verdict = (await wait_for(self.judge.request(build), spec.timeout_s)).result
        except (asyncio.TimeoutError, NoReplyPartition) as exc:
            raise RewardCallFailed(f"judge pool {spec.pool} gave no verdict: {type(exc).__name__}", False) from None
        score = extract_answer(self.chat.decode_action(verdict.token_ids))
        try:
            return {"judge": min(1.0, max(0.0, float(score))), "judge_unparsed": 0.0}
        except (TypeError, ValueError):
            return {"judge": 0.0, "judge_unparsed": 1.0}

    async def close(self) -> None:
        await self.scorer.close()


def replacement_task(config: RollartConfig, sources, trajectory: CompletedTrajectory) -> TaskSpec | None:
    """The task that replaces a dead-lettered trajectory: its group's task (a pure function of the
    feeder's seed and the group number) with one rollout; None once its lineage used
    ``feeder.max_replacements``, or for a group the feeder did not release (no ``<job>-g<n>`` id)."""
    prefix = f"{config.job}-g"
    number = trajectory.group_id[len(prefix):]
    if not sources or not trajectory.group_id.startswith(prefix) or not number.isdigit() \
            or trajectory.traj_id.count(REPLACEMENT_MARK) >= config.feeder.max_replacements:
        return None
    task = task_spec(config, sources, int(number))
    return replace(task, group_size=1, redundancy=0, replaces=trajectory.traj_id,
                   admitted_version=trajectory.start_version, created_at=time.time())


def reward_loops(rt: Runtime, bridge: RewardBridge):
    """(the scoring loop, the judge-verdict loop or None when no tag uses an LLM judge)."""
    # Enough in flight that every tag's endpoint can use its whole concurrency at once.
    config = rt.config
    in_flight = sum(max(getattr(s.reward, "concurrency", DEFAULT_REWARD_CONCURRENCY), 1)
                    for s in config.tags.values()) or DEFAULT_REWARD_CONCURRENCY
    scoring = rt.consumer_loop("reward", [TRAJECTORIES_COMPLETED], bridge.handle, ordering="none",
                               max_in_flight=in_flight, transactional=True)
    return scoring, bridge.judge.consumer_loop("reward-judge") if bridge.judge is not None else None


def check_rewards(config: RollartConfig) -> None:
    """Fail at start-up, naming the tag, not on the first trajectory: a python reward's import (the
    function is loaded here, so an import error says which tag). An http reward's url is checked
    where the config is validated (HttpReward)."""
    from rollart.rewards.python import load_reward_function

    for tag, spec in config.tags.items():
        try:
            if isinstance(spec.reward, PythonReward):
                load_reward_function(spec.reward.function)
        except ValueError as exc:
            raise ConfigError(f"tags.{tag}.reward: {exc}") from None


async def run_reward(config: RollartConfig, stop: StopRequest) -> None:
    from rollart.models.tiny import ensure_model

    check_rewards(config)
    member = f"reward-{socket.gethostname()}-{os.getpid()}"
    for tag, spec in config.tags.items():  # series at 0 from the start (no failures yet, not no data)
        FAILURES.labels(config.job, tag, spec.reward.type)
        SCORED.labels(config.job, tag)
    chat = ChatFormat.from_pretrained(ensure_model(config.model))
    await run_member(config, stop, lambda rt: reward_member(RewardBridge(rt, chat)), client_id=member)


def reward_member(bridge: RewardBridge) -> Member:
    """The scoring loop, then (when a tag uses an LLM judge) the verdict loop its judged handlers wait on."""
    scoring, verdicts = reward_loops(bridge.rt, bridge)
    return Member(loops=[scoring, *([verdicts] if verdicts is not None else [])], cleanup=[bridge.close])
