"""StageProcesses.stop_all: ordered drain under one shared budget, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from rollart.endpoints import Endpoints
from rollart.local.processes import StageProcess, StageProcesses

# A stage that takes SIGTERM but does not leave (one importing torch, say), and one that leaves at once.
STUBBORN = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: print('term', flush=True)); " \
           "print('up', flush=True); time.sleep(600)"
POLITE = "import time; print('up', flush=True); time.sleep(600)"


def _stage(tmp_path: Path, name: str, code: str) -> StageProcess:
    log = tmp_path / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    while "up" not in log.read_text():
        time.sleep(0.02)
    return StageProcess(name, [], log, proc)


def test_stubborn_stages_share_one_budget_and_are_killed_past_it(tmp_path):
    procs = StageProcesses(Path("job.yaml"), Endpoints("127.0.0.1:1", "redis://x", "test"), "job", tmp_path)
    for name, code in [("trainer", STUBBORN), ("generation", STUBBORN), ("env", POLITE), ("feeder", STUBBORN)]:
        procs.stages[name] = _stage(tmp_path, name, code)
    grace_s = 30.0
    started = time.monotonic()
    codes = procs.stop_all(grace_s=grace_s, budget_s=1.0, last_grace_s=0.3)
    # One grace each would hold this call for 90 s; the shared budget bounds it far below one grace.
    assert time.monotonic() - started < grace_s
    assert codes == {"trainer": -signal.SIGKILL, "generation": -signal.SIGKILL, "env": -signal.SIGTERM,
                     "feeder": -signal.SIGKILL}
    for name in ("trainer", "generation", "feeder"):  # each was asked before it was killed
        assert "term" in (tmp_path / f"{name}.log").read_text(), name
