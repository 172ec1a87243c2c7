"""Job configuration: validated models loaded from YAML, overridden by ``ROLLART_*`` variables.

Environment variables name a section and a field: ``ROLLART_KAFKA_BOOTSTRAP`` sets
``kafka.bootstrap``, ``ROLLART_BUS_MAX_IN_FLIGHT`` sets ``bus.max_in_flight``, ``ROLLART_JOB`` sets
``job``. They take precedence over the file, so one YAML can point at the local stack on a laptop
and at the production cluster in a pod. Unknown fields are errors: a typo fails at start-up and the
error names the field.
"""

from __future__ import annotations

from contextvars import ContextVar
import random
from pathlib import Path
from typing import Annotated, Any, Literal, TypeAlias

import yaml
from pydantic import BaseModel, Discriminator, Field, SecretStr, Tag, ValidationError, field_validator, \
    model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The deploy section's models live with the deploy package; StageDeployment and DeployConfig are
# still importable from here.
from rollart.deploy.settings import Autoscaling, DeployConfig as DeployConfig, StageDeployment as StageDeployment, \
    gpu_stage
from rollart.section import Section

JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$"  # no dots: dots separate job from topic


class ConfigError(ValueError):
    """The configuration is invalid; the message names every offending field."""


class KafkaConfig(Section):
    bootstrap: str | None = None  # None: use the running local stack
    # What serves ``bootstrap``: Apache Kafka (or any broker that implements the protocol fully), or
    # the embedded Tansu, whose ListOffsets the clients then work around (the README's broker notes),
    # or "memory": rollart.bus.memory's in-process broker at ``memory://<name>`` (tests, no Kafka).
    broker: Literal["kafka", "tansu", "memory"] = "kafka"
    client_id: str = "rollart"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    request_timeout_ms: int = Field(default=30_000, ge=1_000)
    max_request_bytes: int = Field(default=32 << 20, ge=1 << 20)
    # Replication of created topics; clamped to the number of brokers (1 on the local stack).
    replication_factor: int = Field(default=3, ge=1)


class RedisConfig(Section):
    url: str | None = None  # None: use the running local stack; rediss:// for TLS
    key_prefix: str = Field(default="rollart", min_length=1)
    # Auth (Redis 6 ACL user, or only a password for requirepass); kept out of the URL so the password can
    # come from a Secret as ROLLART_REDIS_PASSWORD. A password in the URL works too.
    username: str | None = None
    password: SecretStr | None = None
    # TLS (a rediss:// URL): the CA to verify the server with, and a client certificate for mutual TLS.
    ssl_ca_certs: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None


class BulkFetch(Section):
    """Kafka's fetch.min.bytes and fetch.max.wait.ms for the trainer's scored samples (a run's monitor
    takes ``min_bytes`` with the bus's long-poll): the broker answers once ``min_bytes`` are there or
    ``max_wait_ms`` passed, not record by record. A fetch per record woke the trainer's event loop ~60
    times a step beside its training thread. ``max_wait_ms`` is the most a record waits for company, and
    how often an idle consumer asks (why the reward bridge does not use it). ``min_bytes: 1``: record by
    record."""

    min_bytes: int = Field(default=64 * 1024, ge=1)
    max_wait_ms: int = Field(default=50, ge=0, le=10_000)

    def consumer_kwargs(self) -> dict[str, int]:
        return {"fetch_min_bytes": self.min_bytes, "fetch_max_wait_ms": self.max_wait_ms}


