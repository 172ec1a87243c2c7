"""Kafka TLS and SASL settings pass through from config to every client the system makes.

The broker contract, on both brokers. Apache Kafka terminates TLS itself (a PEM keystore with a
certificate from a throwaway CA; clients reach it only through its SSL listener). Tansu 0.6 cannot
serve TLS (its `--cert` listener never completes a handshake), so there TLS is terminated in front of
it by a small proxy and the broker advertises the proxy's address. Either way every connection a
client opens, bootstrap or advertised, must speak TLS and verify the certificate: a client path that
forgot the settings fails. SASL against a real broker belongs to the delivery-and-security work; here
its settings are checked on the aiokafka clients.
"""

from __future__ import annotations

import asyncio
import ssl
import threading

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError
from aiokafka.helpers import create_ssl_context
from pydantic import SecretStr

from rollart.config import KafkaConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.lag import consumer_lag
from rollart.local.brokers import BrokerTls, tansu_binary
from rollart.local.stack import _spawn, _wait_for_port, free_ports, serves_metadata, start_kafka, stop_pid
from rollart.messages import TaskSpec
from rollart.runtime import open_runtime
from rollart.topics import expand_catalog
from rollart.topics.admin import apply_topics
from tests.conftest import BOTH_BROKERS, RunningLoops, eventually, make_config


class TlsTerminator:
    """Accept TLS on ``port`` and relay the plaintext bytes to 127.0.0.1:``target`` (its own thread)."""

    def __init__(self, port: int, target: int, certfile, keyfile):
        self.port, self.target = port, target
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(certfile, keyfile)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._relay, "127.0.0.1", self.port, ssl=self.context))
        self.ready.set()
        self.loop.run_forever()

    async def _relay(self, client_r, client_w) -> None:
        upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.target)

        async def pipe(reader, writer):
            try:
                while data := await reader.read(1 << 16):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_r, upstream_w), pipe(upstream_r, client_w))

    def __enter__(self):
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory, tls_files, broker):
    """A broker of the kind under test reachable only through TLS: its bootstrap address."""
    folder = tmp_path_factory.mktemp(f"tls-{broker}")
    if broker == "kafka":
        yield from _kafka_over_tls(folder, tls_files)
    else:
        yield from _tansu_behind_tls(folder, tls_files)


def _kafka_over_tls(folder, tls_files):
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(tls_files["key"].read_bytes(), password=None)
    keystore = folder / "keystore.pem"  # Kafka's PEM keystore: a PKCS#8 key, then the certificate chain
    keystore.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()) + tls_files["cert"].read_bytes())
    context = create_ssl_context(cafile=str(tls_files["ca"]))
    proc, bootstrap, _ = start_kafka(folder / "kafka", folder, BrokerTls(keystore, tls_files["ca"]),
                                     ready=lambda b: serves_metadata(b, security_protocol="SSL", ssl_context=context))
    try:
        yield bootstrap
    finally:
        stop_pid(proc.pid, timeout=30)


def _tansu_behind_tls(folder, tls_files):
    log = folder / "broker.log"
    plain, tls = free_ports(2)
    proc = _spawn([tansu_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{plain}",
                   "--advertised-listener-url", f"tcp://127.0.0.1:{tls}", "--storage-engine", "memory://tansu/"], log)
    try:
        _wait_for_port(plain, proc, "tansu", log)
        with TlsTerminator(tls, plain, tls_files["cert"], tls_files["key"]):
            yield f"127.0.0.1:{tls}"
    finally:
        proc.kill()
        proc.wait()


def tls_config(endpoints: Endpoints, bootstrap: str, cafile):
    return make_config(endpoints, kafka={"bootstrap": bootstrap, "security_protocol": "SSL", "ssl_cafile": str(cafile),
                                         "request_timeout_ms": 5000})


@BOTH_BROKERS
async def test_every_client_path_works_over_tls_with_the_configured_ca(tls_broker, tls_files, endpoints):
    config = tls_config(endpoints, tls_broker, tls_files["ca"])
    tls_endpoints = Endpoints(tls_broker, endpoints.redis_url, "tls test", broker=endpoints.broker)
    await apply_topics(config, tls_endpoints, expand_catalog(config))  # the admin client
    handled: list[str] = []

    async def handle(envelope, ctx) -> None:
        handled.append(envelope.message.group_id)

    loops = RunningLoops()
    async with open_runtime(config, serve=False) as rt:  # the producer, and the consumer loop below
        for i in range(3):
            await rt.producer.send_and_wait("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                            key=f"g{i}")
        await loops.start(rt.consumer_loop("env", ["tasks"], handle))
        try:
            await eventually(lambda: sorted(handled) == ["g0", "g1", "g2"], what="tasks consumed over TLS")

            async def committed():
                rows = [r for r in await consumer_lag(config, tls_endpoints) if r.group == "env"]
                return rows if rows and sum(r.committed or 0 for r in rows) == 3 else None

            rows = await eventually(committed, what="offsets committed and read back over TLS")
            assert sum(r.lag for r in rows) == 0
        finally:
            await loops.stop_all()


@BOTH_BROKERS
async def test_a_plaintext_client_or_an_unknown_ca_cannot_connect(tls_broker, tls_files):
    for kafka in (KafkaConfig(request_timeout_ms=2000),
                  KafkaConfig(security_protocol="SSL", ssl_cafile=tls_files["stranger_ca"], request_timeout_ms=2000)):
        producer = AIOKafkaProducer(**kafka_client_kwargs(kafka, tls_broker))
        with pytest.raises(KafkaConnectionError):
            await producer.start()
        await producer.stop()


async def test_sasl_settings_reach_the_kafka_clients(tls_files):
    kafka = KafkaConfig(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="rl",
                        sasl_password=SecretStr("hunter2"), ssl_cafile=tls_files["ca"])
    kwargs = kafka_client_kwargs(kafka, "broker:9093")
    assert (kwargs["security_protocol"], kwargs["sasl_mechanism"], kwargs["sasl_plain_username"],
            kwargs["sasl_plain_password"]) == ("SASL_SSL", "SCRAM-SHA-512", "rl", "hunter2")
    assert kwargs["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    producer = AIOKafkaProducer(**kwargs)  # aiokafka accepts them as given
    client = producer.client
    assert (client._sasl_mechanism, client._sasl_plain_username, client._security_protocol) == \
        ("SCRAM-SHA-512", "rl", "SASL_SSL")
    assert "hunter2" not in repr(kafka) and "hunter2" not in kafka.model_dump_json()
