"""Where the broker and Redis are: configuration/environment first, then the local stack `rollart local up`
recorded (read only for what is not configured)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rollart.config import ConfigError, KafkaConfig, RedisConfig, RollartConfig
from rollart.local.state import StackState, state_path


class NoEndpointError(RuntimeError):
    """No broker or Redis is configured and no local stack is running."""


@dataclass(frozen=True)
class Endpoints:
    kafka_bootstrap: str
    redis_url: str
    source: str  # "config", "local stack", or "config + local stack"
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    broker: Literal["kafka", "tansu", "memory"] = "kafka"  # what serves kafka_bootstrap (see KafkaConfig.broker)
    # Redis auth/TLS from config (redis-py connection keywords); not printed, it holds the password.
    redis_options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # A secured local Kafka (rollart.local.security folder): clients log in with its settings.
    kafka_security: str | None = None


def resolve_endpoints(config: RollartConfig) -> Endpoints:
    """The configured endpoints (config or ``ROLLART_*`` environment) as they are, the broker's kind
    and the Mooncake store included; only what is not configured comes from the stack `rollart local
    up` recorded, and its state file is read only then (a stale one never overrides a configured
    endpoint). A stage process of a local run gets every endpoint in its environment
    (:mod:`rollart.local.processes`), so it never reads the file either."""
    bootstrap, redis_url = config.kafka.bootstrap, config.redis.url
    master, metadata = config.mooncake.master, config.mooncake.metadata_server
    if bootstrap and redis_url:
        return Endpoints(bootstrap, redis_url, "config", master, metadata, config.kafka.broker,
                         redis_client_kwargs(config.redis, redis_url))
    state = StackState.read()
    if state is not None and not state.alive():
        raise NoEndpointError(
            f"the local stack recorded in {state_path()} is down (broker {state.kafka_bootstrap}; not running: "
            f"{', '.join(state.dead())}; logs in {state.log_dir}): run `rollart local up` to start it again, "
            "or set ROLLART_KAFKA_BOOTSTRAP / ROLLART_REDIS_URL")
    if state is None:
        missing = " and ".join(n for n, v in (("Kafka bootstrap", bootstrap), ("Redis URL", redis_url)) if not v)
        raise NoEndpointError(
            f"no {missing} configured and no local stack is running ({state_path()}): "
            "run `rollart local up`, or set ROLLART_KAFKA_BOOTSTRAP / ROLLART_REDIS_URL"
        )
    source = "local stack" if not (bootstrap or redis_url) else "config + local stack"
    redis_url = redis_url or state.redis_url
    broker = config.kafka.broker if bootstrap else state.broker_kind
    return Endpoints(bootstrap or state.kafka_bootstrap, redis_url, source, master or state.mooncake_master,
                     metadata or state.mooncake_metadata, broker, redis_client_kwargs(config.redis, redis_url))


def redis_client_kwargs(redis: RedisConfig, url: str) -> dict[str, Any]:
    """Auth and TLS settings for redis-py (they pass through from config; the URL may carry them too)."""
    kwargs: dict[str, Any] = {}
    if redis.username:
        kwargs["username"] = redis.username
    if redis.password is not None:
        kwargs["password"] = redis.password.get_secret_value()
    tls = {"ssl_ca_certs": redis.ssl_ca_certs, "ssl_certfile": redis.ssl_certfile, "ssl_keyfile": redis.ssl_keyfile}
    tls = {k: str(v) for k, v in tls.items() if v is not None}
    if tls and not url.startswith("rediss://"):
        # Certificates for a plain connection would be silently unused: say so at start-up instead.
        name = next(iter(tls))
        raise ConfigError(f"redis.{name} is set but redis.url ({url.split('@')[-1]}) is not a rediss:// (TLS) URL")
    return {**kwargs, **tls}


def kafka_client_kwargs(kafka: KafkaConfig, bootstrap: str) -> dict[str, Any]:
    """Connection settings shared by every aiokafka client (SASL/TLS pass through from config)."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "security_protocol": kafka.security_protocol,
        "request_timeout_ms": kafka.request_timeout_ms,
    }
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        kwargs["ssl_context"] = create_ssl_context(
            cafile=str(kafka.ssl_cafile) if kafka.ssl_cafile else None,
            certfile=str(kafka.ssl_certfile) if kafka.ssl_certfile else None,
            keyfile=str(kafka.ssl_keyfile) if kafka.ssl_keyfile else None,
        )
    if kafka.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = kafka.sasl_mechanism or "PLAIN"
        kwargs["sasl_plain_username"] = kafka.sasl_username
        kwargs["sasl_plain_password"] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
    return kwargs
