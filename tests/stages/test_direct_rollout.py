"""The rollout stages with ``generation.transport: direct``: turns go from the env stage to the
generation member over its ZeroMQ socket, on the real vLLM engine (CPU), broker and Redis."""

from __future__ import annotations

import pytest

from rollart.bus.reader import read_to_end
from rollart.stages.env import GENERATION_OVERHEAD, RESUME_WAIT, TURNS_BY_TRANSPORT

GRID = {"env": "frozenlake", "reward": {"type": "env"}}
DIRECT = {"transport": "direct"}


def observed(histogram) -> float:
    return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))


def turns(harness, transport: str) -> float:
    return TURNS_BY_TRANSPORT.labels(harness.config.job, "p1", transport)._value.get()


async def requests_on_the_bus(harness) -> int:
    return len([r async for r in read_to_end(harness.config, harness.rt.endpoints,
                                             f"{harness.config.job}.gen.requests.p1")])


@pytest.mark.rollout(tags={"frozenlake": GRID}, generation=DIRECT)
async def test_turns_go_direct_and_trajectories_are_recorded_as_over_the_bus(harness, chat):
    job = harness.config.job
    await harness.submit("d1", "frozenlake", group_size=3, seed=1)
    await harness.wait_groups({"d1": 3})
    trajectories = [harness.completed[t] for t in harness.ended("d1")["completed"]]
    assert len(trajectories) == 3
    assert turns(harness, "direct") == sum(t.turns for t in trajectories)
    # every turn's time split: the transport's and member's tax, then the env member's own wait to resume
    overhead, resume = observed(GENERATION_OVERHEAD.labels(job, "p1")), observed(RESUME_WAIT.labels(job))
    assert overhead == resume == sum(t.turns for t in trajectories)
    assert turns(harness, "bus") == 0 and await requests_on_the_bus(harness) == 0
    for t in trajectories:  # the durable record is the same: tokens, logprobs and versions of every turn
        generated = [i for i, m in enumerate(t.loss_mask) if m]
        assert generated and all(t.versions[i] == 0 and t.logprobs[i] < 0 for i in generated)
        assert chat.decode(t.token_ids).count("<|im_start|>assistant") == t.turns


@pytest.mark.rollout(tags={"frozenlake": GRID}, generation=DIRECT)
async def test_a_member_whose_direct_socket_is_gone_is_reached_over_the_bus(harness):
    await harness.submit("before", "frozenlake", group_size=2, seed=2)
    await harness.wait_groups({"before": 2})
    assert turns(harness, "direct") > 0

    _, _, direct, serving = harness.generation["p1"]
    direct.stop()  # the socket closes; the member still advertises it and consumes its bus topic
    await serving
    await harness.submit("after", "frozenlake", group_size=2, seed=3)
    await harness.wait_groups({"after": 2}, timeout=90)
    after = [harness.completed[t] for t in harness.ended("after")["completed"]]
    assert len(after) == 2, harness.ended("after")
    assert turns(harness, "bus") >= sum(t.turns for t in after)
    assert await requests_on_the_bus(harness) >= sum(t.turns for t in after)


@pytest.mark.rollout(tags={"frozenlake": GRID}, generation=DIRECT, env={"colocate_pool": "p1"})
async def test_a_colocated_env_member_calls_its_generation_member_without_a_socket(harness, chat):
    """As ``rollart consume envgen`` composes them (env.colocate_pool): the same turns, the same record,
    and no connection: the member's server was called as a function."""
    await harness.submit("c1", "frozenlake", group_size=3, seed=1)
    await harness.wait_groups({"c1": 3})
    trajectories = [harness.completed[t] for t in harness.ended("c1")["completed"]]
    assert len(trajectories) == 3
    assert turns(harness, "direct") == sum(t.turns for t in trajectories)
    assert turns(harness, "bus") == 0 and await requests_on_the_bus(harness) == 0
    assert harness.manager.direct.peers == {}, "a socket was opened to the member in this process"
    for t in trajectories:
        generated = [i for i, m in enumerate(t.loss_mask) if m]
        assert generated and all(t.versions[i] == 0 and t.logprobs[i] < 0 for i in generated)
        assert chat.decode(t.token_ids).count("<|im_start|>assistant") == t.turns
