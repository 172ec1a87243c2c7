"""The rollout stages in one process on the real broker, Redis and vLLM (CPU)."""

from __future__ import annotations

import asyncio

import pytest

from rollart.envs import FORMAT_PENALTY
from rollart.rollout.routing import FALLBACKS
from tests.conftest import eventually

GRID = {"env": "frozenlake", "reward": {"type": "env"}}
MATH = {"env": "math", "reward": {"type": "rule", "rule": "math_answer", "include_env_reward": False}}


@pytest.mark.rollout(tags={"frozenlake": GRID, "math": MATH})
async def test_groups_complete_scored_with_loss_mask_on_llm_tokens_only(harness, chat):
    await harness.submit("fl", "frozenlake", group_size=3, seed=1)
    await harness.submit("m", "math", group_size=2, seed=2)
    await harness.wait_groups({"fl": 3, "m": 2})
    await eventually(lambda: len(harness.scored) == 5, what="5 scored trajectories")
    for scored in harness.scored.values():
        t = scored.trajectory
        assert t.turns >= 1 and len(t.token_ids) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        generated = [i for i, m in enumerate(t.loss_mask) if m]
        assert generated and min(generated) >= t.prompt_len, "the prompt is never trained on"
        assert all(t.versions[i] == 0 for i in generated) and all(t.logprobs[i] < 0 for i in generated)
        assert all(t.versions[i] == -1 and t.logprobs[i] == 0 for i, m in enumerate(t.loss_mask) if not m)
        text = chat.decode(t.token_ids)
        assert text.count("<|im_start|>assistant") == t.turns, "one assistant header per LLM turn"
    math = [s for s in harness.scored.values() if s.trajectory.tag == "math"]
    assert all("answer" in s.reward_components and "answer" in s.trajectory.labels for s in math)


@pytest.mark.rollout(tags={"frozenlake": GRID})
async def test_malformed_actions_get_the_format_penalty_not_a_crash(harness):
    # A random tiny model mostly emits text with no move in it: each such step costs the penalty.
    await harness.submit("bad", "frozenlake", group_size=4, seed=3)
    await harness.wait_groups({"bad": 4})
    trajectories = [harness.completed[t] for t in harness.ended("bad")["completed"]]
    assert len(trajectories) == 4
    invalid = sum(t.metrics["invalid_actions"] for t in trajectories)
    assert invalid > 0
    for t in trajectories:
        assert t.env_reward <= FORMAT_PENALTY * t.metrics["invalid_actions"] + 1.0 + 1e-6


BY_REWARD_STAGE = {"env": "frozenlake", "reward": {"type": "env", "scored_by": "reward"}}
RAISES_HERE = {"env": "frozenlake", "reward": {"type": "python", "function": "tests.rewards.python_rewards:raises",
                                               "scored_by": "env"}}


@pytest.mark.rollout(tags={"here": GRID, "there": BY_REWARD_STAGE, "raises": RAISES_HERE})
async def test_an_env_scored_trajectory_skips_the_reward_hop_and_one_it_cannot_score_takes_it(harness):
    """``scored_by: env`` (the default for env rewards): the env member produces the score and the group's
    end straight to rewards.results; ``reward``: the hop through trajectories.completed and the reward
    stage; a reward the env member cannot compute goes that way too, and is dead-lettered there."""
    from rollart.messages import Abort, CompletedTrajectory, GroupEnded, ScoredTrajectory
    from rollart.names import REWARDS_RESULTS, TRAJECTORIES_COMPLETED
    from rollart.replay import ReplayFilter, replay

    for group, tag in (("h", "here"), ("t", "there"), ("b", "raises")):
        await harness.submit(group, tag, group_size=2, seed=5)
    await harness.wait_groups({"h": 2, "t": 2, "b": 2})
    await eventually(lambda: len(harness.scored) == 4, what="the 4 scorable trajectories scored")

    async def on(topic: str) -> dict[type, set[str]]:
        kinds: dict[type, set[str]] = {}
        async for _, m in replay(harness.config, harness.rt.endpoints, topic, ReplayFilter()):
            kinds.setdefault(type(m), set()).add(m.trajectory.traj_id if isinstance(m, ScoredTrajectory) else
                                                 m.group_id if isinstance(m, GroupEnded) else m.traj_id)
        return kinds

    async def dead_lettered():  # all of it: each abort and end in here follows what it consumed from completed
        results = await on(REWARDS_RESULTS)
        return results if results.get(Abort) == {"b-0", "b-1"} and results.get(GroupEnded) == {"h", "t", "b"} \
            else None

    results = await eventually(dead_lettered, what="the reward stage's abort of what the env could not score")
    completed = await on(TRAJECTORIES_COMPLETED)
    assert results[ScoredTrajectory] == {"h-0", "h-1", "t-0", "t-1"}
    assert completed[CompletedTrajectory] == {"t-0", "t-1", "b-0", "b-1"}, "no hop for h, which the env scored"
    assert results[Abort] == {"b-0", "b-1"} and Abort not in completed
    # a group's end goes where its tag's scores go (b's too: its trajectories were meant to be scored here)
    assert completed[GroupEnded] == {"t"} and results[GroupEnded] == {"h", "t", "b"}
    for scored in harness.scored.values():
        assert scored.scorer == "env" and scored.reward == scored.trajectory.env_reward


