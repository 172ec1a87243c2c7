"""A vLLM ``AsyncLLM`` driven one request at a time from the bus, batched continuously by vLLM.

Each GenerationRequest becomes one streaming vLLM request (token ids in, token ids out, the sampled
token's logprob). Outputs stream back as deltas; every delta is stamped with the policy version the
engine holds when it arrives, so a turn that spans a weight update carries both versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from rollart.config import ConfigError, GenerationConfig
from rollart.engines import forkserver
from rollart.messages import Float32Array, GenerationRequest, GenerationResult, Int32Array, SamplingParams

log = logging.getLogger(__name__)


_UNI_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# Marks the variable as set by a rollart engine, of this process or of one it descends from (a test
# suite's, a benchmark's parent), not by the user: an "auto" engine must not inherit it.
_UNI_SET_BY_ROLLART = "ROLLART_UNI_ENGINE"


def check_block_size(block_size: int | None) -> None:
    """A ConfigError naming ``generation.block_size`` where this machine's attention cannot take it
    (vLLM's CPU attention: multiples of 32); vLLM itself fails later, in its worker, naming neither."""
    if block_size is None:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # a GPU backend is chosen from the model and the block size together; vLLM says which
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes()
    if not any(block_size == size if isinstance(size, int) else block_size % size.base == 0 for size in sizes):
        raise ConfigError(f"generation.block_size: {block_size} is not a size vLLM's CPU attention takes "
                          f"({', '.join(map(repr, sizes))})")


def _multiprocessing_env(executor: str | None) -> None:
    """vLLM's CPU platform turns a "uni" executor into "mp" unless VLLM_ENABLE_V1_MULTIPROCESSING is 0
    (AsyncLLM keeps its engine core process either way; only that check and the sync LLMEngine read it)."""
    if executor == "uni":
        os.environ[_UNI_ENV] = os.environ[_UNI_SET_BY_ROLLART] = "0"
    elif os.environ.pop(_UNI_SET_BY_ROLLART, None) is not None:
        os.environ.pop(_UNI_ENV, None)


SPECIAL_TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _pin_special_token_ids(tokenizer) -> None:
    """Keep the tokenizer's special-token ids as plain attributes. vLLM reads ``eos_token_id`` for every
    request, and transformers 5 resolves it anew on each read (``__getattr__``, a token-to-id lookup
    through vLLM's tokenizer pool: ~10% of a generation member's CPU, py-spy); the ids cannot change
    while the engine serves. ``object.__setattr__``: the tokenizer's own maps an id back to a token."""
    if tokenizer is None:
        return
    for name in SPECIAL_TOKEN_IDS:
        object.__setattr__(tokenizer, name, getattr(tokenizer, name))


class VLLMEngine:
    def __init__(self, model_path: str | Path, config: GenerationConfig):
        self.model_path = str(model_path)
        self.config = config
        self.version = 0
        self._engine = None
        self._by_traj: dict[str, set[str]] = {}
        self._ipc_dir: str | None = None

    async def start(self) -> "VLLMEngine":
        from rollart.bus.stopping import interruptible
        from rollart.engines.vllm_plugin import ENGINE_WAIT_ENV, KEEP_GEMM_WEIGHTS_ENV, NOTIFY_AFTER_ENV, POLL_SLEEP_ENV

        check_block_size(self.config.block_size)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(self.config.kv_cache_gb))))
        os.environ[ENGINE_WAIT_ENV] = self.config.engine_wait  # for vLLM's own processes
        os.environ[POLL_SLEEP_ENV] = str(self.config.engine_poll_sleep_us)
        os.environ[NOTIFY_AFTER_ENV] = str(self.config.engine_notify_after_us)
        os.environ[KEEP_GEMM_WEIGHTS_ENV] = "1" if self.config.weight_reload == "direct" else "0"
        if self.config.omp_threads_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.config.omp_threads_bind
        executor = None if self.config.executor == "auto" else self.config.executor
        _multiprocessing_env(executor)
        if self.config.engine_core_start == "forkserver":
            forkserver.start_server()  # imports the engine core's modules beside this process's imports
        # Importing vLLM and constructing the engine block the event loop for tens of seconds on a
        # CPU: a stop requested meanwhile interrupts them (the engine's own clean-up kills its core).
        with interruptible(), self._own_ipc_dir():
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            forkserver.start_engine_core_with(self.config.engine_core_start)
            policy = "priority" if self.config.serve_order == "oldest_group" else "fcfs"
            args = AsyncEngineArgs(model=self.model_path, dtype=self.config.dtype,
                                   max_model_len=self.config.max_model_len, enforce_eager=self.config.enforce_eager,
                                   seed=self.config.seed,
                                   gpu_memory_utilization=self.config.gpu_memory_utilization,
                                   max_num_seqs=self.config.max_concurrency, distributed_executor_backend=executor,
                                   scheduling_policy=policy, block_size=self.config.block_size,
                                   worker_extension_cls="rollart.engines.weight_loader.WeightLoaderExtension")
            self._engine = AsyncLLM.from_engine_args(args)
        _pin_special_token_ids(getattr(getattr(self._engine, "renderer", None), "tokenizer", None))
        await self._warm_up()
        return self

    async def _warm_up(self) -> None:
        # The first batches compile kernels for their shapes (seconds on CPU); pay it before serving.
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
        for width in (1, 8, min(32, self.config.max_concurrency)):
            await asyncio.gather(*(self._drain(self._engine.generate(_token_prompt([1, 2, 3, 4]), params,
                                                                      request_id=f"warmup-{width}-{i}"))
                                   for i in range(width)))

    @staticmethod
    async def _drain(stream) -> None:
        async for _ in stream:
            pass

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None

    @contextlib.contextmanager
    def _own_ipc_dir(self) -> Iterator[None]:
        """vLLM's ZeroMQ sockets between this process, its engine core and its worker in a directory of
        this engine's, removed at shutdown: vLLM names them in ``VLLM_RPC_BASE_PATH`` (default /tmp) and
        leaves them there after a clean shutdown too (three to nine a start). A path set by the operator
        is used as it is. vLLM's processes take the environment as they start, during the block."""
        if os.environ.get("VLLM_RPC_BASE_PATH"):
            yield
            return
        self._ipc_dir = tempfile.mkdtemp(prefix="rollart-vllm-")
        os.environ["VLLM_RPC_BASE_PATH"] = self._ipc_dir
        try:
            yield
        finally:
            del os.environ["VLLM_RPC_BASE_PATH"]  # the next engine of this process makes its own

    def _sampling_params(self, request: GenerationRequest):
        """vLLM's sampling parameters for the request: a shallow copy of the ones built for its settings.
        Building them (their checks, and vLLM's lazy module attribute behind ``from vllm import``) was ~9%
        of a generation member's CPU (py-spy), and a job asks with a handful of settings. A shallow copy is
        what vLLM itself makes of parameters marked ``skip_clone``; the only state it then changes in place
        is the stop-token set, into which every request of a model adds the same ids."""
        return copy.copy(_vllm_sampling_params(request.sampling))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        started = time.perf_counter()
        tokens, logprobs, versions = Int32Array(), Float32Array(), Int32Array()
        finish, spans = None, None
        request_id = request.request_id
        self._by_traj.setdefault(request.traj_id, set()).add(request_id)
        try:
            stream = self._engine.generate(_token_prompt(list(request.prompt_ids)),
                                           self._sampling_params(request), request_id=request_id,
                                           priority=self._priority(request))
            async for output in stream:
                completion = output.outputs[0]
                tokens.extend(completion.token_ids)
                logprobs.extend(step[token].logprob for step, token in zip(completion.logprobs or (),
                                                                            completion.token_ids))
                versions.extend([self.version] * len(completion.token_ids))
                finish = completion.finish_reason or finish
                spans = completion.weight_versions  # on the final output: which weights sampled which token
            if spans:
                versions = _span_versions(spans, len(tokens), versions)
        finally:
            ids = self._by_traj.get(request.traj_id)
            if ids is not None:
                ids.discard(request_id)
                if not ids:
                    del self._by_traj[request.traj_id]
        return GenerationResult(traj_id=request.traj_id, turn=request.turn, attempt=request.attempt,
                                episode=request.episode,
                                token_ids=tokens, logprobs=logprobs, versions=versions,
                                finish_reason=finish if finish in ("stop", "length", "abort") else "stop",
                                prompt_tokens=len(request.prompt_ids),
                                latency_s=time.perf_counter() - started)

    def _priority(self, request: GenerationRequest) -> int:
        """vLLM serves the lowest first (ties by arrival): the group's admission, in milliseconds."""
        if self.config.serve_order != "oldest_group":
            return 0
        return int((request.admitted_at or request.created_at) * 1000)

    async def abort_trajectory(self, traj_id: str, episode: str = "") -> int:
        """Cancel the trajectory's requests of one run (``episode``), or of every run; returns how many.

        Targeting the run matters: a group rerun after a crash reuses trajectory ids, and the dead
        run's cancellation must not kill the new run's request."""
        prefix = f"{traj_id}:{episode}:" if episode else ""
        ids = [rid for rid in self._by_traj.get(traj_id, ()) if rid.startswith(prefix)]
        if ids:
            await self._engine.abort(ids)
        return len(ids)

    async def load_weights(self, directory: str | Path, version: int) -> float:
        """Pause, load the staged buckets in ``directory``, resume; returns the exposed pause (s).

        ``generation.on_weight_update``: ``recompute`` clears the KV cache, so requests in flight are
        re-prefilled under the new weights; ``keep`` keeps their old-weight KV. Either way the requests
        go on, and tokens sampled after the resume carry the new version."""
        started = time.perf_counter()
        async with self.paused():
            await self.load_weights_paused(directory, version)
        return time.perf_counter() - started

    @contextlib.asynccontextmanager
    async def paused(self):
        """No new tokens while inside (requests in flight wait; see ``load_weights``). The engine core's
        own pause: ``AsyncLLM.pause_generation`` adds a fixed 20 ms sleep so that outputs of the steps
        before the pause reach their requests first, which the tokens' versions need not wait for: the
        engine core labels each step's tokens with the weights that sampled them (``load_weights_paused``)."""
        await self._engine.engine_core.pause_scheduler_async(mode="keep",
                                                             clear_cache=self.config.on_weight_update == "recompute")
        try:
            yield
        finally:
            await self._engine.resume_generation()

    async def load_weights_paused(self, directory: str | Path, version: int) -> None:
        loaded = await self._engine.collective_rpc("rollart_load_weights",
                                                   args=(str(directory), self.config.weight_reload == "direct"))
        if not loaded or not all(loaded):
            raise RuntimeError(f"no tensors loaded from {directory}")
        await self._engine.update_weight_version(str(version))  # the label of every step from here on
        self.version = version

    @property
    def running(self) -> int:
        return sum(len(v) for v in self._by_traj.values())


