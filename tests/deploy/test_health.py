"""The probes the manifests point at: /healthz fails when a work loop stalls, /readyz until one polls."""

from __future__ import annotations

import urllib.error
import urllib.request

from rollart.health import Health
from rollart.metrics import serve_metrics


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_probes_follow_the_work_loops():
    clock = Clock()
    health = Health(stall_s=60, clock=clock)
    port = serve_metrics(0, "127.0.0.1", health=health)
    assert probe(port, "/healthz")[0] == 200  # starting up (e.g. loading a model) is alive
    assert probe(port, "/readyz") == (503, "no work loop has started\n")
    health.beat("env")
    health.beat("env-actions")
    assert probe(port, "/readyz") == (200, "ok: env, env-actions\n")
    clock.now += 45  # env-actions keeps polling, env is stuck
    health.beat("env-actions")
    assert probe(port, "/readyz")[0] == 503 and probe(port, "/healthz")[0] == 200
    clock.now += 20
    code, body = probe(port, "/healthz")
    assert code == 503 and "env (65s)" in body and "env-actions" not in body
    health.forget("env")  # a loop that stopped on purpose
    assert probe(port, "/healthz")[0] == 200
    status, text = probe(port, "/metrics")
    assert status == 200 and "rollart_bus_messages_processed_total" in text


async def test_a_running_consumer_loop_makes_the_process_ready(runtime):
    from rollart.health import HEALTH

    async def handler(envelope):
        return None

    loop = runtime.consumer_loop("probe-test", ["tasks"], handler)
    import asyncio

    task = asyncio.create_task(loop.run())
    try:
        await loop.wait_started()
        for _ in range(100):
            if "probe-test" in HEALTH.ages():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        assert HEALTH.ages()["probe-test"] < 0.5, "the loop beats on every poll"
    finally:
        loop.stop()
        await task
    assert "probe-test" not in HEALTH.ages(), "a stopped loop is no longer watched"