class BusConfig(Section):
    # The broker answers a fetch as soon as data arrives (Apache Kafka and Tansu alike); the wait only
    # bounds how often an idle consumer asks. Kafka's own default: at 5 ms the demo's idle consumers
    # (trainer, reward, monitor, followers) cost the broker and themselves 30% of its step time.
    fetch_max_wait_ms: int = Field(default=500, ge=0, le=10_000)
    max_in_flight: int = Field(default=256, ge=1)
    commit_interval_s: float = Field(default=0.5, gt=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # A stopping member's last commit waits this long for the broker (as Kafka's default.api.timeout.ms
    # bounds a blocking commit): a client retries while no coordinator answers, and the member must leave.
    commit_timeout_s: float = Field(default=30.0, gt=0)
    handler_attempts: int = Field(default=3, ge=1)
    retry_backoff_s: float = Field(default=0.1, ge=0)
    dedup_ttl_s: int = Field(default=24 * 3600, ge=1)
    dlq_max_per_minute: int = Field(default=120, ge=1)
    # Broker-side de-duplication of producer retries (sequence numbers per producer id). On Apache
    # Kafka only: Tansu answers InitProducerId with an unknown error, so there it stays off.
    idempotent_producer: bool = True
    # at_least_once: every hop commits after its outputs are acknowledged; redeliveries are dropped
    # by message id (Redis). exactly_once (Apache Kafka): the hops off the per-turn path (the env
    # stage's completions, the reward bridge's scores) commit outputs and input offsets in one Kafka
    # transaction per commit interval, and every consumer reads committed records only.
    processing_guarantee: Literal["at_least_once", "exactly_once"] = "at_least_once"
    linger_ms: int = Field(default=0, ge=0)  # 1 ms cost ~3 ms per round trip here; batching happens anyway under load
    max_value_bytes: int = Field(default=32 << 20, ge=1024)
    session_timeout_ms: int = Field(default=10_000, ge=1_000)
    heartbeat_interval_ms: int = Field(default=1_000, ge=100)
    bulk_fetch: BulkFetch = Field(default_factory=BulkFetch)


class MetricsConfig(Section):
    port: int | None = Field(default=None, ge=0, le=65535)  # None: no /metrics; 0: any free port
    host: str = "0.0.0.0"
    # /healthz fails when a work loop has not polled for this long (Kubernetes then restarts the pod)
    liveness_stall_s: float = Field(default=120.0, gt=0)


class MooncakeConfig(Section):
    master: str | None = None  # host:port of mooncake_master; None: not configured
    metadata_server: str | None = None


class ModelConfig(Section):
    path: Path = Path(".rollart/models/tiny")  # a Hugging Face directory; never downloaded at run time
    init_tiny: bool = True  # create the tiny random model at ``path`` when it does not exist
    # Supervised steps on random *valid* actions of this env after creating the tiny model: it learns
    # the answer format only (no task knowledge), so RL starts from a policy that can act.
    warm_start_steps: int = Field(default=0, ge=0)
    warm_start_env: str = "frozenlake"


class WeightsConfig(Section):
    """How the trainer hands weights to the generation consumers."""

    transport: Literal["auto", "mooncake", "fs"] = "auto"  # auto: Mooncake when a master is known
    fs_root: Path | None = None  # fs transport: a directory all stages share (None: $ROLLART_HOME/weights)
    bucket_bytes: int = Field(default=32 << 20, ge=1 << 16)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # full: every version writes and every follower pulls every bucket. delta: a bucket whose content
    # did not change is not written again (the new manifest names the old key) nor pulled (a follower
    # keeps the version it holds on local disk); every bucket and the version carry a digest.
    sync: Literal["full", "delta"] = "full"
    # delta sync: a changed bucket is also written as XOR against its previous bytes, encoded, when
    # that is at most delta_max_ratio of the bucket (a follower holding the previous bytes pulls that)
    delta_encoding: bool = True
    # sparse: the changed 8-byte words and a bitmap of them (~1 GB/s each way); zlib: the XOR compressed
    # (about half the bytes of sparse, ~5x the CPU); lzma: smaller still, slower still
    delta_codec: Literal["sparse", "zlib", "lzma"] = "sparse"
    delta_max_ratio: float = Field(default=0.5, gt=0, le=1)

    @model_validator(mode="after")
    def _delta_options_need_delta_sync(self) -> "WeightsConfig":
        # a delta option changed under full sync would silently do nothing: say so instead. Compared with
        # the default, not "set": a whole config dumped and loaded again (deploy, benches) sets every field
        ignored = [name for name in ("delta_encoding", "delta_codec", "delta_max_ratio")
                   if getattr(self, name) != type(self).model_fields[name].default]
        if self.sync == "full" and ignored:
            raise ValueError(f"weights.{ignored[0]} is set but weights.sync is full: deltas need sync: delta")
        return self


class TrainerConfig(Section):
    backend: Literal["torch", "megatron"] = "torch"
    device: str | None = None  # None: cuda when available, else cpu
    lr: float = Field(default=5e-4, gt=0)
    micro_batch: int = Field(default=16, ge=1)  # trajectories per forward/backward (gradient accumulation)
    grad_clip: float = Field(default=1.0, gt=0)
    # The torch backend runs each distinct prefix of a micro-batch's rows once (a group's shared prompt,
    # turns its members share) and no padding: rollart/training/prefix_tree.py. Same result; a micro-batch
    # where it would not be cheaper, or a model whose attention ignores the tree (a start-up probe), runs
    # padded rows.
    prefix_tree: bool = True
    algorithm: Literal["grpo", "ppo", "reinforce"] = "grpo"
    advantage_norm: Literal["group", "group_mean", "batch", "none"] = "group"
    # token_mean: every generated token of the batch weighs the same (long trajectories weigh more);
    # sequence_mean: every trajectory weighs the same
    loss_aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    clip_low: float = Field(default=0.2, ge=0)
    clip_high: float = Field(default=0.28, ge=0)
    # Dual-clip PPO's c (verl's clip_ratio_c): a token with a negative advantage whose ratio to the old
    # policy passed c gets no gradient (rollart/training/algorithms.py::_dual_clip says why). null: off.
    dual_clip: float | None = Field(default=3.0, gt=1)
    # AReaL's decoupled objective for stale samples: the clip acts around a proximal policy, the version
    # before the one trained (one optimiser step back; exact at staleness 0 and 1), and exp(proximal -
    # behaviour), capped at importance_cap, weighs older tokens. False: the clip acts around the behaviour
    # policy (plain PPO). rollart/training/algorithms.py::proximal_logprobs says why one version back.
    decoupled: bool = True
    # The proximal policy: "previous" (above), or "current", the weights being trained (AReaL's recomputed
    # logprobs; with one optimiser step per batch the ratio is 1 and nothing bounds a step but grad_clip)
    proximal: Literal["previous", "current"] = "previous"
    importance_cap: float = Field(default=5.0, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)  # KL to the initial (reference) policy
    entropy_coef: float = Field(default=0.0, ge=0)
    # Rows whose advantage is 0 (every member of a uniform group) add nothing to the policy gradient
    # when the loss has no KL or entropy term: the trainer then skips their forward and backward and
    # keeps them in the loss's normaliser, so the step is the same. Step metrics but the loss are then
    # over the trained rows (metrics.trained_fraction of the batch's tokens or sequences).
    skip_zero_advantage: bool = True
    # Train a batch's groups as they complete: each group's forward and backward runs while the rest of
    # the batch still rolls out, and the optimiser step (the same step: sums divided by the whole batch's
    # tokens) once it is whole; the last group's part and the step are what is left between the batch's
    # end and the publish (rollart/training/streamed_step.py). For a trainer on hardware of its own; on
    # the 2-core demo it moved no step (the cores are the limit) and slowed the parts beside the rollout
    # (README, "How training flows"). Needs advantages per group and one rank (refused otherwise).
    stream_batch: bool = False
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal before forming a batch
    # Partial groups: a group that cannot fill (its replacements ran out, a reward dead-lettered) trains
    # with the members it has when at least this many were scored (advantages over those present), or
    # is dropped with the reason incomplete_group. None: feeder.group_size (only full groups train).
    min_group_size: int | None = Field(default=None, ge=1)
    # The task mix: "weights" forms each batch with the tags' shares of groups_per_batch (by tag weight),
    # waiting up to task_mix_wait_s for a slow tag's groups before other tags' groups fill its places;
    # "arrival": the oldest trainable groups, whatever their tags (fast tasks crowd out slow ones).
    task_mix: Literal["weights", "arrival"] = "weights"
    task_mix_wait_s: float = Field(default=30.0, ge=0)
    samples: Literal["trajectory", "step"] = "trajectory"  # whole-trajectory samples, or one per LLM turn
    max_steps: int | None = Field(default=None, ge=1)  # stop after this many steps (None: run until stopped)
    checkpoint_dir: Path = Path(".rollart/checkpoints")
    checkpoint_every: int = Field(default=1, ge=1)  # steps; samples are committed only once checkpointed
    capacity_groups: int | None = Field(default=None, ge=1)  # buffer bound; None: (alpha + 2) * groups_per_batch
    keep_versions: int = Field(default=2, ge=1)  # published versions kept besides any still being pulled
    # Mixed precision (Hugging Face Accelerate's name for it): "bf16" runs the forward's matrix products
    # in bfloat16 under torch.autocast, and so their backward; weights, gradients and Adam's state stay
    # float32, and so does the output layer where logprobs are taken (a plain linear head; another head's
    # bfloat16 logits are cast to float32). "no": float32 throughout. On a CPU it pays where the CPU has bf16 instructions
    # (avx512_bf16, AMX; the trainer's log says "native bf16: yes/no"); `rollart bench trainer-step`
    # times a run's steps both ways.
    mixed_precision: Literal["no", "bf16"] = "no"
    # CPU plan: torch's intra-op threads in the trainer (None: torch's default, one per core); on a
    # machine it shares with an engine, fewer threads than cores keep the two from fighting
    torch_threads: int | None = Field(default=None, ge=1)
    # Data parallelism: this many ranks of torch.distributed (gloo on CPU, NCCL on GPU), each with a
    # replica, a share of every batch and the summed gradient (rollart/training/distributed.py). Rank 0
    # consumes, checkpoints and publishes; `rollart consume trainer` starts the others unless the
    # environment names its RANK (torchrun, the Kubernetes rendering).
    world_size: int = Field(default=1, ge=1)
    # A collective that waits longer fails the trainer (a rank hung or unreachable); a rank that died
    # fails it at once. Idle ranks get a heartbeat at a quarter of it.
    dist_timeout_s: float = Field(default=120.0, ge=4)
    seed: int = 0

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: object) -> object:
        return "no" if value is False else value  # YAML 1.1 reads an unquoted `no` as false

    @model_validator(mode="after")
    def _megatron_mixed_precision_on_cuda(self) -> "TrainerConfig":
        # Megatron-core's linear layers carry autocast into their backward for CUDA only: on a CPU their
        # backward multiplies a bfloat16 gradient by a float32 weight and fails mid-step
        if self.backend == "megatron" and self.mixed_precision != "no" and (self.device or "").startswith("cpu"):
            raise ValueError("trainer.mixed_precision: bf16 with trainer.backend megatron needs device cuda "
                             "(Megatron-core's layers keep autocast in their backward on CUDA only)")
        return self


