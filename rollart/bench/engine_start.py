"""``rollart bench engine-start``: how soon an engine serves, per ``generation.engine_core_start``.

Each start is a fresh process (``python -m rollart.bench.engine_start``), timed from its launch to its
engine's first answer, imports included: that is what a generation member and the in-process loop pay
before their first turn, and what a fork server can shorten (rollart/engines/forkserver.py). The
methods alternate, ``repeats`` starts each; the headline is spawn's median over forkserver's.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rollart.config import RollartConfig

METHODS = ("forkserver", "spawn")
REPORT = b"engine-start report: "  # the child's line, once its engine has answered


async def _start_once(config_json: Path, method: str, log: Path) -> dict[str, Any]:
    launched = time.perf_counter()
    report, ready_s = None, 0.0
    with log.open("ab") as out:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "rollart.bench.engine_start",
                                                    str(config_json), method, stdout=subprocess.PIPE, stderr=out)
        async for line in proc.stdout:  # vLLM logs to stdout too: the report is the line marked so
            if report is None and line.startswith(REPORT):
                ready_s, report = time.perf_counter() - launched, json.loads(line[len(REPORT):])
            else:
                out.write(line)
        await proc.wait()
    if proc.returncode != 0 or report is None:
        raise RuntimeError(f"the {method} engine start exited {proc.returncode}: {log}")
    return {"mode": method, "ready_s": ready_s, **report}


async def bench_engine_start(config: RollartConfig, work_dir: Path, *, repeats: int = 3) -> dict[str, Any]:
    from rollart.models.tiny import ensure_model

    if repeats < 1:
        raise ValueError(f"repeats: at least 1 (got {repeats})")
    await asyncio.to_thread(ensure_model, config.model)  # made once, not inside a timed start
    config_json = work_dir / "config.json"
    config_json.write_text(config.model_dump_json())
    rows = []
    for repeat in range(repeats):
        for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
            rows.append({"repeat": repeat + 1, **await _start_once(config_json, method, work_dir / "starts.log")})
    median = {m: statistics.median(r["ready_s"] for r in rows if r["mode"] == m) for m in METHODS}
    return {"benchmark": "engine-start", "speedup": median["spawn"] / median["forkserver"],
            "ready_s_median": median, "setup": {"repeats": repeats}, "rows": rows}


async def _serve_once(config: RollartConfig, method: str) -> None:
    """Start the engine, answer one request, report (one JSON line on stdout), then shut it down: the
    parent's clock stops at the report."""
    import psutil

    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.messages import GenerationRequest, Int32Array, SamplingParams
    from rollart.proctree import ENGINE_WORKER, engine_core_pid, titled_pids

    engine = VLLMEngine(config.model.path, config.generation.model_copy(update={"engine_core_start": method}))
    await engine.start()
    try:
        result = await engine.generate(GenerationRequest(
            traj_id="start", turn=0, group_id="g", tag="bench", pool="bench", prompt_ids=Int32Array([1, 2, 3]),
            reply_partition=0, sampling=SamplingParams(temperature=1.0, max_tokens=1)))
        core = engine_core_pid(os.getpid())
        workers = [psutil.Process(w) for w in titled_pids(os.getpid(), ENGINE_WORKER)]
        report = {"tokens": len(result.token_ids),
                  "engine_core_forked": core is not None and psutil.Process(core).ppid() != os.getpid(),
                  "workers_forked": bool(workers) and all(w.ppid() != core for w in workers),
                  "worker_cpus": sorted({c for w in workers for c in w.cpu_affinity()})}
        print(REPORT.decode() + json.dumps(report), flush=True)
    finally:
        engine.shutdown()


def main() -> None:
    """``python -m rollart.bench.engine_start CONFIG.json METHOD``: one timed start (:func:`_serve_once`)."""
    config_json, method = sys.argv[1:]
    asyncio.run(_serve_once(RollartConfig.model_validate_json(Path(config_json).read_text()), method))


if __name__ == "__main__":
    main()
