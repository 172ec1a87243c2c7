"""Run stages as separate processes on this machine (the local job runner), same code as production.

Each stage is ``python -m rollart.cli consume <stage> --config CONFIG`` with the endpoints and the
job name passed in the environment, its output in ``<log_dir>/<name>.log``. Stopping sends SIGTERM
(graceful: drain, commit, exit) and SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rollart.endpoints import Endpoints


@dataclass
class StageProcess:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class StageProcesses:
    config_path: Path
    endpoints: Endpoints
    job: str
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    stages: dict[str, StageProcess] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(ROLLART_KAFKA_BOOTSTRAP=self.endpoints.kafka_bootstrap, ROLLART_REDIS_URL=self.endpoints.redis_url,
                   ROLLART_JOB=self.job, PYTHONUNBUFFERED="1")
        if self.endpoints.mooncake_master and self.endpoints.mooncake_metadata:
            env.update(ROLLART_MOONCAKE_MASTER=self.endpoints.mooncake_master,
                       ROLLART_MOONCAKE_METADATA_SERVER=self.endpoints.mooncake_metadata)
        env.update(self.extra_env)
        return env

    def start(self, name: str, stage: str, *args: str) -> StageProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "rollart.cli", "consume", stage, "--config", str(self.config_path), *args]
        process = StageProcess(name, argv, self.log_dir / f"{name}.log")
        with open(process.log, "ab") as out:
            process.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(),
                                             stdin=subprocess.DEVNULL)
        self.stages[name] = process
        return process

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.stages[name]
        if process.alive():
            process.proc.send_signal(sig)
            process.proc.wait()

    def failed(self) -> list[str]:
        """Stages that exited with an error (a feeder that released all its groups exits 0)."""
        return [name for name, p in self.stages.items() if p.proc is not None and p.proc.poll() not in (None, 0)]

    def stop_all(self, grace_s: float = 20.0) -> dict[str, int | None]:
        """SIGTERM each stage, the last started first (the feeder before the env stage before the
        engines), waiting for each so upstream work drains into live downstream stages."""
        for process in reversed(list(self.stages.values())):
            if not process.alive():
                continue
            process.proc.send_signal(signal.SIGTERM)
            try:
                process.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                process.proc.kill()
                process.proc.wait()
        return {name: p.proc.returncode if p.proc else None for name, p in self.stages.items()}

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.stages[name].log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
