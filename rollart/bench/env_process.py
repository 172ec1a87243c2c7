"""The env stage as its own process (``rollart consume env``), exactly as deployed, beside a benchmark's
in-process harness (generation, rewards, observer): its /metrics and /readyz on a port of its own, its
log in the benchmark's work dir, and a killed benchmark takes it along.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import yaml

from rollart.chaos.scrape import HistogramSample, parse_histogram
from rollart.config import RollartConfig
from rollart.local.children import die_with_parent, on_lasting_thread
from rollart.local.stack import free_port


@dataclass
class EnvProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def _get(self, path: str) -> tuple[int, bytes] | None:
        """(status, body) of a GET on the process's metrics port; None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as response:
                return int(response.status), bytes(response.read())
        except OSError:
            return None

    def metrics(self) -> str:
        """The process's /metrics text ("" while it does not answer)."""
        answer = self._get("/metrics")
        return answer[1].decode() if answer else ""

    def histogram(self, name: str) -> HistogramSample | None:
        return parse_histogram(self.metrics(), name, time.monotonic())

    def ready(self) -> bool:
        answer = self._get("/readyz")
        return answer is not None and answer[0] == 200

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the env process exited ({self.proc.returncode}; see {self.log})")


def start_env_process(cfg: RollartConfig, work_dir: Path, port: int, *, name: str = "env") -> EnvProcess:
    work_dir.mkdir(parents=True, exist_ok=True)
    path, log_path = work_dir / f"{name}-job.yaml", work_dir / f"{name}.log"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True, exclude={"deploy"})))
    env = {**os.environ, "ROLLART_METRICS_PORT": str(port), "ROLLART_METRICS_HOST": "127.0.0.1"}
    parent = os.getpid()

    def popen() -> subprocess.Popen[bytes]:  # a killed benchmark takes its env process with it
        with open(log_path, "wb") as log:
            return subprocess.Popen([sys.executable, "-m", "rollart.cli", "consume", "env", "--config", str(path)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=lambda: die_with_parent(parent=parent))
    return EnvProcess(on_lasting_thread(popen), port, log_path)


@contextlib.asynccontextmanager
async def env_process(cfg: RollartConfig, work_dir: Path, *, name: str = "env",
                      start_timeout_s: float = 300) -> AsyncIterator[EnvProcess]:
    """An env process of ``cfg``'s job, ready (its loops hold their partitions) when the block starts;
    SIGTERM (its drain) at the end, SIGKILL after 60 s."""
    process = start_env_process(cfg, work_dir, free_port(), name=name)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not process.ready():
            process.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the env process was not ready in {start_timeout_s:.0f} s (see {process.log})")
            await asyncio.sleep(0.5)
        yield process
    finally:
        process.proc.terminate()
        try:
            await asyncio.to_thread(process.proc.wait, 60)
        except subprocess.TimeoutExpired:
            process.proc.kill()
