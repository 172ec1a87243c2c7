"""The vLLM engine's process layout on CPU per ``generation.executor`` and ``generation.engine_core_start``."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import psutil
import pytest

from rollart.config import GenerationConfig
from rollart.messages import GenerationRequest, Int32Array, SamplingParams


def _engine_cores(exclude: set[int] = frozenset()) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "EngineCore" in p.name() and p.pid not in exclude]


def _workers(core: psutil.Process) -> list[str]:
    return [c.name() for c in core.children() if c.name().startswith("VLLM")]


async def _generates(engine) -> None:
    result = await engine.generate(GenerationRequest(
        traj_id="t", turn=0, group_id="g", tag="x", pool="default", prompt_ids=Int32Array([1, 2, 3]),
        reply_partition=0, sampling=SamplingParams(temperature=1.0, max_tokens=3)))
    assert len(result.token_ids) == 3 and len(result.logprobs) == 3


async def test_uni_runs_the_model_in_the_engine_core(engine):
    """The suite's engine (``executor: uni``): no worker process below the engine core, although vLLM's
    CPU platform would turn "uni" into "mp" without VLLM_ENABLE_V1_MULTIPROCESSING=0."""
    assert engine.config.executor == "uni"
    cores = _engine_cores()
    assert cores and all(not _workers(core) for core in cores), [_workers(c) for c in cores]
    await _generates(engine)


async def test_the_engine_core_is_forked_by_this_processs_fork_server(engine):
    """``engine_core_start: forkserver`` (the default): the engine core's parent is not this process but
    the fork server this process started, which had vLLM imported before it forked it."""
    assert engine.config.engine_core_start == "forkserver"
    (core,) = _engine_cores()
    server = core.parent()
    assert server.pid != os.getpid() and server.ppid() == os.getpid()
    assert "forkserver" in " ".join(server.cmdline())
    assert {"vllm.v1.engine.core"} <= set(server_preload()), server_preload()


def server_preload() -> list[str]:
    import multiprocessing.forkserver

    return list(multiprocessing.forkserver._forkserver._preload_modules)  # what the server imported first


@pytest.mark.timeout(300)
async def test_auto_after_a_uni_engine_is_vllms_own_choice(engine, tiny_model):
    """An "auto" engine started in a process whose uni engine set the variable is still vLLM's CPU
    default: a "VLLM::Worker" process below its engine core. Its queue-wait settings are in the
    environment vLLM's processes start with, where the plugin reads them. Started by vLLM's own
    ``spawn`` (``engine_core_start: spawn``), its engine core is this process's child."""
    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.engines.vllm_plugin import ENGINE_WAIT_ENV, NOTIFY_AFTER_ENV, POLL_SLEEP_ENV

    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # the suite's uni engine set it
    before = {p.pid for p in _engine_cores()}
    auto = VLLMEngine(tiny_model, GenerationConfig(max_concurrency=4, max_model_len=256, engine_wait="sleep",
                                                   engine_poll_sleep_us=300, engine_notify_after_us=0,
                                                   engine_core_start="spawn"))
    await auto.start()
    try:
        (core,) = _engine_cores(before)
        assert len(_workers(core)) == 1, _workers(core)
        assert core.ppid() == os.getpid()
        # vLLM forks its processes from this one's environment (/proc/PID/environ keeps only the
        # environment a process was exec'd with, so it cannot tell)
        assert (os.environ.get(ENGINE_WAIT_ENV), os.environ.get(POLL_SLEEP_ENV),
                os.environ.get(NOTIFY_AFTER_ENV)) == ("sleep", "300", "0")
        await _generates(auto)
        # vLLM's sockets between this process, the engine core and its worker: in the engine's own
        # directory, not in /tmp, and none left after shutdown (vLLM leaves them after a clean one too)
        ipc_dir = auto._ipc_dir
        assert ipc_dir is not None and "VLLM_RPC_BASE_PATH" not in os.environ
        assert len([p for p in Path(ipc_dir).iterdir() if p.is_socket()]) >= 2
    finally:
        auto.shutdown()
    assert not Path(ipc_dir).exists()


async def test_the_engines_special_token_ids_are_resolved_once_not_per_request(engine, tiny_model):
    from rollart.rollout.chat import load_tokenizer

    tokenizer, expected = engine._engine.renderer.tokenizer, load_tokenizer(tiny_model)

    def lookup(*args, **kwargs):
        raise AssertionError("a special token's id looked up again")

    object.__setattr__(tokenizer, "convert_tokens_to_ids", lookup)  # shadows the method for this test
    try:
        assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (expected.eos_token_id, expected.pad_token_id)
        await _generates(engine)  # vLLM reads eos_token_id for every request
    finally:
        object.__delattr__(tokenizer, "convert_tokens_to_ids")


