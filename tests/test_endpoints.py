"""Endpoint resolution: configured endpoints are taken as they are, and the state file of the stack
`rollart local up` recorded is read only for what is not configured."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollart.config import load_config
from rollart.endpoints import NoEndpointError, resolve_endpoints
from rollart.local.state import StackState

CONFIGURED = {"ROLLART_KAFKA_BOOTSTRAP": "127.0.0.1:9092", "ROLLART_REDIS_URL": "redis://127.0.0.1:6379/3"}


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch) -> StackState:
    """A recorded stack that names the configured broker but differs in everything else (a Tansu, its
    own Redis and Mooncake store); ``alive``: its broker pid is this process."""
    monkeypatch.setenv("ROLLART_HOME", str(tmp_path))
    for name in (*CONFIGURED, "ROLLART_KAFKA_BROKER", "ROLLART_MOONCAKE_MASTER", "ROLLART_MOONCAKE_METADATA_SERVER"):
        monkeypatch.delenv(name, raising=False)
    state = StackState(kafka_bootstrap=CONFIGURED["ROLLART_KAFKA_BOOTSTRAP"], redis_url="redis://127.0.0.1:6390/0",
                       broker_pid=os.getpid(), redis_pid=None, log_dir=str(tmp_path), started_at=0.0,
                       mooncake_master="127.0.0.1:50051", mooncake_metadata="http://127.0.0.1:8080/metadata",
                       mooncake_pids=[], broker_kind="tansu")
    state.write()
    return state


@pytest.fixture
def reads(monkeypatch) -> list:
    """Every read of a stack state file (the resolution must make none when endpoints are configured)."""
    seen: list = []
    read = StackState.read.__func__  # type: ignore[attr-defined]

    def spy(cls, path=None):
        seen.append(path)
        return read(cls, path)
    monkeypatch.setattr(StackState, "read", classmethod(spy))
    return seen


def test_configured_endpoints_neither_read_nor_take_from_the_recorded_stack(recorded, reads, monkeypatch):
    for name, value in CONFIGURED.items():
        monkeypatch.setenv(name, value)
    endpoints = resolve_endpoints(load_config(None))
    assert (endpoints.kafka_bootstrap, endpoints.redis_url, endpoints.source) == (
        CONFIGURED["ROLLART_KAFKA_BOOTSTRAP"], CONFIGURED["ROLLART_REDIS_URL"], "config")
    assert endpoints.broker == "kafka", "the configured broker kind, not the recorded stack's"
    assert (endpoints.mooncake_master, endpoints.mooncake_metadata) == (None, None)
    assert reads == [], "configured endpoints never read the local stack's state file"


def test_a_stale_recorded_stack_does_not_stop_configured_endpoints(recorded, reads, monkeypatch):
    recorded.broker_pid = 2 ** 22 + 1  # beyond pid_max: dead
    recorded.write()
    for name, value in CONFIGURED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ROLLART_MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("ROLLART_MOONCAKE_METADATA_SERVER", "http://10.0.0.1:8080/metadata")
    endpoints = resolve_endpoints(load_config(None))
    assert (endpoints.kafka_bootstrap, endpoints.mooncake_master) == (CONFIGURED["ROLLART_KAFKA_BOOTSTRAP"],
                                                                     "10.0.0.1:50051")
    assert reads == []
    monkeypatch.delenv("ROLLART_REDIS_URL")  # now the stack must fill in Redis, and it is down
    with pytest.raises(NoEndpointError, match="is down"):
        resolve_endpoints(load_config(None))


def test_a_down_stack_names_the_service_that_is_gone(recorded):
    dead = 2 ** 22 + 1  # beyond pid_max
    recorded.mooncake_pids = [os.getpid(), dead]
    recorded.write()
    assert recorded.dead() == [f"mooncake store (pid {dead})"] and not recorded.alive()
    with pytest.raises(NoEndpointError, match=rf"not running: mooncake store \(pid {dead}\); logs in "):
        resolve_endpoints(load_config(None))
    recorded.mooncake_pids, recorded.broker_pid = [], dead
    assert recorded.dead() == [f"broker (pid {dead})"]
    recorded.broker_pid = None
    assert recorded.dead() == ["broker (pid None)"], "a stack without a broker pid is not alive"


def test_the_recorded_stack_fills_only_what_is_not_configured(recorded, reads, monkeypatch):
    assert resolve_endpoints(load_config(None)) == resolve_endpoints(load_config(None))
    everything = resolve_endpoints(load_config(None))
    assert (everything.source, everything.broker, everything.redis_url, everything.mooncake_master) == (
        "local stack", "tansu", recorded.redis_url, recorded.mooncake_master)
    monkeypatch.setenv("ROLLART_REDIS_URL", CONFIGURED["ROLLART_REDIS_URL"])
    part = resolve_endpoints(load_config(None))
    assert (part.source, part.kafka_bootstrap, part.redis_url) == (
        "config + local stack", recorded.kafka_bootstrap, CONFIGURED["ROLLART_REDIS_URL"])
    assert reads, "the recorded stack is read when something is not configured"
