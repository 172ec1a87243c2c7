"""``rollart bench goodput``: trajectories trained per minute as env steps fail more often.

The same job (the chaos default, or ``--config``) runs fault-free, then with each env step failing
(raising) at 1%, 5% and 10%, each a ``rollart chaos`` campaign of its own (replacement rollouts,
partial groups where configured, the audit). A row per rate: the goodput ratio (trained per minute
÷ the fault-free rate), the replacements started, what the audit found (lost, trained twice, the
longest stall). Goal: every run completes its steps and the ratio degrades gently, not to a stall.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollart.chaos.run import goodput_ratio, run_chaos
from rollart.config import RollartConfig


def goodput_row(rate: float, result: dict[str, Any], fault_free: float | None) -> dict[str, Any]:
    audit = result["audit"]
    per_min = result["trained_per_min"]
    return {"env_failure_rate": rate, "steps": result["steps"], "trained_per_min": per_min,
            "goodput_ratio": goodput_ratio(per_min, fault_free),
            "replacements": audit["replacements"], "aborted": sum(result["aborted"].values()),
            "lost": result["trajectories_lost"], "trained_twice": result["duplicates_trained"],
            "longest_stall_s": audit["longest_stall_s"], "audit_holds": audit["holds"]}


async def bench_goodput(config: RollartConfig, work: Path, *, job_yaml: Path | None, steps: int,
                        rates: tuple[float, ...]) -> dict[str, Any]:
    baseline = await run_chaos(job_yaml, set(), steps=steps, out=work / "fault-free")
    fault_free = baseline["trained_per_min"]
    rows = [goodput_row(0.0, baseline, fault_free)]
    for rate in rates:
        result = await run_chaos(job_yaml, {"env-raise"}, steps=steps, out=work / f"rate-{rate}", env_failure_rate=rate)
        rows.append(goodput_row(rate, result, fault_free))
    return {"benchmark": "goodput", "steps": steps, "rows": rows,
            "efficiency": rows[-1]["goodput_ratio"] or 0.0,  # the headline: goodput at the highest rate
            "all_steps_trained": all(r["steps"] == steps for r in rows)}
