"""Redis auth and TLS pass through from config to every client (a real redis-server with TLS and ACLs)."""

from __future__ import annotations

import shutil

import pytest
from redis.exceptions import AuthenticationError, ConnectionError as RedisConnectionError

from rollart.bus import Deduplicator
from rollart.config import ConfigError, build_config
from rollart.endpoints import resolve_endpoints
from rollart.local.stack import _spawn, _wait_for_port, free_port, valkey_binary
from rollart.state import connect_redis

PASSWORD = "correct-horse"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory, tls_files):
    """redis-server on TLS only, clients must log in as user `rl` (ACL) with PASSWORD."""
    folder = tmp_path_factory.mktemp("tls-redis")
    port = free_port()
    binary = shutil.which("redis-server") or valkey_binary()
    log = folder / "redis.log"
    proc = _spawn([binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                   "--tls-cert-file", str(tls_files["cert"]), "--tls-key-file", str(tls_files["key"]),
                   "--tls-ca-cert-file", str(tls_files["ca"]), "--tls-auth-clients", "no",
                   "--user", "default", "off", "--user", "rl", "on", f">{PASSWORD}", "~*", "&*", "+@all",
                   "--save", "", "--appendonly", "no", "--dir", str(folder)], log)
    try:
        _wait_for_port(port, proc, "redis-server (TLS)", log)
        yield f"rediss://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def config_for(url: str, **redis):
    return build_config({"job": "sec", "kafka": {"bootstrap": "127.0.0.1:1"}, "redis": {"url": url, **redis}}, "test")


async def test_dedup_marks_round_trip_through_tls_and_acl_auth_from_config(tls_redis, tls_files, monkeypatch):
    monkeypatch.setenv("ROLLART_REDIS_PASSWORD", PASSWORD)  # as a Kubernetes Secret would provide it
    endpoints = resolve_endpoints(config_for(tls_redis, username="rl", ssl_ca_certs=str(tls_files["ca"])))
    assert PASSWORD not in repr(endpoints)
    redis = connect_redis(endpoints)
    try:
        dedup = Deduplicator(redis, prefix="rollart", job="sec", group="env", ttl_s=60)
        assert not await dedup.seen("traj:g0-0")
        dedup.mark("traj:g0-0")
        await dedup.flush()
        fresh = Deduplicator(redis, prefix="rollart", job="sec", group="env", ttl_s=60)  # no local memory
        assert await fresh.seen("traj:g0-0")
        assert await redis.acl_whoami() == "rl"
    finally:
        await redis.aclose()


@pytest.mark.parametrize("redis_settings, error", [
    ({"username": "rl", "password": "wrong"}, AuthenticationError),
    ({}, AuthenticationError),  # the default user is disabled
    ({"username": "rl", "password": PASSWORD, "ca": "stranger_ca"}, RedisConnectionError),  # cannot verify the server
])
async def test_wrong_credentials_or_an_unverifiable_server_are_refused(tls_redis, tls_files, redis_settings, error):
    settings = dict(redis_settings)
    settings["ssl_ca_certs"] = str(tls_files[settings.pop("ca", "ca")])
    redis = connect_redis(resolve_endpoints(config_for(tls_redis, **settings)), timeout_s=3)
    try:
        with pytest.raises(error):
            await redis.ping()
    finally:
        await redis.aclose()


def test_certificates_without_a_tls_url_fail_at_start_up_naming_the_field(tls_files):
    with pytest.raises(ConfigError, match=r"redis\.ssl_ca_certs .* not a rediss://"):
        resolve_endpoints(config_for("redis://127.0.0.1:6379/0", ssl_ca_certs=str(tls_files["ca"])))