DIRECT_FALLBACK_FETCH_MAX_WAIT_MS = 500


class GenerationConfig(Section):
    engine: Literal["vllm"] = "vllm"
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    max_model_len: int = Field(default=2048, ge=64)
    max_concurrency: int = Field(default=64, ge=1)  # requests in flight per generation consumer
    kv_cache_gb: float = Field(default=1.0, gt=0)  # VLLM_CPU_KVCACHE_SPACE on CPU
    # Tokens per KV-cache block, the unit of vLLM's prefix cache; None: vLLM's default for the platform
    # (128 on CPU, 16 on GPUs). An agent's turn re-sends its whole context: only the blocks it fills whole
    # are found in the cache, so with 100-300-token contexts 128 left over half of every prompt to compute
    # again (README, "How a rollout flows"). On CPU a multiple of 32 (vLLM's CPU attention; checked as the
    # engine starts).
    block_size: int | None = Field(default=None, ge=1, le=1024)
    # CPU: how the engine's internal queue readers wait between steps instead of spinning
    # (rollart/engines/vllm_plugin.py): on the writer's notification, a poll sleep, or vLLM's own spin
    engine_wait: Literal["notify", "sleep", "spin"] = "notify"
    engine_poll_sleep_us: int = Field(default=200, ge=0, le=100_000)  # the polls' sleep (sleep, notify)
    engine_notify_after_us: int = Field(default=1000, ge=0, le=1_000_000)  # notify: poll this long first
    # CPU plan: vLLM's VLLM_CPU_OMP_THREADS_BIND ("auto": it reserves a core for its scheduler and
    # binds the rest; "nobind"; or CPU ids such as "1" or "0-3"); None leaves the environment's
    omp_threads_bind: str | None = Field(default=None, pattern=r"^(auto|nobind|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$")
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    # vLLM's executor. "auto": vLLM's choice (on CPU "mp": a worker process below the engine core, each
    # step handed over through a shared-memory queue; on one GPU "uni"). "uni" runs the model in the
    # engine core's own process: on 2 cores it starts ~10 s sooner and answers one request 1.5x sooner
    # but the engine then uses one core, and a demo run's steps took 8-12% longer (README, CPU plan).
    executor: Literal["auto", "uni", "mp"] = "auto"
    # vLLM's enforce_eager. True: the model runs op by op. False: vLLM compiles it (torch.compile; on a GPU
    # also CUDA graphs, vLLM's usual speed-up for decode). On the 2-core CPU machine compiling cut the
    # CPU of a turn by 6-19% but added ~10 s to every engine start (vLLM 0.32 failed to load its own
    # compile cache and compiled again), which a short run and the test suite pay (README, CPU plan).
    enforce_eager: bool = True
    # How vLLM's engine core process (and on CPU its worker) starts. "forkserver": forked from a server
    # that imported vLLM's engine core and worker modules while this process imported vLLM, with vLLM's
    # CPU preloads, the worker's OpenMP binding applied by rollart (rollart/engines/forkserver.py);
    # "spawn": vLLM's own way on CPU, fresh interpreters that import it all again. README, "How the
    # engine core starts" (rollart bench engine-start).
    engine_core_start: Literal["forkserver", "spawn"] = "forkserver"
    seed: int = 0
    heartbeat_ttl_s: float = Field(default=6.0, gt=0)
    # How a turn reaches the engine. "bus": GenerationRequest on gen.requests.<pool>, the result on
    # env.actions. "direct": each member also serves turns on a TCP socket it advertises in the pool
    # registry; env members send there, over the bus only what no member can take (rollart/rollout/direct.py).
    transport: Literal["bus", "direct"] = "bus"
    direct_bind_host: str = "127.0.0.1"  # "0.0.0.0" in a pod (deploy/ renders it with the pod's IP advertised)
    direct_port: int = Field(default=0, ge=0, le=65535)  # 0: any free port
    direct_advertise_host: str | None = None  # what env members connect to; None: the bind host (or hostname)
    # The per-turn loops (gen.requests.*, env.actions, rewards.judge): a shorter long-poll than the bus's.
    # In the rollout-only benchmark 500 ms cost a third of the pipeline's tokens/s (1,027 against 1,372
    # at 5 ms and 1,452 at 100 ms); the demo's step time was the same at 100 and 500 (1.86 / 1.76 s).
    fetch_max_wait_ms: int = Field(default=100, ge=0, le=10_000)
    def turn_fetch_max_wait_ms(self) -> int:
        """The long-poll of the per-turn loops (gen.requests.*, env.actions). On the direct path they
        only carry the fallback, and idle loops polling every few ms cost the busy process real CPU
        (py-spy: aiokafka's fetch requests were ~17% of the in-process bench); Apache Kafka answers a
        long-poll as soon as a record arrives, so a long one costs a fallback turn nothing there."""
        return max(self.fetch_max_wait_ms, DIRECT_FALLBACK_FETCH_MAX_WAIT_MS) if self.transport == "direct" \
            else self.fetch_max_wait_ms

    # Which waiting turns the engine serves first when it has more than max_concurrency: "arrival" (vLLM's
    # FCFS), or "oldest_group": the turns of the groups the feeder admitted first (vLLM's priority
    # scheduling; a batch needs whole groups, and the oldest are nearest their staleness bound). In the
    # demo it changed neither the first batch nor the step (README, "How a rollout flows").
    serve_order: Literal["arrival", "oldest_group"] = "arrival"
    # Requests in flight when new weights load: re-prefill them under the new weights, or keep their KV.
    on_weight_update: Literal["recompute", "keep"] = "recompute"
    # How a version's tensors go into the engine: "direct" as vLLM's loader does at start-up (the model's
    # load_weights, then each layer's processing: on CPU each GEMM's packed copy, for which every linear
    # layer keeps its plain weight beside the packed one, where vLLM drops it: that memory twice);
    # "layerwise" is vLLM's generic in-place reload (each layer restored from meta, loaded, processed
    # again), 2-4x as long on the demo's model (README, "Generation"). A quantized model is always
    # reloaded layerwise.
    weight_reload: Literal["direct", "layerwise"] = "direct"
    follow_versions: bool = True  # pull and load each announced version
    weight_staging_dir: Path | None = None  # None: a temporary directory per consumer


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    max_tokens: int = Field(default=8, ge=1)


