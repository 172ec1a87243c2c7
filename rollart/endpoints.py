"""Where the broker and Redis are: configuration/environment first, then the running local stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollart.config import KafkaConfig, RollartConfig
from rollart.local.stack import StackState, state_path


class NoEndpointError(RuntimeError):
    """No broker or Redis is configured and no local stack is running."""


@dataclass(frozen=True)
class Endpoints:
    kafka_bootstrap: str
    redis_url: str
    source: str  # "config", "local stack", or "config + local stack"
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None


def resolve_endpoints(config: RollartConfig) -> Endpoints:
    bootstrap, redis_url = config.kafka.bootstrap, config.redis.url
    master, metadata = config.mooncake.master, config.mooncake.metadata_server
    if bootstrap and redis_url:
        if not (master and metadata):  # the local stack may still hold the Mooncake store
            state = StackState.read()
            if state is not None and state.alive() and state.kafka_bootstrap == bootstrap:
                master, metadata = state.mooncake_master, state.mooncake_metadata
        return Endpoints(bootstrap, redis_url, "config", master, metadata)
    state = StackState.read()
    if state is not None and not state.alive():
        raise NoEndpointError(
            f"the local stack recorded in {state_path()} is down (broker {state.kafka_bootstrap}, pid "
            f"{state.broker_pid}, no longer running): run `rollart local up` to start it again, "
            "or set ROLLART_KAFKA_BOOTSTRAP / ROLLART_REDIS_URL")
    if state is None:
        missing = " and ".join(n for n, v in (("Kafka bootstrap", bootstrap), ("Redis URL", redis_url)) if not v)
        raise NoEndpointError(
            f"no {missing} configured and no local stack is running ({state_path()}): "
            "run `rollart local up`, or set ROLLART_KAFKA_BOOTSTRAP / ROLLART_REDIS_URL"
        )
    source = "local stack" if not (bootstrap or redis_url) else "config + local stack"
    return Endpoints(bootstrap or state.kafka_bootstrap, redis_url or state.redis_url, source,
                     master or state.mooncake_master, metadata or state.mooncake_metadata)


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
