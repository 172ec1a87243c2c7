"""The vLLM engine's process layout on CPU: the model runs in the engine core's own process."""

from __future__ import annotations

import psutil


async def test_the_default_executor_runs_the_model_in_the_engine_core(engine):
    """``generation.executor: auto`` is vLLM's uni executor even on CPU, where vLLM would otherwise
    start a worker process (a "VLLM::Worker") below the engine core and pass every step to it through
    a shared-memory queue."""
    from rollart.messages import GenerationRequest, Int32Array, SamplingParams

    assert engine.config.executor == "auto"
    cores = [p for p in psutil.Process().children() if "EngineCore" in p.name()]
    assert cores, [p.name() for p in psutil.Process().children()]
    for core in cores:
        assert not [c.name() for c in core.children() if c.name().startswith("VLLM")]
    result = await engine.generate(GenerationRequest(
        traj_id="t", turn=0, group_id="g", tag="x", pool="default", prompt_ids=Int32Array([1, 2, 3]),
        reply_partition=0, sampling=SamplingParams(temperature=1.0, max_tokens=3)))
    assert len(result.token_ids) == 3 and len(result.logprobs) == 3
