"""A flaky serverless reward endpoint for chaos runs: it passes the env's reward through (so the
policy can still learn) and fails or stalls on purpose."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from aiohttp import web

from rollart.local.http_server import serve_post


@dataclass
class FlakyRewardServer:
    transient_rate: float = 0.0  # 503: the bridge retries
    permanent_rate: float = 0.0  # 400: the bridge dead-letters the trajectory
    slow_rate: float = 0.0
    slow_s: float = 1.0
    seed: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "transient": 0, "permanent": 0, "slow": 0})

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def score(self, request: web.Request) -> web.Response:
        body = await request.json()
        draw = self.rng.random()
        if draw < self.transient_rate:
            self.counts["transient"] += 1
            return web.Response(status=503, text="injected outage")
        if draw < self.transient_rate + self.permanent_rate:
            self.counts["permanent"] += 1
            return web.json_response({"error": "injected bad request"}, status=400)
        if self.rng.random() < self.slow_rate:
            self.counts["slow"] += 1
            await asyncio.sleep(self.slow_s)
        self.counts["ok"] += 1
        return web.json_response({"reward": float(body.get("env_reward", 0.0))})

    async def start(self) -> str:
        self.runner, self.url = await serve_post(self.score)
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
