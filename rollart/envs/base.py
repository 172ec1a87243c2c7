"""The environment interface: text observations in, text actions out, one trajectory per instance.

An env is created per trajectory, reset with the task's seed (and prompt/labels for dataset tasks),
then stepped with the LLM's decoded action text until ``done``. Envs may be synchronous (subclass
:class:`TextEnv` and implement ``reset_sync``/``step_sync``) or natively async (implement
``reset``/``step``). Deterministic envs (same seed, same actions → same observations) can be rebuilt
by replaying a trajectory's actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

FORMAT_PENALTY = -0.1  # reward for an action the env cannot parse; the state does not change


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    system_prompt: ClassVar[str]
    max_turns: ClassVar[int]

    async def reset(self, seed: int, prompt: str = "", labels: dict[str, str] | None = None) -> str: ...

    async def step(self, action: str) -> StepResult: ...


class TextEnv:
    """Base for synchronous text envs; subclasses implement ``reset_sync`` and ``step_sync``."""

    system_prompt: ClassVar[str] = ""
    max_turns: ClassVar[int] = 8
    # Words that make up observations and actions: the tiny tokenizer is trained on them.
    vocabulary: ClassVar[tuple[str, ...]] = ()

    def reset_sync(self, seed: int, prompt: str = "", labels: dict[str, str] | None = None) -> str:
        raise NotImplementedError

    def step_sync(self, action: str) -> StepResult:
        raise NotImplementedError

    async def reset(self, seed: int, prompt: str = "", labels: dict[str, str] | None = None) -> str:
        return self.reset_sync(seed, prompt, labels)

    async def step(self, action: str) -> StepResult:
        return self.step_sync(action)

    @classmethod
    def sample_texts(cls, n: int = 50) -> list[str]:
        """Observations of random episodes: corpus for the tiny tokenizer."""
        import random

        rng = random.Random(0)
        texts = [cls.system_prompt, *cls.vocabulary]
        for seed in range(n):
            env = cls()
            texts.append(env.reset_sync(seed))
            for _ in range(4):
                result = env.step_sync(rng.choice(cls.vocabulary) if cls.vocabulary else "")
                texts.append(result.observation)
                if result.done:
                    break
        return texts