SLOW = {"env": "frozenlake", "reward": {"type": "env"},
        "faults": {"step_latency": {"dist": "fixed", "mean_s": 4.0}}}


@pytest.mark.rollout(tags={"slow": SLOW, "fast": GRID}, env={"max_groups": 8})
async def test_trajectories_do_not_wait_for_a_slow_env(harness):
    await harness.submit("slow", "slow", group_size=2, seed=4)
    fast = [f"fast{i}" for i in range(4)]
    for i, group in enumerate(fast):
        await harness.submit(group, "fast", group_size=2, seed=10 + i)
    await harness.wait_groups({g: 2 for g in fast}, timeout=90)
    assert not harness.ended("slow")["completed"], "the slow env cannot have finished yet"
    await harness.wait_groups({"slow": 2}, timeout=120)
    slow_done = min(harness.completed_at[t] for t in harness.ended("slow")["completed"])
    fast_done = max(harness.completed_at[t] for g in fast for t in harness.ended(g)["completed"])
    assert fast_done < slow_done, "fast trajectories completed while the slow one was still stepping"


FLAKY = {"env": "frozenlake", "reward": {"type": "env"}, "faults": {"reset_failure_rate": 0.3}}


@pytest.mark.rollout(tags={"flaky": FLAKY}, env={"reset_attempts": 1, "max_groups": 8})
async def test_redundant_rollouts_fill_groups_despite_reset_failures(harness):
    # Fixed ids: faults are seeded by trajectory id, so these groups see the same 7 reset failures every
    # run, and each keeps at least group_size healthy rollouts (red0 would not: 4 of its 5 fail).
    groups = [f"red{i}" for i in range(1, 6)]
    for i, group in enumerate(groups):
        await harness.submit(group, "flaky", group_size=2, redundancy=3, seed=i)
    await harness.wait_groups({g: 5 for g in groups}, timeout=120)
    reasons: dict[str, int] = {}
    for group in groups:
        ended = harness.ended(group)
        assert len(ended["completed"]) == 2, f"{group}: exactly group_size trajectories complete"
        assert len(ended["completed"]) + len(ended["aborted"]) == 5, "every started trajectory ends"
        for traj_id in ended["aborted"]:
            reason = harness.aborted[traj_id].reason
            reasons[reason] = reasons.get(reason, 0) + 1
    assert reasons.get("env_reset_failed", 0) > 0, reasons
    assert reasons.get("redundant", 0) > 0, reasons
    assert set(reasons) <= {"env_reset_failed", "redundant"}


@pytest.mark.rollout(pools=["p1", "p2"], tags={"frozenlake": {**GRID, "pool": "p1"}, "math": {**MATH, "pool": "p2"}})
async def test_tags_reach_their_pool_and_fall_back_when_it_is_down(harness):
    await harness.submit("r1", "frozenlake", group_size=2, seed=5)
    await harness.submit("r2", "math", group_size=2, seed=6)
    await harness.wait_groups({"r1": 2, "r2": 2})
    served = await _served_by(harness)
    assert {served[t] for t in served if t.startswith("r1-")} == {"p1"}
    assert {served[t] for t in served if t.startswith("r2-")} == {"p2"}

    await harness.stop_pool("p2")  # its member leaves the registry
    # the env's view of live pools is cached for routing.live_check_interval_s: a turn routed from a view
    # older than the stop would wait on p2's topic until generation_timeout_s (what the test is not about)
    await asyncio.sleep(2 * harness.config.routing.live_check_interval_s)
    job = harness.config.job
    before = FALLBACKS.labels(job, "math", "p2", "p1")._value.get()
    await harness.submit("r3", "math", group_size=2, seed=7)
    await harness.wait_groups({"r3": 2})
    assert len(harness.ended("r3")["completed"]) == 2
    served = await _served_by(harness)
    assert {served[t] for t in served if t.startswith("r3-")} == {"p1"}
    assert FALLBACKS.labels(job, "math", "p2", "p1")._value.get() > before


async def _served_by(harness) -> dict[str, str]:
    """traj_id -> pool, from the generation requests on each pool's topic."""
    from rollart.bus.reader import read_to_end
    from rollart.messages import DEFAULT_CODEC

    served = {}
    for pool in harness.config.pools:
        async for record in read_to_end(harness.config, harness.rt.endpoints,
                                        f"{harness.config.job}.gen.requests.{pool}"):
            message = DEFAULT_CODEC.decode(record.value, record.headers).message
            served[message.traj_id] = pool
    return served


JUDGED = {"env": "math", "reward": {"type": "judge", "pool": "p1", "include_env_reward": False, "timeout_s": 60}}


