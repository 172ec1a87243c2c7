"""Serverless rewards: POST one trajectory to an HTTP function, get a reward back.

Request body (JSON): ``{"traj_id", "group_id", "tag", "env", "text", "final_text", "turns", "env_reward",
"labels", "metrics"}``. Response: ``{"reward": float, "components": {name: float}}`` (components
optional). Transient failures (timeouts, connection errors, 429 and 5xx) are retried with
exponential backoff; other 4xx responses and malformed bodies fail at once. Concurrency is bounded
per endpoint. A bearer token is read from the environment variable the spec names. Plain HTTP to a
host that is not loopback is refused unless the spec allows it.
"""

from __future__ import annotations

import asyncio
import os

import aiohttp

from rollart.config import HttpReward, _reward_url_problem


class RewardCallFailed(RuntimeError):
    """The endpoint did not give a reward; ``transient`` says whether retrying could help."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


def check_url(spec: HttpReward) -> str:
    """The spec's url (HttpReward's validator refuses one that cannot be used, at config load)."""
    problem = _reward_url_problem(spec.url, spec.allow_insecure_remote)
    if problem or spec.url is None:
        raise ValueError(problem or "an http reward needs a url")
    return spec.url


class HttpRewardClient:
    def __init__(self, spec: HttpReward):
        self.spec = spec
        self.url = check_url(spec)
        self._semaphore = asyncio.Semaphore(spec.concurrency)
        self._session: aiohttp.ClientSession | None = None
        self.calls = 0  # HTTP requests sent, retries included

    def _headers(self) -> dict[str, str]:
        if not self.spec.token_env:
            return {}
        token = os.environ.get(self.spec.token_env)
        if not token:
            raise RewardCallFailed(f"environment variable {self.spec.token_env} (reward token) is not set", False)
        return {"Authorization": f"Bearer {token}"}

    async def score(self, payload: dict) -> tuple[float, dict[str, float]]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.spec.timeout_s))
        last: RewardCallFailed | None = None
        for attempt in range(self.spec.attempts):
            if attempt:
                await asyncio.sleep(self.spec.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._semaphore:
                    return await self._call(payload)
            except RewardCallFailed as exc:
                if not exc.transient:
                    raise
                last = exc
        raise RewardCallFailed(f"{self.url} failed {self.spec.attempts} times; last: {last}", False)

    async def _call(self, payload: dict) -> tuple[float, dict[str, float]]:
        headers = self._headers()
        self.calls += 1
        try:
            async with self._session.post(self.url, json=payload, headers=headers) as response:
                if response.status == 429 or response.status >= 500:
                    raise RewardCallFailed(f"HTTP {response.status}", True)
                if response.status >= 400:
                    raise RewardCallFailed(f"HTTP {response.status}: {(await response.text())[:200]}", False)
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise RewardCallFailed(f"{type(exc).__name__}: {exc}", True) from None
        except ValueError as exc:
            raise RewardCallFailed(f"response is not JSON: {exc}", False) from None
        try:
            reward = float(body["reward"])
            components = {str(k): float(v) for k, v in (body.get("components") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            raise RewardCallFailed(f"response lacks a numeric 'reward': {str(body)[:200]}", False) from None
        return reward, components

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