def _span_versions(spans, count: int, fallback: Int32Array) -> Int32Array:
    """Per-token policy versions from vLLM's weight-version spans (the engine core's label of the
    weights each token was sampled by); a span it labelled before any load ("default") keeps the
    version the stream saw."""
    versions = list(fallback)
    for span in spans:
        if span.version.isdigit():
            end = min(span.end, count)
            versions[span.start:end] = [int(span.version)] * max(0, end - span.start)
    return Int32Array(versions)


@functools.lru_cache(maxsize=64)  # bounded: a request may carry settings of its own (a seed)
def _vllm_sampling_params(s: SamplingParams):
    """Token ids in, token ids out: text is made only where stop strings need it (detokenizing every
    token of every request, and the sampled token of each logprob, is CPU the engine's step waits on).
    skip_clone: vLLM then copies them shallowly per request instead of deeply (~4% of a generation
    member's CPU, py-spy)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                              stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None, seed=s.seed,
                              logprobs=0, output_kind=RequestOutputKind.DELTA, detokenize=bool(s.stop),
                              skip_clone=True)


def _token_prompt(token_ids: list[int]):
    """A prompt of token ids in vLLM's rendered form: vLLM processes it inline. A plain
    ``{"prompt_token_ids": ...}`` goes through an executor thread per request (it might need
    tokenizing), and that thread's GIL hand-offs held the event loop up to the switch interval
    (py-spy: ~15% of the direct pipeline bench's loop time around each request's start)."""
    from vllm.inputs.engine import tokens_input

    return tokens_input(token_ids)