@pytest.mark.rollout(tags={"judged": JUDGED})
async def test_llm_judge_served_by_a_generation_pool(harness):
    from rollart.bus.reader import read_to_end
    from rollart.messages import DEFAULT_CODEC

    await harness.submit("j", "judged", group_size=2, seed=8)
    await harness.wait_groups({"j": 2})
    await eventually(lambda: len(harness.scored) == 2, what="2 judged trajectories")
    for scored in harness.scored.values():
        assert scored.scorer == "judge"
        assert 0.0 <= scored.reward_components["judge"] <= 1.0
        assert scored.reward == scored.reward_components["judge"]
        # A random tiny judge rarely writes a number: then it scores 0 and says so.
        assert scored.reward_components["judge_unparsed"] in (0.0, 1.0)
    judge_requests = [m for m in [DEFAULT_CODEC.decode(r.value, r.headers).message async for r in read_to_end(
        harness.config, harness.rt.endpoints, f"{harness.config.job}.gen.requests.p1")]
        if getattr(m, "reply_topic", "") == "rewards.judge"]
    assert {m.traj_id for m in judge_requests} == {"j-0", "j-1"}, "one verdict asked per trajectory"


@pytest.mark.rollout(tags={"frozenlake": GRID})
async def test_trainer_logprobs_match_the_engine_on_rollout_tokens(harness, tiny_model, chat):
    """Token-in/token-out end to end: the trainer scores the exact tokens vLLM sampled, aligned."""
    import torch

    from rollart.training.torch_backend import TorchBackend, collate, token_logprobs

    await harness.submit("lp", "frozenlake", group_size=2, seed=9)
    await harness.wait_groups({"lp": 2})
    await eventually(lambda: len(harness.scored) == 2, what="2 scored")
    batch = collate(list(harness.scored.values()), pad_id=chat.tokenizer.pad_token_id)
    backend = TorchBackend(tiny_model)
    with torch.no_grad():
        trainer = token_logprobs(backend.model, batch.input_ids, batch.attention_mask)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 4
    gap = (trainer[mask] - batch.behaviour_logprobs[mask]).abs().max()
    assert gap < 2e-3, f"engine and trainer disagree by {float(gap)} nats on some token"


@pytest.mark.rollout(tags={"frozenlake": GRID})
async def test_a_task_for_an_unknown_env_is_dead_lettered_and_rollout_goes_on(harness):
    from rollart.bus.dlq import H_DLQ_ERROR
    from rollart.bus.reader import read_to_end
    from rollart.messages import TaskSpec

    bad = TaskSpec(group_id="bad", env="no.such:Env", tag="frozenlake", group_size=2)
    await harness.rt.producer.send_and_wait("tasks", bad, key="bad")
    await harness.submit("good", "frozenlake", group_size=2, seed=1)
    await harness.wait_groups({"good": 2})

    async def dead():
        records = [r async for r in read_to_end(harness.config, harness.rt.endpoints,
                                                f"{harness.config.job}.tasks.dlq")]
        return records or None

    records = await eventually(dead, what="the bad task in tasks.dlq")
    assert b"cannot import env" in dict(records[0].headers)[H_DLQ_ERROR]
    assert not harness.ended("bad"), "no trajectory of the bad task was emitted"


@pytest.mark.rollout(tags={"frozenlake": GRID})
async def test_every_turn_delivered_twice_changes_no_trajectory(harness, chat):
    """The per-turn loops (gen.requests, env.actions) keep no Redis de-duplication: replies are matched
    to their pending request, so a copy of a request or of a result (a redelivery after a crash, or an
    upstream member that produced twice) costs a generation at most and is counted as an orphan."""
    from prometheus_client import REGISTRY

    from rollart.messages import GenerationRequest, GenerationResult

    producer, send = harness.rt.producer, harness.rt.producer.send
    copied = {"requests": 0, "results": 0}

    async def send_twice(topic, message, **kwargs):
        ack = await send(topic, message, **kwargs)
        kind = "requests" if isinstance(message, GenerationRequest) else \
            "results" if isinstance(message, GenerationResult) else None
        if kind is not None:
            copied[kind] += 1
            await send(topic, message, **kwargs)
        return ack

    def orphans() -> float:
        return REGISTRY.get_sample_value("rollart_bus_orphan_replies_total",
                                         {"job": harness.config.job, "topic": "env.actions"}) or 0.0

    before = orphans()
    producer.send = send_twice
    try:
        await harness.submit("twice", "frozenlake", group_size=3, seed=7)
        await harness.wait_groups({"twice": 3})
    finally:
        producer.send = send
    trajectories = [harness.completed[t] for t in harness.ended("twice")["completed"]]
    assert len(trajectories) == 3 and copied["requests"] > 0 and copied["results"] > 0
    for t in trajectories:
        assert chat.decode(t.token_ids).count("<|im_start|>assistant") == t.turns, "each turn taken once"
    # every request's copy was generated too, and every result sent twice: all but one reply per turn orphaned
    await eventually(lambda: orphans() - before >= sum(t.turns for t in trajectories), what="the copies orphaned")
