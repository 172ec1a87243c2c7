"""Python reward functions: ``reward: {type: python, function: "package.module:fn"}``.

The function takes one :class:`RewardInput` (the trajectory's text, final answer, tokens, labels, env
reward and metrics) and returns a number, or a mapping of named components (the reward is their sum).
It may be a plain function or a coroutine function. A plain one runs on a thread of its own (a slow
scorer does not hold up the stage's event loop), at most ``concurrency`` at a time per tag; a call past
``timeout_s``, an exception, or anything but a finite number is a failed reward: the trajectory is
dead-lettered with the reason, as an HTTP reward's would be. Not retried: a function that raised
once on a trajectory raises again (a flaky service belongs behind ``type: http``, which retries).

A timed-out plain function cannot be stopped (Python threads cannot be killed): it keeps its
concurrency slot until it returns, so a scorer that hangs for good slows its tag to a halt rather
than piling up threads without bound.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from rollart.config import PythonReward as PythonRewardSpec
from rollart.imports import import_by_path
from rollart.messages import CompletedTrajectory
from rollart.rewards.http import RewardCallFailed
from rollart.timeouts import wait_for


@dataclass(frozen=True)
class RewardInput:
    """What a Python reward function is given (the HTTP reward's request body, as attributes)."""

    traj_id: str
    group_id: str
    tag: str
    env: str
    text: str  # the whole conversation, decoded
    final_text: str  # the last action, decoded
    token_ids: tuple[int, ...]
    turns: int
    env_reward: float
    labels: dict[str, str] = field(default_factory=dict)  # e.g. the dataset's answer
    metrics: dict[str, float] = field(default_factory=dict)
    trajectory: CompletedTrajectory | None = None  # everything else (logprobs, versions, ...)


def load_reward_function(path: str) -> Callable[[RewardInput], Any]:
    """The callable at ``package.module:fn``; ValueError naming the path if it cannot be imported."""
    fn = import_by_path(path, "reward function")
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is a {type(fn).__name__}, not a callable")
    return fn


def reward_value(path: str, result: Any) -> tuple[float, dict[str, float]]:
    """``(reward, components)`` from what the function returned; ValueError if it is not a number
    or a mapping of names to numbers (finite ones: a NaN reward would poison a whole batch)."""
    if isinstance(result, Mapping):
        if not result:
            raise ValueError(f"python reward {path} returned an empty mapping")
        if "env" in result:
            raise ValueError(f"python reward {path}: component name 'env' is reserved for the env reward")
        components = {str(name): _finite(path, value, f"component {name!r}") for name, value in result.items()}
        return sum(components.values()), components
    value = _finite(path, result, "reward")
    return value, {"python": value}


def _finite(path: str, value: Any, what: str) -> float:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    raise ValueError(f"python reward {path} returned {what} {value!r}: expected a finite number")


class PythonReward:
    """One tag's Python reward function, called with bounded concurrency and a timeout."""

    def __init__(self, spec: PythonRewardSpec):
        self.spec = spec
        self.path = spec.function
        self.fn = load_reward_function(spec.function)
        self.is_async = inspect.iscoroutinefunction(self.fn)
        self._slots = asyncio.Semaphore(spec.concurrency)
        self._threads = None if self.is_async else ThreadPoolExecutor(spec.concurrency,
                                                                      thread_name_prefix="python-reward")

    async def score(self, sample: RewardInput) -> tuple[float, dict[str, float]]:
        """``(reward, components)``; RewardCallFailed if the function raised or timed out, ValueError
        if it returned something that is not a reward."""
        await self._slots.acquire()
        try:
            result = await (self._call_async(sample) if self.is_async else self._call_in_thread(sample))
        except asyncio.TimeoutError:
            raise RewardCallFailed(f"python reward {self.path} took longer than {self.spec.timeout_s}s", False) \
                from None
        except Exception as exc:  # noqa: BLE001 - the user's code: any error fails this trajectory only
            raise RewardCallFailed(f"python reward {self.path} raised {type(exc).__name__}: {exc}", False) from None
        return reward_value(self.path, result)

    async def _call_async(self, sample: RewardInput) -> Any:
        try:
            return await wait_for(self.fn(sample), self.spec.timeout_s)
        finally:
            self._slots.release()

    async def _call_in_thread(self, sample: RewardInput) -> Any:
        future = asyncio.get_running_loop().run_in_executor(self._threads, self.fn, sample)
        future.add_done_callback(self._thread_done)
        return await wait_for(asyncio.shield(future), self.spec.timeout_s)

    def _thread_done(self, future: asyncio.Future) -> None:
        """The slot is held until the thread is free; a late outcome (after a timeout) is dropped."""
        if not future.cancelled():
            future.exception()  # retrieved: not logged as "never retrieved" when nobody awaits it
        self._slots.release()

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
