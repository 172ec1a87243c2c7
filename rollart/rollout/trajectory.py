"""Accumulates one trajectory's token stream, loss mask, logprobs and versions turn by turn."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from rollart.messages import CompletedTrajectory, Float32Array, GenerationResult, Int32Array, TaskSpec, UInt8Array


@dataclass
class TrajectoryBuilder:
    traj_id: str
    task: TaskSpec
    tokens: Int32Array = field(default_factory=Int32Array)
    mask: UInt8Array = field(default_factory=UInt8Array)
    logprobs: Float32Array = field(default_factory=Float32Array)
    versions: Int32Array = field(default_factory=Int32Array)
    prompt_len: int = 0
    turns: int = 0
    env_reward: float = 0.0
    invalid_actions: int = 0
    success: bool = False
    started: float = field(default_factory=time.perf_counter)
    episode: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # this run of the trajectory
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def add_context(self, token_ids: list[int]) -> None:
        """Prompt or environment tokens: in the context, not trained on."""
        if not self.tokens:
            self.prompt_len = len(token_ids)
        self.tokens.extend(token_ids)
        self.mask.extend([0] * len(token_ids))
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([-1] * len(token_ids))

    def add_generation(self, result: GenerationResult) -> None:
        self.tokens.extend(result.token_ids)
        self.mask.extend([1] * len(result.token_ids))
        self.logprobs.extend(result.logprobs)
        self.versions.extend(result.versions)
        self.turns += 1

    def add_time(self, what: str, seconds: float) -> None:
        self.timings[what] += seconds

    @property
    def start_version(self) -> int | None:
        for mask, version in zip(self.mask, self.versions):
            if mask:
                return version
        return None

    def build(self, status: str) -> CompletedTrajectory:
        generated = [v for m, v in zip(self.mask, self.versions) if m]
        timings = dict(self.timings)
        timings["total"] = time.perf_counter() - self.started
        return CompletedTrajectory(
            traj_id=self.traj_id, group_id=self.task.group_id, tag=self.task.tag, env=self.task.env,
            token_ids=self.tokens, loss_mask=self.mask, logprobs=self.logprobs, versions=self.versions,
            prompt_len=self.prompt_len, turns=self.turns, env_reward=self.env_reward, status=status,
            seed=self.task.seed, start_version=min(generated, default=0), end_version=max(generated, default=0),
            metrics={"success": float(self.success), "invalid_actions": float(self.invalid_actions)},
            timings=timings, labels=dict(self.task.labels), eval_version=self.task.eval_version,
        )