REWARD_TYPES = ("env", "rule", "http", "judge", "python")
DEFAULT_REWARD_CONCURRENCY = 16  # what a reward type without a ``concurrency`` counts towards the stage's in-flight


ScoredBy = Literal["env", "reward"]


class _Reward(Section):
    """What every reward type has: its ``type``, the discriminator (see :data:`RewardSpec`), and
    ``scored_by``: the env member that completed the trajectory scores it and produces the score to
    ``rewards.results`` itself (``env``: no hop over the bus for a reward that costs microseconds), or
    the reward stage does (``reward``: a reward that is slow, remote or needs its own scaling)."""

    type: str
    scored_by: ScoredBy = "env"

    @model_validator(mode="after")
    def _type_is_always_set(self) -> "_Reward":
        # A dump of what was set (``with_updates``) keeps the type, which picks the model again.
        self.__pydantic_fields_set__.add("type")
        return self


class EnvReward(_Reward):
    """The env's own rewards (the default)."""

    type: Literal["env"] = "env"


class _ScoredReward(_Reward):
    """A reward computed beside the env's: the env reward is kept as a component and, unless
    ``include_env_reward`` is off, added."""

    include_env_reward: bool = True


class RuleReward(_ScoredReward):
    """A local rule (rollart.rewards.rules)."""

    type: Literal["rule"] = "rule"
    rule: Literal["math_answer", "format"] | None = None
    format_penalty: float = -0.1

    @model_validator(mode="after")
    def _needs_a_rule(self) -> "RuleReward":
        if self.rule is None:
            raise ValueError("type rule needs a rule name (rule: math_answer or format)")
        return self


class HttpReward(_ScoredReward):
    """A serverless function scoring over HTTP (rollart.rewards.http)."""

    type: Literal["http"] = "http"
    scored_by: Literal["reward"] = "reward"  # remote, retried and rate-bound: the reward stage scales it
    url: str | None = None
    token_env: str | None = None  # name of the env var holding the bearer token
    timeout_s: float = Field(default=10.0, gt=0)
    attempts: int = Field(default=4, ge=1)
    backoff_s: float = Field(default=0.2, ge=0)
    concurrency: int = Field(default=DEFAULT_REWARD_CONCURRENCY, ge=1)
    allow_insecure_remote: bool = False  # plain HTTP to a non-loopback host

    @model_validator(mode="after")
    def _usable_url(self) -> "HttpReward":
        reward_url_problem = _reward_url_problem(self.url, self.allow_insecure_remote)
        if reward_url_problem:
            raise ValueError(reward_url_problem)
        return self


class JudgeReward(_ScoredReward):
    """An LLM judge served by a generation pool, asked over the bus (rollart.stages.reward)."""

    type: Literal["judge"] = "judge"
    scored_by: Literal["reward"] = "reward"  # a generation pool asked over the bus
    pool: str | None = None  # the generation pool that serves the judge model
    timeout_s: float = Field(default=10.0, gt=0)
    concurrency: int = Field(default=DEFAULT_REWARD_CONCURRENCY, ge=1)
    judge_prompt: str = ("Rate the answer from 0 to 1.\nTask: {question}\nAnswer: {final_text}\nScore:")
    judge_max_tokens: int = Field(default=8, ge=1)


