"""Where the local stack is recorded: the state file ``rollart local up`` writes (``$ROLLART_HOME/local.json``)
and what it says. Light on purpose: the endpoint resolution every client runs reads it, and must not
import the machinery that starts brokers (rollart.local.stack).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from rollart.local.brokers import BrokerInfo, BrokerKind

STATE_FILE = "local.json"  # in $ROLLART_HOME: the stack `rollart local up` started


def rollart_home() -> Path:
    return Path(os.environ.get("ROLLART_HOME", Path.home() / ".rollart"))


def state_path() -> Path:
    return rollart_home() / STATE_FILE


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
    broker_kind: BrokerKind = "tansu"
    broker_version: str | None = None
    broker_dir: str | None = None  # Apache Kafka: the node's folder (config and log), kept across restarts
    # A secured Apache Kafka (SASL_SSL, SCRAM, ACLs): the rollart.local.security.LocalSecurity folder
    kafka_security: str | None = None
    # The process whose services these are (they die with it); None: detached (`rollart local up`)
    owner_pid: int | None = None

    @property
    def broker(self) -> BrokerInfo:
        return BrokerInfo(self.broker_kind, self.broker_version or "unknown")

    def services(self) -> dict[str, int | None]:
        """Each service of the stack by name, with its pid: the broker always (a record without its pid
        reads as down), Redis and Mooncake where this stack started them (a Redis not ours is not listed)."""
        named: dict[str, int | None] = {"broker": self.broker_pid}
        if self.redis_pid is not None:
            named["redis"] = self.redis_pid
        named.update(zip(("mooncake master", "mooncake store"), self.mooncake_pids or ()))
        return named

    def dead(self) -> list[str]:
        """The services no longer running, as "name (pid N)"; empty while the whole stack is up."""
        return [f"{name} (pid {pid})" for name, pid in self.services().items() if not pid_alive(pid)]

    def alive(self) -> bool:
        return not self.dead()

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
