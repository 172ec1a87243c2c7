"""Reward functions the Python-reward tests load by import path (``tests.rewards.python_rewards:...``)."""

from __future__ import annotations

import asyncio
import threading
import time

running = {"now": 0, "most": 0}
_lock = threading.Lock()


def by_answer(sample) -> float:
    """1 when the dataset's answer is in the final text, else the share of turns left (a number)."""
    return 1.0 if sample.labels.get("answer") and sample.labels["answer"] in sample.final_text else 1 / sample.turns


async def async_components(sample) -> dict:
    await asyncio.sleep(0)
    return {"length": len(sample.token_ids) / 100, "bonus": 0.5}


def raises(sample) -> float:
    raise RuntimeError(f"cannot judge {sample.traj_id}")


def not_a_number(sample):
    return "high"


def nan(sample) -> float:
    return float("nan")


def slow(sample) -> float:
    """Counts how many calls overlap (the concurrency bound), then sleeps past the tests' timeout."""
    with _lock:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
    try:
        time.sleep(0.6)
        return 1.0
    finally:
        with _lock:
            running["now"] -= 1


async def hangs(sample) -> float:
    await asyncio.sleep(60)
    return 1.0


NOT_CALLABLE = 3
