"""Running `rollart run` as a subprocess from tests: a small job, start, wait, finish."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.conftest import REPO


def wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"rollart run exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def trained_steps(out):
    """The trained steps so far: the trainer's own reader, which stops at a line still being written."""
    from rollart.training.checkpoint import CheckpointStore

    return [r for r in CheckpointStore(out / "checkpoints").read_record() if "event" not in r]


def small_job(endpoints, tiny_model, **overrides) -> dict:
    config = {
        "job": "runtest", "pools": ["default"],
        "kafka": {"bootstrap": endpoints.kafka_bootstrap}, "redis": {"url": endpoints.redis_url},
        "mooncake": {"master": endpoints.mooncake_master, "metadata_server": endpoints.mooncake_metadata},
        "model": {"path": str(tiny_model)},
        "generation": {"max_concurrency": 32, "max_model_len": 1024, "executor": "uni"},  # starts sooner
        "feeder": {"group_size": 4, "groups_per_batch": 2, "alpha": 1},
        "env": {"max_groups": 4, "sampling": {"temperature": 1.0, "max_tokens": 2}},
        "trainer": {"micro_batch": 8},
        "bus": {"fetch_max_wait_ms": 5},
        "tags": {"frozenlake": {"env": "frozenlake", "env_kwargs": {}, "max_turns": 3, "reward": {"type": "env"}}},
    }
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def ctrl_c_reaches_it() -> None:
    """A runner's ``preexec_fn``: SIGINT as a terminal's Ctrl-C delivers it, whatever the test process
    inherited (a shell starts a background job, ``pytest &`` or a CI script's, with SIGINT ignored,
    and its children inherit that: a run told to stop with SIGINT would go on training)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(config: dict, tmp_path, steps: int) -> tuple[subprocess.Popen, object]:
    """`rollart run` of ``config``; its output goes to a file, not a pipe: a test polls for minutes
    without reading, and a run that filled a pipe would stall in its next print."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    output = tmp_path / "run-output.txt"
    with output.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", str(path), "--steps", str(steps),
                                 "--out", str(out), "--timeout", "600"], cwd=REPO, stdout=sink,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=ctrl_c_reaches_it)
    proc.output_path = output  # type: ignore[attr-defined]
    return proc, out


def ended(proc: subprocess.Popen, timeout: float) -> str:
    """The run's output once it exits; killed, and its output's tail in the failure, if it does not."""
    path = getattr(proc, "output_path", None)
    try:
        if path is None:
            output, _ = proc.communicate(timeout=timeout)
            return output
        proc.wait(timeout=timeout)
        return path.read_text(errors="replace")
    except subprocess.TimeoutExpired:
        tail = path.read_text(errors="replace")[-4000:] if path is not None else ""
        raise AssertionError(f"rollart run did not exit within {timeout:.0f} s; where it waits:\n"
                             f"{waiting_on(proc.pid)}\nits output ends:\n{tail}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def waiting_on(pid: int) -> str:
    """A hung process's threads (name, state, kernel wait channel) and its live children, from /proc."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            name = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            lines.append(f"  thread {task.name} {name} {state} {(task / 'wchan').read_text().strip()}")
        except OSError:
            continue
    for child in Path("/proc").glob("[0-9]*"):
        try:
            if int((child / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                lines.append(f"  child {child.name}: {(child / 'cmdline').read_text().replace(chr(0), ' ')[:200]}")
        except (OSError, ValueError, IndexError):
            continue
    return "\n".join(lines)


def finish(proc: subprocess.Popen, out) -> dict:
    output = ended(proc, 600)
    assert proc.returncode == 0, output[-3000:]
    return json.loads((out / "report.json").read_text())
