"""Generation consumers follow policy.versions: background pull, then a short pause to load.

Runs on the session's vLLM engine (CPU). The trainer side is played by a TorchBackend, a
WeightPublisher (the test stack's Mooncake store) and the VersionWriter; the engine's logprobs must
then match the *new* weights. The engine gets its original weights back at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import torch

from rollart.messages import GenerationRequest, Int32Array, SamplingParams
from rollart.state import VersionWriter
from rollart.training.torch_backend import TorchBackend, token_logprobs
from rollart.weights import WeightPublisher, make_transport
from rollart.weights.follower import WeightFollower, loads_key
from rollart.timeouts import wait_for


async def _logprob_gap(engine, backend, chat, *, min_version: int = 0) -> tuple[float, list[int]]:
    prompt = chat.initial("You are on a frozen lake.", "P _ _ _\n_ O _ O")
    result = await engine.generate(GenerationRequest(
        traj_id="sync-t0", turn=0, group_id="sync", tag="t", pool="default", prompt_ids=Int32Array(prompt),
        reply_partition=0, sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=3),
        min_version=min_version))
    ids = torch.tensor([prompt + list(result.token_ids)])
    with torch.no_grad():
        trainer = token_logprobs(backend.model, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
    engine_lp = torch.tensor(list(result.logprobs))
    return float((trainer - engine_lp).abs().max()), list(result.versions)


async def test_engine_loads_each_announced_version(engine, runtime, redis, tiny_model, chat, tmp_path):
    config = runtime.config
    backend = TorchBackend(tiny_model)
    original = {k: v.clone() for k, v in backend.state_dict().items()}
    with torch.no_grad():  # a visibly different policy: every tensor, the tied embedding included
        generator = torch.Generator().manual_seed(1)
        for tensor in backend.model.parameters():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.5 * tensor.std().clamp(min=0.02))
    transport = make_transport(config.weights, runtime.endpoints)
    publisher = WeightPublisher(transport, config.job, bucket_bytes=256 << 10)  # several buckets
    writer = VersionWriter(config, runtime.endpoints, runtime.redis, runtime.producer)
    await writer.acquire()
    follower = WeightFollower(runtime, engine, pool="default", member="sync-test")
    following = asyncio.create_task(follower.run())
    try:
        before, _ = await _logprob_gap(engine, backend, chat)
        assert before > 0.05, "the changed weights give different logprobs than the engine's"
        manifest, _ = publisher.publish(1, backend.state_dict())
        assert len(manifest.buckets) > 1
        await writer.bump(step=1, manifest=manifest)
        # What the generation stage does for a request with min_version 1: wait for the load.
        await wait_for(follower.wait_for(1), 60)
        gap, versions = await _logprob_gap(engine, backend, chat, min_version=1)
        assert engine.version == 1 and set(versions) == {1}
        assert gap < 2e-3, f"engine and trainer disagree by {gap} nats after the load"
        loads = [json.loads(x) for x in await redis.lrange(loads_key(config.redis.key_prefix, config.job), 0, -1)]
        assert [x["version"] for x in loads] == [1]
        assert loads[0]["pull_s"] > 0 and loads[0]["load_s"] > 0, "pull and exposed pause are timed apart"
        assert loads[0]["bytes"] == manifest.total_bytes
    finally:
        follower.stop()
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        assert not follower.staging.parent.exists(), "a stopped follower removes its own staging directory"
        # Give the session engine its original weights (and version 0) back for the other tests.
        restore, _ = publisher.publish(99, original)
        from rollart.weights import pull_version

        staged = pull_version(transport, restore, 99, tmp_path / "restore")
        await engine.load_weights(staged, 0)
        transport.close()
        await writer.release()
    backend.model.load_state_dict(original)
    after, _ = await _logprob_gap(engine, backend, chat)
    assert after < 2e-3