class PythonReward(_ScoredReward):
    """A Python function by import path (rollart.rewards.python)."""

    type: Literal["python"] = "python"
    scored_by: ScoredBy = "reward"  # user code of unknown cost: not on the env member's loop unless asked
    function: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")  # module:fn
    timeout_s: float = Field(default=10.0, gt=0)
    concurrency: int = Field(default=DEFAULT_REWARD_CONCURRENCY, ge=1)

    @model_validator(mode="after")
    def _needs_a_function(self) -> "PythonReward":
        if self.function is None:
            raise ValueError("type python needs a function ('package.module:fn')")
        return self


def _reward_type(value: Any) -> Any:
    """The union's tag: ``type``, ``env`` when a mapping leaves it out."""
    if isinstance(value, dict):
        return value.get("type", "env")
    return getattr(value, "type", None)


# How a tag's trajectories are scored (see rollart.rewards): one model per ``type``, each with only
# its own fields, so a field of another type (``url`` on a rule) is an error naming it.
RewardSpec: TypeAlias = Annotated[
    Annotated[EnvReward, Tag("env")] | Annotated[RuleReward, Tag("rule")] | Annotated[HttpReward, Tag("http")]
    | Annotated[JudgeReward, Tag("judge")] | Annotated[PythonReward, Tag("python")],
    Discriminator(_reward_type, custom_error_type="reward_type",
                  custom_error_message=f"reward type must be one of {', '.join(REWARD_TYPES)}"),
]


def _reward_url_problem(url: str | None, allow_insecure_remote: bool) -> str | None:
    """Why an http reward's url cannot be used, or None (plain HTTP only to loopback unless allowed)."""
    import ipaddress
    from urllib.parse import urlparse

    if not url:
        return "type http needs a url"
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        return f"reward url {url!r} must be http(s)"
    host = parsed.hostname
    try:
        loopback = host == "localhost" or (host is not None and ipaddress.ip_address(host).is_loopback)
    except ValueError:
        loopback = False
    if parsed.scheme == "http" and not loopback and not allow_insecure_remote:
        return f"refusing plain HTTP to {host}: use https or set allow_insecure_remote"
    return None


class DatasetSpec(Section):
    """A tag's prompt dataset (see rollart.datasets); a plain path is ``{path: ...}``."""

    path: Path
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"  # auto: a directory is hf, *.parquet parquet
    prompt_field: str = "prompt"
    answer_field: str | None = "answer"  # given to rewards as the label "answer"; None: no answer
    label_fields: tuple[str, ...] = ()  # more columns passed on as labels, under their own names
    split: str | None = None  # a Hugging Face DatasetDict's split (default: train)
    # Held out for evaluation (``eval:``), never trained on: the last ``eval_rows`` rows, or a Hugging
    # Face DatasetDict's ``eval_split`` (e.g. test) while training reads ``split``.
    eval_rows: int = Field(default=0, ge=0)
    eval_split: str | None = None

    @model_validator(mode="after")
    def _one_holdout(self) -> "DatasetSpec":
        if self.eval_rows and self.eval_split:
            raise ValueError("eval_rows and eval_split both hold rows out; choose one")
        return self

    @property
    def holds_out(self) -> bool:
        return bool(self.eval_rows or self.eval_split)


class Latency(Section):
    """A delay drawn per call (rollart.envs.faults)."""

    dist: Literal["fixed", "gaussian", "exponential"] = "fixed"
    mean_s: float = Field(default=0.0, ge=0)
    sigma_s: float = Field(default=0.0, ge=0)

    def draw(self, rng: random.Random) -> float:
        if self.mean_s == 0:
            return 0.0
        if self.dist == "gaussian":
            return max(0.0, rng.gauss(self.mean_s, self.sigma_s))
        if self.dist == "exponential":
            return rng.expovariate(1 / self.mean_s)
        return self.mean_s


class FaultSpec(Section):
    """Faults injected into a tag's env (``tags.<tag>.faults``; rollart.envs.faults.FaultyEnv)."""

    reset_latency: Latency = Latency()
    step_latency: Latency = Latency()
    reset_failure_rate: float = Field(default=0.0, ge=0, le=1)
    step_failure_rate: float = Field(default=0.0, ge=0, le=1)
    hang_rate: float = Field(default=0.0, ge=0, le=1)  # a step that never returns (until a timeout)
    # A straggler: a step that takes straggler_latency on top of step_latency (a slow machine, a
    # cold cache, a contended sandbox).
    straggler_rate: float = Field(default=0.0, ge=0, le=1)
    straggler_latency: Latency = Latency()


class TagConfig(Section):
    """One task domain: its environment, generation pool, reward and sampling weight."""

    env: str
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    pool: str | None = None  # None: routing.default_pool
    weight: float = Field(default=1.0, ge=0)
    dataset: DatasetSpec | None = None  # prompt tasks: JSONL, parquet or a Hugging Face dataset directory
    max_turns: int | None = Field(default=None, ge=1)
    reward: RewardSpec = EnvReward()
    faults: FaultSpec | None = None

    @field_validator("dataset", mode="before")
    @classmethod
    def _path_is_a_dataset(cls, value: Any) -> Any:
        return {"path": value} if isinstance(value, (str, Path)) else value


class RoutingConfig(Section):
    default_pool: str | None = None  # None: the first of ``pools``
    live_check_interval_s: float = Field(default=1.0, gt=0)


