"""Configuration: YAML + ROLLART_* overrides; bad input fails at start-up naming the field."""

from __future__ import annotations

import pytest

from rollart.config import ConfigError, build_config, load_config


def test_yaml_with_env_overrides(tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    path.write_text("job: demo\nkafka:\n  bootstrap: file:9092\nbus:\n  max_in_flight: 7\n  fetch_max_wait_ms: 50\n")
    monkeypatch.setenv("ROLLART_KAFKA_BOOTSTRAP", "env:9092")
    monkeypatch.setenv("ROLLART_BUS_FETCH_MAX_WAIT_MS", "5")
    config = load_config(path)
    assert config.job == "demo"
    assert config.kafka.bootstrap == "env:9092", "the environment wins over the file"
    assert config.bus.fetch_max_wait_ms == 5
    assert config.bus.max_in_flight == 7, "fields the environment does not name keep the file's value"


@pytest.mark.parametrize(
    "text, field",
    [
        ("bus:\n  max_in_flght: 3\n", "bus.max_in_flght"),
        ("bus:\n  max_in_flight: 0\n", "bus.max_in_flight"),
        ("job: has.dots\n", "job"),
        ("kafka:\n  security_protocol: SASL_WHATEVER\n", "kafka.security_protocol"),
        ("nonsense: 1\n", "nonsense"),
        ("generation:\n  omp_threads_bind: cores-0-1\n", "generation.omp_threads_bind"),
        ("generation:\n  block_size: 0\n", "generation.block_size"),
        ("trainer:\n  torch_threads: 0\n", "trainer.torch_threads"),
        ("trainer:\n  dual_clip: 0.9\n", "trainer.dual_clip"),
        ("trainer:\n  mixed_precision: fp16\n", "trainer.mixed_precision"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, text, field):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"  {field}:" in str(err.value) and "bad.yaml" in str(err.value)


def test_unreadable_or_non_mapping_config(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_bad_env_override_names_the_field(monkeypatch):
    monkeypatch.setenv("ROLLART_BUS_MAX_IN_FLIGHT", "lots")
    with pytest.raises(ConfigError, match="bus.max_in_flight"):
        load_config(None)


def test_an_override_is_validated_like_the_file_and_keeps_what_was_set(monkeypatch):
    """`RollartConfig.with_updates`: what `--job`, the runners and `--refeed-to` change goes through
    the same validators as a config file (model_copy would have let `--job a.b` through), nested
    sections merge, and the environment, applied once already, does not override the update."""
    from rollart.config import build_config

    monkeypatch.setenv("ROLLART_JOB", "from-env")
    config = build_config({"redis": {"url": "redis://a:1/0", "key_prefix": "kp"},
                           "tags": {"grid": {"env": "frozenlake"}}})
    assert config.job == "from-env"
    updated = config.with_updates(job="explicit", redis={"url": "redis://b:2/0"})
    assert (updated.job, updated.redis.url, updated.redis.key_prefix) == ("explicit", "redis://b:2/0", "kp")
    assert "reward" not in updated.tags["grid"].model_fields_set, "a default stays a default (declarations fill it)"
    with pytest.raises(ConfigError, match=r"\(--job\):\n  job: String should match pattern"):
        config.with_updates("--job", job="a.b")
    with pytest.raises(ConfigError, match="bus.processing_guarantee"):
        config.with_updates(kafka={"broker": "tansu"}, bus={"processing_guarantee": "exactly_once"})


def test_a_bad_job_on_the_command_line_exits_2_naming_it():
    from typer.testing import CliRunner

    from rollart.cli import app

    result = CliRunner().invoke(app, ["lag", "--job", "a.b"])
    assert result.exit_code == 2
    assert "job: String should match pattern" in result.output


@pytest.mark.parametrize("reward, problem", [
    ({"type": "http"}, "type http needs a url"),
    ({"type": "http", "url": "ftp://rewards.example/score"}, "reward url .ftp://rewards.example/score. must be http"),
    ({"type": "http", "url": "http://rewards.example/score"}, "refusing plain HTTP to rewards.example"),
])
def test_an_unusable_http_reward_fails_at_config_load_naming_the_tag(reward, problem):
    from rollart.config import build_config

    with pytest.raises(ConfigError, match=rf"tags\.web\.reward: Value error, {problem}"):
        build_config({"tags": {"web": {"env": "frozenlake", "reward": reward}}})
    allowed = {**reward, "allow_insecure_remote": True}
    if problem.startswith("refusing"):
        assert build_config({"tags": {"web": {"env": "frozenlake", "reward": allowed}}}).tags["web"].reward.url


@pytest.mark.parametrize("reward, model", [
    (None, "EnvReward"),
    ({}, "EnvReward"),
    ({"type": "env"}, "EnvReward"),
    ({"type": "rule", "rule": "math_answer", "format_penalty": -1}, "RuleReward"),
    ({"type": "http", "url": "https://rewards.example/score", "token_env": "T", "attempts": 2}, "HttpReward"),
    ({"type": "judge", "pool": "default", "judge_max_tokens": 4}, "JudgeReward"),
    ({"type": "python", "function": "pkg.mod:fn", "timeout_s": 3}, "PythonReward"),
])
def test_each_reward_type_parses_to_its_own_model(reward, model):
    from rollart.config import build_config

    tag = {"env": "frozenlake"} if reward is None else {"env": "frozenlake", "reward": reward}
    config = build_config({"tags": {"t": tag}})
    spec = config.tags["t"].reward
    assert type(spec).__name__ == model
    assert config.with_updates(job="again").tags["t"].reward == spec, "a dump of what was set picks the model again"


@pytest.mark.parametrize("reward, field", [
    ({"type": "rule", "rule": "format", "url": "https://rewards.example/score"}, "url"),
    ({"type": "env", "include_env_reward": False}, "include_env_reward"),
    ({"rule": "math_answer"}, "rule"),  # no type: env, which has no rule
    ({"type": "http", "url": "https://rewards.example/score", "pool": "default"}, "pool"),
    ({"type": "judge", "pool": "default", "function": "pkg.mod:fn"}, "function"),
    ({"type": "python", "function": "pkg.mod:fn", "judge_prompt": "?"}, "judge_prompt"),
])
def test_a_field_of_another_reward_type_is_refused_naming_it(reward, field):
    from rollart.config import build_config

    with pytest.raises(ConfigError, match=rf"tags\.t\.reward\.{field}: Extra inputs are not permitted"):
        build_config({"tags": {"t": {"env": "frozenlake", "reward": reward}}})


def test_an_unknown_reward_type_is_refused_naming_the_types():
    from rollart.config import build_config

    with pytest.raises(ConfigError, match=r"tags\.t\.reward: reward type must be one of env, rule, http, judge, python"):
        build_config({"tags": {"t": {"env": "frozenlake", "reward": {"type": "llm"}}}})


def test_an_override_that_changes_the_reward_type_replaces_the_reward():
    from rollart.config import HttpReward, build_config

    config = build_config({"tags": {"t": {"env": "frozenlake", "reward": {"type": "rule", "rule": "format"}}}})
    changed = config.with_updates(tags={"t": {"reward": {"type": "http", "url": "https://rewards.example/score"}}})
    assert isinstance(changed.tags["t"].reward, HttpReward)
    kept = config.with_updates(tags={"t": {"reward": {"include_env_reward": False}}})
    assert kept.tags["t"].reward.rule == "format" and not kept.tags["t"].reward.include_env_reward


def test_the_local_stacks_own_variables_are_not_read_as_config(monkeypatch):
    """ROLLART_LOCAL_* tune the stack a command starts (rollart/local/brokers.py), not the job: a config
    section named like them would turn `--broker tansu` into an unknown field and fail every command."""
    from rollart.local.brokers import BROKER_ENV, KAFKA_HEAP_ENV, KAFKA_LIBS_ENV, KAFKA_OPTS_ENV

    for name in (BROKER_ENV, KAFKA_HEAP_ENV, KAFKA_LIBS_ENV, KAFKA_OPTS_ENV):
        assert name.startswith("ROLLART_LOCAL_")
        monkeypatch.setenv(name, "tansu")
    assert load_config(None).machine.scheduling == {}, "loads, with its defaults"


def test_megatron_mixed_precision_on_a_cpu_is_refused_at_load_naming_the_field(tmp_path):
    """Megatron-core's layers fail mid-step under CPU autocast: the config says so before anything starts;
    the PyTorch backend on a CPU, and Megatron on CUDA, take bf16."""
    path = tmp_path / "megatron.yaml"
    path.write_text("trainer:\n  backend: megatron\n  device: cpu\n  mixed_precision: bf16\n")
    with pytest.raises(ConfigError, match="trainer.mixed_precision: bf16 with trainer.backend megatron needs device cuda"):
        load_config(path)
    for trainer in ("  backend: torch\n  device: cpu\n", "  backend: megatron\n  device: cuda\n"):
        path.write_text(f"trainer:\n{trainer}  mixed_precision: bf16\n")
        assert load_config(path).trainer.mixed_precision == "bf16"
    path.write_text("trainer:\n  mixed_precision: no\n")  # YAML 1.1's false, as Accelerate's configs write it
    assert load_config(path).trainer.mixed_precision == "no"
    path.write_text("trainer:\n  mixed_precision: yes\n")
    with pytest.raises(ConfigError, match="trainer.mixed_precision"):
        load_config(path)


def test_a_colocated_pool_must_be_a_pool_on_the_direct_path():
    assert build_config({"pools": ["a"], "generation": {"transport": "direct"},
                         "env": {"colocate_pool": "a"}}).env.colocate_pool == "a"
    with pytest.raises(ConfigError, match=r"env.colocate_pool 'b' is not one of pools \['a'\]"):
        build_config({"pools": ["a"], "generation": {"transport": "direct"}, "env": {"colocate_pool": "b"}})
    with pytest.raises(ConfigError, match="env.colocate_pool: .*set generation.transport: direct"):
        build_config({"pools": ["a"], "generation": {"transport": "bus"}, "env": {"colocate_pool": "a"}})


def test_a_streamed_batch_is_refused_naming_the_field_where_it_cannot_apply():
    assert not build_config({}).trainer.stream_batch, "off by default"
    assert build_config({"trainer": {"stream_batch": True}}).trainer.stream_batch
    with pytest.raises(ConfigError, match=r"trainer.stream_batch: trainer.advantage_norm batch normalises"):
        build_config({"trainer": {"stream_batch": True, "advantage_norm": "batch"}})
    with pytest.raises(ConfigError, match=r"trainer.stream_batch: trainer.world_size > 1"):
        build_config({"trainer": {"stream_batch": True, "world_size": 2}})
