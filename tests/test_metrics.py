"""Every process serves /metrics; the bus exports processed, failed, DLQ, dedup, latency and lag."""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from rollart.messages import TaskSpec
from rollart.messages.codec import H_SCHEMA
from rollart.metrics import serve_metrics
from tests.conftest import eventually


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float | None:
    for (sample_name, sample_labels), v in samples.items():
        if sample_name == name and all((k, val) in sample_labels for k, val in labels.items()):
            return v
    return None


async def test_bus_metrics_are_served(runtime, loops):
    port = serve_metrics(0, "127.0.0.1")
    job = runtime.config.job
    gate = asyncio.Event()
    handled = []

    async def handle(envelope, ctx) -> None:
        if envelope.message.group_id == "g5":
            await gate.wait()  # hold the watermark at offset 5
        handled.append(envelope.message.group_id)

    for i in range(20):
        await runtime.producer.send_and_wait("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                             key="one-partition")
    await runtime.producer.send_and_wait("tasks", TaskSpec(group_id="g0", env="e", tag="t", group_size=1),
                                         key="one-partition")  # a duplicate id
    await (await runtime.producer.send_raw(f"{job}.tasks", b"junk", key=b"one-partition",
                                           headers=[(H_SCHEMA, b"TaskSpec/1.0")]))
    await loops.start(runtime.consumer_loop("env", ["tasks"], handle))

    lag = lambda: value(scrape(port), "rollart_bus_consumer_lag_messages", job=job, group="env", topic="tasks")  # noqa
    await eventually(lambda: lag() == 22 - 5, what="lag = 22 records - 5 committed while g5 is held")
    gate.set()
    await eventually(lambda: lag() == 0, what="lag back to 0")

    samples = scrape(port)
    labels = {"job": job, "group": "env", "topic": "tasks"}
    assert value(samples, "rollart_bus_messages_processed_total", **labels) == 20
    assert value(samples, "rollart_bus_messages_deduplicated_total", **labels) == 1
    assert value(samples, "rollart_bus_messages_dead_lettered_total", **labels) == 1
    assert value(samples, "rollart_bus_messages_failed_total", reason="decode", **labels) == 1
    assert value(samples, "rollart_bus_handler_latency_seconds_count", **labels) == 22
    assert value(samples, "rollart_bus_messages_produced_total", job=job, topic=f"{job}.tasks") >= 21
    assert value(samples, "rollart_bus_last_poll_timestamp_seconds", job=job, group="env") > 0