async def test_requests_with_their_own_settings_share_nothing_but_a_template(engine):
    """vLLM's sampling parameters are built once per setting and copied per request: requests of
    different settings in one batch each get theirs, a seed still decides the tokens, and no request's
    state is left in the shared template."""
    from rollart.engines.vllm_engine import _vllm_sampling_params

    def request(i: int, **sampling) -> GenerationRequest:
        return GenerationRequest(traj_id=f"settings-{i}", turn=0, group_id="g", tag="x", pool="default",
                                 prompt_ids=Int32Array([1, 2, 3]), reply_partition=0,
                                 sampling=SamplingParams(temperature=1.0, **sampling))

    results = await asyncio.gather(*(engine.generate(request(i, max_tokens=1 + i % 3)) for i in range(9)))
    assert all(len(r.token_ids) <= 1 + i % 3 for i, r in enumerate(results))
    assert {len(r.token_ids) for r in results[2::3]} - {1, 2}  # a 3-token request is not cut at 1 or 2
    seeded = [await engine.generate(request(10 + i, max_tokens=6, seed=7)) for i in range(3)]
    assert seeded[0].token_ids == seeded[1].token_ids == seeded[2].token_ids
    template = _vllm_sampling_params(SamplingParams(temperature=1.0, max_tokens=1))
    assert template.max_tokens == 1 and template.seed is None and not template.stop_token_ids
    first, second = (engine._sampling_params(request(20, max_tokens=1)) for _ in range(2))
    assert first is not second and first is not template and first.max_tokens == second.max_tokens == 1


@pytest.mark.timeout(300)
async def test_oldest_groups_turns_are_served_first_when_the_engine_is_full(tiny_model):
    """``serve_order: oldest_group`` with one slot: turns that wait together are served by their group's
    admission, oldest first, not in their arrival order (vLLM's FCFS)."""
    from rollart.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model, GenerationConfig(max_concurrency=1, max_model_len=256,
                                                     serve_order="oldest_group"))
    await engine.start()
    finished: list[str] = []

    async def turn(name: str, admitted_at: float) -> None:
        await engine.generate(GenerationRequest(
            traj_id=name, turn=0, group_id=name, tag="x", pool="default", prompt_ids=Int32Array([1, 2, 3]),
            reply_partition=0, sampling=SamplingParams(temperature=1.0, max_tokens=2),
            admitted_at=admitted_at, created_at=time.time()))
        finished.append(name)

    try:
        async with engine.paused():  # nothing is scheduled until all three wait in the engine's queue
            arrivals = [asyncio.create_task(turn(name, admitted_at))
                        for name, admitted_at in (("newest", 300.0), ("middle", 200.0), ("oldest", 100.0))]
            await asyncio.sleep(0.5)
        await asyncio.gather(*arrivals)
        assert finished == ["oldest", "middle", "newest"]
    finally:
        engine.shutdown()


async def _cached_tokens(engine, prompt_ids: list[int], request_id: str) -> int:
    """The prompt tokens vLLM found in its prefix cache for this request."""
    from vllm import SamplingParams as VLLMSamplingParams

    from rollart.engines.vllm_engine import _token_prompt

    final = None
    async for output in engine._engine.generate(_token_prompt(prompt_ids), VLLMSamplingParams(max_tokens=1),
                                                request_id=request_id):
        final = output
    return final.num_cached_tokens


@pytest.mark.timeout(300)
async def test_a_turns_context_is_found_in_the_prefix_cache_by_the_configured_block(engine, tiny_model):
    """A turn re-sends its trajectory's context: vLLM finds only the blocks the earlier turn filled
    whole. With ``generation.block_size: 32`` a 100-token first turn leaves 96 tokens for the next to
    reuse; with the CPU platform's default (128, the suite's engine) it leaves none."""
    from rollart.engines.vllm_engine import VLLMEngine

    first = [(7 * i) % 300 + 5 for i in range(100)]
    second = first + [(11 * i) % 300 + 5 for i in range(60)]
    assert engine._engine.vllm_config.cache_config.block_size == 128
    await _cached_tokens(engine, first, "default-1")
    assert await _cached_tokens(engine, second, "default-2") == 0

    small = VLLMEngine(tiny_model, GenerationConfig(max_concurrency=8, max_model_len=512, executor="uni",
                                                    block_size=32))
    await small.start()
    try:
        await _cached_tokens(small, first, "small-1")
        assert await _cached_tokens(small, second, "small-2") == 96
    finally:
        small.shutdown()


