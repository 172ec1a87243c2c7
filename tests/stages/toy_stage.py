"""A toy stage for the registry test: what adding a stage takes (a runner and one registry entry)."""

from __future__ import annotations

RAN: list[str] = []


async def run_toy(config, stop) -> None:
    RAN.append(config.job)
