"""An in-process rollout (rollart.bench.harness): one real vLLM engine (CPU) shared by the session,
real broker and Redis; tests submit task groups and watch every outcome on the topics.
"""

from __future__ import annotations

import pytest

from rollart.bench.harness import RolloutHarness
from rollart.runtime import open_runtime
from rollart.topics import expand_catalog
from rollart.topics.admin import apply_topics
from tests.conftest import make_config


@pytest.fixture
async def harness(endpoints, engine, chat, tiny_model, request):
    marker = request.node.get_closest_marker("rollout")
    options = dict(marker.kwargs) if marker else {}
    pools = options.pop("pools", ["p1"])
    started_pools = options.pop("start_pools", pools)
    generation = {"heartbeat_ttl_s": 1.0, **options.pop("generation", {})}
    config = make_config(endpoints, pools=pools, model={"path": str(tiny_model), "init_tiny": False},
                         generation=generation, routing={"live_check_interval_s": 0.2},
                         feeder={"alpha": None}, **options)
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        harness = RolloutHarness(config, rt, engine, chat)
        await harness.start(started_pools)
        yield harness
        await harness.close()
