"""Environments for benchmarks: a fixed number of turns, optionally in lock step with a batch.

``CountdownEnv`` ends after exactly ``turns`` steps, so every trajectory of a run does the same work
and differences between runs come from how the work is scheduled. Its latency comes from the tag's
``faults`` (FaultyEnv wraps it, seeded by trajectory id: the same draws in every run of a benchmark).
With ``lockstep`` set, each step waits until every env of the batch has stepped (batched env
interaction: the slowest env of a turn holds the next generation of all of them).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from rollart.envs.base import StepResult

LOCKSTEP: dict[str, asyncio.Barrier] = {}  # name -> barrier of a batch (set by the benchmark)


def set_lockstep(name: str, parties: int) -> None:
    LOCKSTEP[name] = asyncio.Barrier(parties)


class CountdownEnv:
    system_prompt: ClassVar[str] = "Answer with one move: Left, Right, Up or Down."
    max_turns: ClassVar[int] = 64

    def __init__(self, turns: int = 4, lockstep: str | None = None, reward: float = 1.0):
        self.turns = turns
        self.lockstep = lockstep
        self.reward = reward
        self.step_no = 0

    async def reset(self, seed: int, prompt: str = "", labels: dict[str, str] | None = None) -> str:
        self.step_no = 0
        return f"You are at row {seed % 4} column 0."

    async def step(self, action: str) -> StepResult:
        if self.lockstep is not None:
            await LOCKSTEP[self.lockstep].wait()
        self.step_no += 1
        done = self.step_no >= self.turns
        return StepResult(observation=f"You are at row {self.step_no % 4} column 1.",
                          reward=self.reward if done else 0.0, done=done, info={"success": done})