@pytest.mark.timeout(300)
async def test_tokens_carry_the_version_the_engine_core_sampled_them_with(engine, tiny_model, tmp_path):
    """A load labels the engine core's steps from then on: a request's tokens carry the version of the
    weights that sampled them, as the engine core says, not the version the stream reader saw when the
    tokens reached it (vLLM hands a step's outputs on after it returns from the pause)."""
    from rollart.training.torch_backend import TorchBackend
    from rollart.weights.buckets import stage_state

    state = TorchBackend(tiny_model, prefix_tree=False).state_dict()  # the engine's own weights: a new label only
    before = engine.version

    def request(name: str) -> GenerationRequest:
        return GenerationRequest(traj_id=name, turn=0, group_id="g", tag="x", pool="default",
                                 prompt_ids=Int32Array([1, 2, 3]), reply_partition=0,
                                 sampling=SamplingParams(temperature=1.0, max_tokens=48))

    try:
        running = asyncio.create_task(engine.generate(request("across")))
        await asyncio.sleep(0.05)
        await engine.load_weights(stage_state(state, tmp_path / "v7", bucket_bytes=1 << 20), 7)
        across = list((await running).versions)
        assert across and set(across) <= {before, 7} and across == sorted(across, key=[before, 7].index)
        engine.version = 3  # a reader that saw an older version: the labels are the engine core's
        assert set((await engine.generate(request("after"))).versions) == {7}
    finally:
        await engine.load_weights(stage_state(state, tmp_path / "back", bucket_bytes=1 << 20), before)


@pytest.mark.parametrize("reload", ["direct", "layerwise"])
async def test_each_weight_reload_loads_every_tensor(engine, tiny_model, tmp_path, reload):
    """After a load of weights that moved every tensor (the tied embedding included) the engine's
    logprobs are the trainer's, by a direct load (the suite engine's default: its linear layers kept
    their plain weights) and by vLLM's layerwise reload; and back again after the original weights."""
    assert engine._engine.vllm_config.model_config.enforce_eager, "generation.enforce_eager's default"
    await _reload_gives_the_trainers_logprobs(engine, tiny_model, tmp_path, reload)


@pytest.mark.timeout(300)
async def test_a_compiled_engine_takes_a_direct_load(tiny_model, tmp_path):
    """``generation.enforce_eager: false``: vLLM compiles the model (torch.compile), and a version loaded
    into the live model reaches the compiled code (no stale copy of a weight kept in its graph)."""
    from rollart.engines.vllm_engine import VLLMEngine

    compiled = VLLMEngine(tiny_model, GenerationConfig(max_concurrency=8, max_model_len=512, executor="mp",
                                                       enforce_eager=False))
    await compiled.start()
    try:
        config = compiled._engine.vllm_config
        assert not config.model_config.enforce_eager and config.compilation_config.mode != 0
        await _reload_gives_the_trainers_logprobs(compiled, tiny_model, tmp_path, "direct")
    finally:
        compiled.shutdown()


async def _reload_gives_the_trainers_logprobs(engine, tiny_model, tmp_path, reload: str) -> None:
    import torch

    from rollart.training.torch_backend import TorchBackend, token_logprobs
    from rollart.weights.buckets import stage_state

    backend = TorchBackend(tiny_model, prefix_tree=False)
    original = {name: tensor.clone() for name, tensor in backend.state_dict().items()}
    config, before = engine.config, engine.version
    assert await engine._engine.collective_rpc("rollart_weight_reload", args=(True,)) == ["direct"]

    async def gap() -> float:
        result = await engine.generate(GenerationRequest(
            traj_id="reload", turn=0, group_id="g", tag="x", pool="default", prompt_ids=Int32Array([5, 9, 14, 3]),
            reply_partition=0, sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=3)))
        ids = torch.tensor([[5, 9, 14, 3, *result.token_ids]])
        with torch.no_grad():
            trainer = token_logprobs(backend.model, ids, torch.ones_like(ids))[0, 3:]
        return float((trainer - torch.tensor(list(result.logprobs))).abs().max())

    engine.config = config.model_copy(update={"weight_reload": reload})
    try:
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for tensor in backend.model.parameters():
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.5 * tensor.std().clamp(min=0.02))
        assert await gap() > 0.05, "the moved weights give other logprobs than the engine's"
        await engine.load_weights(stage_state(backend.state_dict(), tmp_path / "moved", bucket_bytes=1 << 20), 5)
        assert await gap() < 2e-3
    finally:
        await engine.load_weights(stage_state(original, tmp_path / "back", bucket_bytes=1 << 20), before)
        engine.config = config
    backend.model.load_state_dict(original)
    assert await gap() < 2e-3


def test_a_block_size_the_cpu_attention_cannot_take_fails_naming_the_field():
    from rollart.config import ConfigError
    from rollart.engines.vllm_engine import check_block_size

    for fine in (None, 32, 64, 128):
        check_block_size(fine)
    with pytest.raises(ConfigError, match=r"generation.block_size: 16 .*MultipleOf\(32\)"):
        check_block_size(16)
