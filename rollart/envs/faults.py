"""An env wrapper that injects latency (drawn from a distribution), failures and hangs.

Used by tests, benchmarks and chaos runs to make environments behave like real ones: slow, uneven,
sometimes broken. Configured per task tag in the env stage's config (``faults:``).
"""

from __future__ import annotations

import asyncio
import random

# The settings (``tags.<tag>.faults``) are validated with the rest of the config; imported from there.
from rollart.config import FaultSpec, Latency as Latency
from rollart.envs.base import Env, StepResult


class EnvFailure(RuntimeError):
    """An injected environment failure."""


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