class FeederConfig(Section):
    group_size: int = Field(default=4, ge=1)
    redundancy: int = Field(default=0, ge=0)  # extra rollouts per group, aborted once group_size completed
    # Replacement rollouts on demand: a member that ends for a fault (env reset/step failure or timeout,
    # generation timeout, ownership lost) is replaced by a fresh trajectory of the same task, at most
    # this many per group, so a group completes unless its environment is persistently broken.
    max_replacements: int = Field(default=4, ge=0)
    groups_per_batch: int = Field(default=4, ge=1)
    alpha: int | None = Field(default=1, ge=0)  # staleness bound; None: no bound (rollout without a trainer)
    # stream: release a group whenever the bound allows (rollart). batch: release a batch's groups
    # together, and the next batch only once every group of the previous one has ended (batch-
    # synchronous rollout; with alpha 1 this is the "one-off" pipeline of one-step off-policy systems).
    release: Literal["stream", "batch"] = "stream"
    # Liveness: when the bound holds the feeder back and the trainer has waited this long for a batch,
    # release one more batch anyway. The counters can over-count after crashes (a group accepted at
    # the env stage that the trainer cannot use, a slot reserved by a feeder killed before it sent the
    # task, a Redis rebuild); without this the run would stop. Staleness stays bounded: stale rollouts
    # are aborted and stale groups evicted. None: never.
    starvation_release_s: float | None = Field(default=30.0, gt=0)
    max_groups: int | None = Field(default=None, ge=1)  # stop after releasing this many (None: unbounded)
    seed: int = 0
    # The longest a blocked feeder waits between checks: changes to the bound are announced (Redis
    # pub/sub) and wake it at once; this bounds the time-driven ones (the starvation release).
    poll_interval_s: float = Field(default=1.0, gt=0)


class EnvStageConfig(Section):
    max_groups: int = Field(default=16, ge=1)  # task groups running at once per env consumer
    reset_timeout_s: float = Field(default=30.0, gt=0)
    step_timeout_s: float = Field(default=30.0, gt=0)
    reset_attempts: int = Field(default=3, ge=1)
    generation_timeout_s: float = Field(default=120.0, gt=0)  # from sending a request to its result
    pool_wait_s: float = Field(default=600.0, ge=0)  # wait this long for any live pool before sending
    # On SIGTERM or revocation, running groups get this long to finish; the rest are cut off and
    # rerun by whoever gets their task next (their task offsets are not committed).
    shutdown_grace_s: float = Field(default=5.0, ge=0)
    sampling: SamplingConfig = SamplingConfig()
    # Run each env member inside a generation member of this pool, one process (the ``envgen`` stage):
    # a turn is then a function call instead of a message each way between two processes' event loops
    # (on 2 cores ~0.1 ms of CPU a turn less; README, "How a rollout flows"). None: apart, each stage its
    # own process or pod. Needs generation.transport: direct.
    colocate_pool: str | None = None


TANSU_HAS_NO_TRANSACTIONS = ("bus.processing_guarantee: exactly_once needs Kafka transactions, which Tansu (the "
                             "broker here) does not have; use Apache Kafka or at_least_once")


class EvalConfig(Section):
    """Held-out evaluation during training (see rollart.stages.evaluation): at every ``every_versions``-th
    policy version the eval stage releases the same eval tasks, pinned to that version; they run through
    the env stage on ``pool`` (a generation pool that loads exactly the pinned version and serves no
    training tag), are scored by the reward stage and never reach the trainer."""

    tags: tuple[str, ...] = Field(min_length=1)  # tags evaluated (their env, reward and dataset from tags:)
    pool: str  # the eval pool: one of pools, used by no training tag
    every_versions: int = Field(default=10, ge=1)
    initial: bool = True  # also evaluate version 0, the policy before training
    tasks_per_tag: int = Field(default=8, ge=1)  # env tags: seeds 2^31.. (training draws below); datasets: held-out rows
    group_size: int = Field(default=1, ge=1)  # rollouts per eval task (success is their mean)
    sampling: SamplingConfig | None = None  # None: env.sampling at temperature 0 (greedy, the same turn length)
    seed: int = 0  # picks the eval seeds; the same for every version, so versions compare
    timeout_s: float = Field(default=600.0, gt=0)  # an eval not over by then is summarised as incomplete
    record: Path | None = None  # also append each summary to this JSON-lines file (`rollart run` sets it)


class TensorBoardTracking(Section):
    dir: Path  # event files go to <dir>/<run name>


class WandbTracking(Section):
    project: str = "rollart"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = "offline"  # online needs WANDB_API_KEY
    dir: Path | None = None


class MlflowTracking(Section):
    tracking_uri: str  # e.g. sqlite:///runs/mlflow.db (a local store), or http://mlflow:5000
    experiment: str = "rollart"


class TrackingConfig(Section):
    """Experiment trackers the trainer logs each step to (see rollart.tracking); none by default."""

    run_name: str | None = None  # default: the job name (a resumed trainer continues the run)
    tensorboard: TensorBoardTracking | None = None
    wandb: WandbTracking | None = None
    mlflow: MlflowTracking | None = None


class StageScheduling(Section):
    """How Linux schedules one stage's processes in a run on one machine, their children (vLLM's
    engine core and worker) included. Its scheduler gives a process CPU in proportion to a weight that
    falls ~1.25x per nice level, and a waking process of the normal policy preempts the running one: a
    trainer that sets the loop's pace otherwise loses its core hundreds of times a second to the
    rollout's short wake-ups."""

    nice: int = Field(default=0, ge=-20, le=19)  # added to the runner's; below 0 needs CAP_SYS_NICE
    # batch (SCHED_BATCH): the process never preempts a running one when it wakes; it waits for a free
    # core or the running one's turn to end. idle (SCHED_IDLE): it also runs only on CPU no other
    # policy's thread wants (a weight below nice 19's, whatever its niceness)
    policy: Literal["normal", "batch", "idle"] = "normal"
    # The time slice the stage's threads ask the scheduler for (EEVDF, Linux 6.12+: sched_setattr's
    # sched_runtime; None: the kernel's default, ~1-3 ms). A longer one lets a busy trainer run that long
    # before a rollout thread that woke on its core gets a turn: 20 ms made demo steps 0.93-0.94x as
    # long (README, CPU plan). Normal and batch policies only: the kernel ignores it under idle.
    slice_ms: float | None = Field(default=None, ge=0.1, le=100)
    # The policy a member starts under, at the runner's niceness, until its readiness probe (/readyz)
    # passes; then the setting above (None: the setting above from the start). A generation member's
    # start (torch, vLLM, its engine) is the run's critical path; the other stages' starts are not.
    startup_policy: Literal["normal", "batch", "idle"] | None = None

    def at_startup(self) -> "StageScheduling":
        """How the stage's members are scheduled while they start."""
        return self if self.startup_policy is None else StageScheduling(policy=self.startup_policy)

    @model_validator(mode="after")
    def _slice_needs_a_fair_policy(self) -> "StageScheduling":
        if self.slice_ms is not None and self.policy == "idle":
            raise ValueError("slice_ms is set but policy is idle: Linux takes a slice request for the normal "
                             "and batch policies only")
        return self


