"""Scoring a completed trajectory where it is: the env's own reward, a local rule, a Python function or
an HTTP function.

The env member scores the tags whose reward is ``scored_by: env`` as each trajectory completes; the
reward bridge scores the rest (and asks an LLM judge over the bus itself); the in-process loop of
``rollart bench time-to-quality`` scores with it directly: all three compute the same rewards.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from rollart.config import EnvReward, HttpReward, PythonReward as PythonRewardSpec, RewardSpec, RollartConfig, \
    RuleReward
from rollart.messages import CompletedTrajectory, ScoredTrajectory
from rollart.names import EVAL_RESULTS, REWARDS_RESULTS
from rollart.rewards.http import HttpRewardClient
from rollart.rewards.python import PythonReward, RewardInput
from rollart.rewards.rules import RULES, last_turn_tokens

DEFAULT_SPEC = EnvReward()
# Served by whichever process scores (a reward member, or an env member for ``scored_by: env``).
LATENCY = Histogram("rollart_reward_latency_seconds", "Time to score one trajectory", ("job", "tag", "type"),
                    buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30))
SCORED = Counter("rollart_reward_scored_total", "Trajectories scored", ("job", "tag"))


def reward_spec(config: RollartConfig, tag: str) -> RewardSpec:
    spec = config.tags.get(tag)
    return spec.reward if spec is not None else DEFAULT_SPEC


def results_topic(eval_version: int | None) -> str:
    """Scores of eval trajectories go to the eval stage, never to the trainer."""
    return REWARDS_RESULTS if eval_version is None else EVAL_RESULTS


def count_scored(job: str, trajectory: CompletedTrajectory, spec: RewardSpec, started: float) -> None:
    """The scoring metrics of one trajectory scored since ``started`` (``time.perf_counter``)."""
    LATENCY.labels(job, trajectory.tag, spec.type).observe(time.perf_counter() - started)
    SCORED.labels(job, trajectory.tag).inc()


def scored_trajectory(trajectory: CompletedTrajectory, reward: float, components: dict[str, float],
                      spec: RewardSpec) -> ScoredTrajectory:
    scorer = f"rule:{spec.rule}" if isinstance(spec, RuleReward) else \
        f"python:{spec.function}" if isinstance(spec, PythonRewardSpec) else spec.type
    return ScoredTrajectory(trajectory=trajectory, reward=reward, reward_components=components, scorer=scorer,
                            scored_at=time.time())


class LocalScorer:
    """``env``, ``rule``, ``python`` and ``http`` rewards (one HTTP client or loaded function per tag, kept)."""

    def __init__(self, chat):
        self.chat = chat
        self._http: dict[str, HttpRewardClient] = {}
        self._python: dict[tuple[str, str], PythonReward] = {}  # (tag, function)

    async def score(self, trajectory: CompletedTrajectory, spec: RewardSpec) -> tuple[float, dict[str, float]]:
        """``(reward, components)``; the env reward is always a component, and part of the reward for
        ``env`` or when ``include_env_reward``. Raises RewardCallFailed or ValueError when it cannot."""
        components = {"env": trajectory.env_reward}
        env_part = trajectory.env_reward if isinstance(spec, EnvReward) or spec.include_env_reward else 0.0
        if isinstance(spec, RuleReward):
            final_text = self.chat.decode_action(last_turn_tokens(trajectory))
            components.update(RULES[spec.rule](trajectory, final_text, format_penalty=spec.format_penalty))
        elif isinstance(spec, HttpReward):
            reward, extra = await self._client(trajectory.tag, spec).score(self.payload(trajectory))
            components.update(extra)
            components["http"] = reward
            return reward + (trajectory.env_reward if spec.include_env_reward else 0.0), components
        elif isinstance(spec, PythonRewardSpec):
            reward, extra = await self._function(trajectory.tag, spec).score(self.reward_input(trajectory))
            components.update(extra)
            return reward + (trajectory.env_reward if spec.include_env_reward else 0.0), components
        elif not isinstance(spec, EnvReward):
            raise ValueError(f"reward type {spec.type!r} needs the bus (an LLM judge is a generation pool)")
        return sum(v for k, v in components.items() if k != "env") + env_part, components

    def _client(self, tag: str, spec: HttpReward) -> HttpRewardClient:
        if tag not in self._http:
            self._http[tag] = HttpRewardClient(spec)
        return self._http[tag]

    def _function(self, tag: str, spec: PythonRewardSpec) -> PythonReward:
        key = (tag, spec.function)
        if key not in self._python:
            self._python[key] = PythonReward(spec)
        return self._python[key]

    def reward_input(self, trajectory: CompletedTrajectory) -> RewardInput:
        return RewardInput(traj_id=trajectory.traj_id, group_id=trajectory.group_id, tag=trajectory.tag,
                           env=trajectory.env, text=self.chat.decode(trajectory.token_ids),
                           final_text=self.chat.decode_action(last_turn_tokens(trajectory)),
                           token_ids=tuple(int(t) for t in trajectory.token_ids), turns=trajectory.turns,
                           env_reward=trajectory.env_reward, labels=dict(trajectory.labels),
                           metrics=dict(trajectory.metrics), trajectory=trajectory)

    def payload(self, trajectory: CompletedTrajectory) -> dict:
        return {
            "traj_id": trajectory.traj_id, "group_id": trajectory.group_id, "tag": trajectory.tag,
            "env": trajectory.env, "text": self.chat.decode(trajectory.token_ids),
            "final_text": self.chat.decode_action(last_turn_tokens(trajectory)), "turns": trajectory.turns,
            "env_reward": trajectory.env_reward, "labels": dict(trajectory.labels),
            "metrics": dict(trajectory.metrics),
        }

    async def close(self) -> None:
        for client in self._http.values():
            await client.close()
        for function in self._python.values():
            function.close()
