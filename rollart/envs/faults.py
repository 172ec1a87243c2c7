"""An env wrapper that injects latency (drawn from a distribution), failures and hangs.

Used by tests, benchmarks and chaos runs to make environments behave like real ones: slow, uneven,
sometimes broken. Configured per task tag in the env stage's config (``faults:``).
"""

from __future__ import annotations

import asyncio
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollart.envs.base import Env, StepResult


class EnvFailure(RuntimeError):
    """An injected environment failure."""


class Latency(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dist: Literal["fixed", "gaussian", "exponential"] = "fixed"
    mean_s: float = Field(default=0.0, ge=0)
    sigma_s: float = Field(default=0.0, ge=0)

    def draw(self, rng: random.Random) -> float:
        if self.mean_s == 0:
            return 0.0
        if self.dist == "gaussian":
            return max(0.0, rng.gauss(self.mean_s, self.sigma_s))
        if self.dist == "exponential":
            return rng.expovariate(1 / self.mean_s)
        return self.mean_s


class FaultSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reset_latency: Latency = Latency()
    step_latency: Latency = Latency()
    reset_failure_rate: float = Field(default=0.0, ge=0, le=1)
    step_failure_rate: float = Field(default=0.0, ge=0, le=1)
    hang_rate: float = Field(default=0.0, ge=0, le=1)  # a step that never returns (until a timeout)
    # A straggler: a step that takes straggler_latency on top of step_latency (a slow machine, a
    # cold cache, a contended sandbox).
    straggler_rate: float = Field(default=0.0, ge=0, le=1)
    straggler_latency: Latency = Latency()


class FaultyEnv:
    """Wraps an env; ``rng_seed`` makes the injected faults reproducible."""

    def __init__(self, inner: Env, spec: FaultSpec, rng_seed: int | None = None):
        self.inner = inner
        self.spec = spec
        self.rng = random.Random(rng_seed)
        self.system_prompt = inner.system_prompt
        self.max_turns = inner.max_turns

    async def reset(self, seed: int, prompt: str = "", labels: dict[str, str] | None = None) -> str:
        await asyncio.sleep(self.spec.reset_latency.draw(self.rng))
        if self.rng.random() < self.spec.reset_failure_rate:
            raise EnvFailure("injected reset failure")
        return await self.inner.reset(seed, prompt, labels)

    async def step(self, action: str) -> StepResult:
        if self.rng.random() < self.spec.hang_rate:
            await asyncio.Event().wait()  # hangs until the caller's timeout cancels it
        delay = self.spec.step_latency.draw(self.rng)
        if self.spec.straggler_rate and self.rng.random() < self.spec.straggler_rate:  # no draw when off: same sequence as before
            delay += self.spec.straggler_latency.draw(self.rng)
        await asyncio.sleep(delay)
        if self.rng.random() < self.spec.step_failure_rate:
            raise EnvFailure("injected step failure")
        return await self.inner.step(action)