class MachineConfig(Section):
    """How a run on one machine (``rollart run``, ``rollout``, the chaos and soak runners) shares its
    cores between the stages: the CPU plan (README)."""

    # stage -> its scheduling. Keys are stage names, checked when a run starts (the stages are
    # declared in rollart.stages.registry), and "stack": the local stack's services a run starts for
    # itself (broker, Redis, Mooncake). A stage not named runs as the runner does. The stages and the
    # stack share the runner's session, so these weigh between them (Linux's autogroup shares the CPU
    # between sessions first). The rollout stages at nice 5 and SCHED_BATCH made demo steps 0.88-0.95x
    # as long; SCHED_IDLE starved the rollout, 1.10x; nice 15 halved the training thread's wait for a
    # core against nice 5 (configs/demo.yaml; README, "Stage scheduling").
    # Not the default: it puts a busy trainer before everything else, a member scaled up mid-run
    # included. On Kubernetes each stage's CPU request plays this part.
    scheduling: dict[str, StageScheduling] = Field(default_factory=dict)


class RollartConfig(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ROLLART_",
        env_nested_delimiter="_",
        env_nested_max_split=1,
        env_parse_none_str="null",  # ROLLART_FEEDER_ALPHA=null unsets a field
        extra="forbid",
        frozen=True,
    )

    job: str = Field(default="rollart", pattern=JOB_NAME_PATTERN)
    pools: list[str] = Field(default_factory=lambda: ["default"], min_length=1)
    topics: Path | None = None  # catalog directory; None: the repository's topics/
    kafka: KafkaConfig = KafkaConfig()
    redis: RedisConfig = RedisConfig()
    bus: BusConfig = BusConfig()
    metrics: MetricsConfig = MetricsConfig()
    mooncake: MooncakeConfig = MooncakeConfig()
    model: ModelConfig = ModelConfig()
    generation: GenerationConfig = GenerationConfig()
    routing: RoutingConfig = RoutingConfig()
    feeder: FeederConfig = FeederConfig()
    env: EnvStageConfig = EnvStageConfig()
    weights: WeightsConfig = WeightsConfig()
    trainer: TrainerConfig = TrainerConfig()
    tags: dict[str, TagConfig] = Field(default_factory=dict)
    tracking: TrackingConfig = TrackingConfig()
    eval: EvalConfig | None = None
    deploy: DeployConfig = DeployConfig()
    # No section may be named ``local``: ROLLART_LOCAL_* are the local stack's own variables
    # (rollart/local/brokers.py), and as a section's fields they would be unknown ones.
    machine: MachineConfig = MachineConfig()

    @model_validator(mode="after")
    def _check_processing_guarantee(self) -> "RollartConfig":
        if self.bus.processing_guarantee == "exactly_once" and self.kafka.broker == "tansu":
            raise ValueError(TANSU_HAS_NO_TRANSACTIONS)
        if self.bus.processing_guarantee == "exactly_once" and self.kafka.broker == "memory":
            raise ValueError("bus.processing_guarantee: exactly_once needs Kafka transactions, which the in-memory "
                             "broker does not have; use Apache Kafka or at_least_once")
        return self

    @model_validator(mode="after")
    def _check_min_group_size(self) -> "RollartConfig":
        if (self.trainer.min_group_size or 0) > self.feeder.group_size:
            raise ValueError(f"trainer.min_group_size {self.trainer.min_group_size} is more than feeder.group_size "
                             f"{self.feeder.group_size}")
        return self

    def tag_quotas(self) -> dict[str, int]:
        """Each weighted tag's groups in a batch under ``trainer.task_mix: weights`` (largest remainder
        of ``groups_per_batch`` by weight); {} under ``arrival``."""
        if self.trainer.task_mix != "weights":
            return {}
        return self.tag_shares(self.feeder.groups_per_batch)

    def tag_shares(self, total: int) -> dict[str, int]:
        """``total`` split over the weighted tags by weight (largest remainder: the parts sum to it)."""
        weights = {tag: spec.weight for tag, spec in self.tags.items() if spec.weight > 0}
        if not weights:
            return {}
        exact = {tag: total * w / sum(weights.values()) for tag, w in weights.items()}
        shares = {tag: int(share) for tag, share in exact.items()}
        for tag in sorted(exact, key=lambda t: exact[t] - shares[t], reverse=True)[:total - sum(shares.values())]:
            shares[tag] += 1
        return shares

    def min_group_size(self) -> int:
        """The fewest scored members a group trains with (``trainer.min_group_size``, default the group)."""
        return self.trainer.min_group_size or self.feeder.group_size

    @model_validator(mode="after")
    def _check_kafka_users(self) -> "RollartConfig":
        if self.deploy.kafka_users and (self.kafka.security_protocol not in ("SASL_SSL", "SASL_PLAINTEXT")
                                        or self.kafka.sasl_mechanism != "SCRAM-SHA-512"):
            raise ValueError("deploy.kafka_users: Strimzi's KafkaUsers log in with SCRAM-SHA-512; set "
                             "kafka.security_protocol SASL_SSL (or SASL_PLAINTEXT) and kafka.sasl_mechanism "
                             "SCRAM-SHA-512")
        return self

    @model_validator(mode="after")
    def _check_stream_batch(self) -> "RollartConfig":
        """A batch trained group by group needs advantages per group and the whole batch on one rank."""
        if not self.trainer.stream_batch:
            return self
        if self.trainer.advantage_norm == "batch":
            raise ValueError("trainer.stream_batch: trainer.advantage_norm batch normalises over the whole batch; "
                             "set it false")
        if self.trainer.world_size > 1:
            raise ValueError("trainer.stream_batch: trainer.world_size > 1 shares each batch over ranks; set it false")
        return self

    @model_validator(mode="after")
    def _check_pools(self) -> "RollartConfig":
        unknown = sorted(set(self.deploy.pools) - set(self.pools))
        if unknown:
            raise ValueError(f"deploy.pools {unknown} are not among pools {self.pools}")
        if self.env.colocate_pool is not None and self.env.colocate_pool not in self.pools:
            raise ValueError(f"env.colocate_pool {self.env.colocate_pool!r} is not one of pools {self.pools}")
        if self.env.colocate_pool is not None and self.generation.transport != "direct":
            raise ValueError("env.colocate_pool: a co-located env member calls its generation member on the direct "
                             "path; set generation.transport: direct")
        if self.routing.default_pool is not None and self.routing.default_pool not in self.pools:
            raise ValueError(f"routing.default_pool {self.routing.default_pool!r} is not one of pools {self.pools}")
        for tag, spec in self.tags.items():
            if spec.pool is not None and spec.pool not in self.pools:
                raise ValueError(f"tags.{tag}.pool {spec.pool!r} is not one of pools {self.pools}")
            if isinstance(spec.reward, JudgeReward) and spec.reward.pool not in self.pools:
                raise ValueError(f"tags.{tag}.reward.pool {spec.reward.pool!r} (the judge) is not one of {self.pools}")
        return self

    @model_validator(mode="after")
    def _check_eval(self) -> "RollartConfig":
        if self.eval is None:
            return self
        pool = self.eval.pool
        if pool not in self.pools:
            raise ValueError(f"eval.pool {pool!r} is not one of pools {self.pools}")
        for tag in self.eval.tags:
            if tag not in self.tags:
                raise ValueError(f"eval.tags: {tag!r} is not one of tags {sorted(self.tags)}")
            dataset = self.tags[tag].dataset
            if self.tags[tag].weight > 0 and dataset is not None and not dataset.holds_out:
                raise ValueError(f"eval.tags: {tag!r} trains on its whole dataset; hold rows out "
                                 f"(tags.{tag}.dataset.eval_rows or eval_split) or evaluate a tag of weight 0")
        for tag, spec in self.tags.items():
            # The eval pool holds the version being evaluated, not the latest: it cannot serve training.
            if spec.weight > 0 and self.pool_for(tag) == pool:
                raise ValueError(f"eval.pool {pool!r} serves tags.{tag}, which trains; give the tag another pool "
                                 f"(tags.{tag}.pool or routing.default_pool)")
            if isinstance(spec.reward, JudgeReward) and spec.reward.pool == pool:
                raise ValueError(f"eval.pool {pool!r} is tags.{tag}.reward.pool (a judge follows the latest version)")
        return self

    def eval_sampling(self) -> SamplingConfig:
        """How eval turns are sampled: ``eval.sampling``, else the training turns' settings, greedy."""
        if self.eval is not None and self.eval.sampling is not None:
            return self.eval.sampling
        return self.env.sampling.model_copy(update={"temperature": 0.0})

    def pool_deployment(self, pool: str) -> StageDeployment:
        return self.deploy.pools.get(pool) or gpu_stage(autoscaling=Autoscaling(max_replicas=8))

    def pool_for(self, tag: str) -> str:
        spec = self.tags.get(tag)
        if spec is not None and spec.pool:
            return spec.pool
        return self.routing.default_pool or self.pools[0]

    def with_updates(self, source: str = "override", **updates: Any) -> "RollartConfig":
        """This config with ``updates`` merged in (nested sections as dicts or models), validated
        again as a whole: an override breaks no rule a config file could not (``--job a.b`` is refused,
        naming the field). The environment was applied once already and does not override them."""
        data = _merged(self.model_dump(exclude_unset=True), updates)  # what was set stays set
        token = _REVALIDATING.set(True)
        try:
            return build_config(data, source)
        finally:
            _REVALIDATING.reset(token)

    @classmethod
    def settings_customise_sources(cls, settings_cls: Any, init_settings: Any, env_settings: Any, dotenv_settings: Any,
                                   file_secret_settings: Any) -> tuple[Any, ...]:
        if _REVALIDATING.get():
            return (init_settings,)
        # Environment first: it overrides what the YAML file (passed as init kwargs) says.
        return (env_settings, init_settings)


_REVALIDATING: ContextVar[bool] = ContextVar("rollart_config_revalidating", default=False)


def _merged(base: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in updates.items():
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        # A different reward type is a different model: replaced, not merged into the old one's fields.
        if isinstance(value, dict) and isinstance(merged.get(key), dict) \
                and value.get("type", merged[key].get("type")) == merged[key].get("type"):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def _field_path(loc: tuple[int | str, ...]) -> str:
    """``loc`` as a dotted path of fields: without the reward type pydantic adds as a step through the
    union (``tags.web.reward.url``, not ``tags.web.reward.http.url``)."""
    parts = list(loc)
    if len(parts) > 3 and parts[0] == "tags" and parts[2] == "reward" and parts[3] in REWARD_TYPES:
        del parts[3]
    return ".".join(str(p) for p in parts) or "<root>"


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for err in exc.errors():
        where = _field_path(err["loc"])
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def build_config(data: dict[str, Any], source: str = "<dict>") -> RollartConfig:
    try:
        return RollartConfig(**data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def load_config(path: str | Path | None = None) -> RollartConfig:
    """Load a job config from YAML (or defaults when ``path`` is None) plus env overrides."""
    if path is None:
        return build_config({}, "defaults + environment")
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level, got {type(data).__name__}")
    return build_config(data, str(path))
