"""The run report: ``report.json`` (per-step figures and run totals) and ``report.png``.

Built from the trainer's record (``record.jsonl``: one row per step, one per weight publication),
the generation consumers' weight-load log (pull and exposed-pause seconds per version), the run
monitor's counts of completed and aborted trajectories and, with ``eval:``, the eval stage's record
(``eval.jsonl``: per evaluated version and tag, success, reward and turns).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from statistics import mean

STEP_FIELDS = ("step", "trained_version", "reward_mean", "success_rate", "staleness_max", "staleness_mean",
               "token_staleness_mean", "samples", "groups", "tokens", "turns_mean", "wait_s", "train_s", "buffer_groups", "time")


def eval_record(out: Path) -> Path:
    """Where the eval stage of a run appends its summaries (one JSON line per evaluated version)."""
    return out / "eval.jsonl"


def read_evals(out: Path) -> list[dict]:
    try:
        lines = eval_record(out).read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    ordered = sorted(values)
    return {"count": len(values), "mean": round(mean(values), 6), "p50": round(ordered[len(ordered) // 2], 6),
            "max": round(ordered[-1], 6), "total": round(sum(values), 6)}


def build_report(*, job: str, alpha: int, record: list[dict], loads: list[dict], monitor: dict,
                 started_at: float, finished_at: float, restarts: dict[str, int], interrupted: bool = False,
                 evals: list[dict] = ()) -> dict:
    """``interrupted``: the run stopped before its steps (Ctrl-C, SIGTERM, a failure), or the report
    was rebuilt from the record alone (``rollart report``): the figures cover what was trained."""
    rows = [r for r in record if "event" not in r]
    publishes = [r for r in record if r.get("event") == "publish"]
    trained = Counter(i for r in rows for i in r.get("traj_ids", ()))
    publish_by_step = {p["step"]: p["publish_s"] for p in publishes}
    steps = [{**{k: r.get(k) for k in STEP_FIELDS}, "publish_s": publish_by_step.get(r["step"])} for r in rows]
    elapsed = max(finished_at - started_at, 1e-9)
    k = max(1, len(steps) // 5)
    first, last = steps[:k], steps[-k:]
    return {
        "job": job,
        "alpha": alpha,
        "steps": steps,
        "trained_duplicates": sum(n - 1 for n in trained.values() if n > 1),
        "trained_trajectories": len(trained),
        "staleness_max": max((s["staleness_max"] for s in steps), default=0),
        "reward_first_steps": round(mean(s["reward_mean"] for s in first), 6) if steps else None,
        "reward_last_steps": round(mean(s["reward_mean"] for s in last), 6) if steps else None,
        "success_first_steps": round(mean(s["success_rate"] for s in first), 6) if steps else None,
        "success_last_steps": round(mean(s["success_rate"] for s in last), 6) if steps else None,
        "trajectories": {"completed": monitor.get("completed", 0), "aborted": monitor.get("aborted", {})},
        "tokens_generated": monitor.get("tokens", 0),
        "tokens_per_s": round(monitor.get("tokens", 0) / elapsed, 3),
        "trajectories_per_s": round(monitor.get("completed", 0) / elapsed, 3),
        "elapsed_s": round(elapsed, 3),
        "started_at": started_at,  # Unix seconds when the stages were started (rows carry "time")
        "step_time_split_s": {phase: _summary([s[f"{phase}_s"] for s in steps if s.get(f"{phase}_s") is not None])
                              for phase in ("wait", "train", "publish")},
        "weights": {
            "transport": publishes[-1]["transport"] if publishes else None,
            "bytes": publishes[-1]["bytes"] if publishes else 0,
            "publish_s": _summary([p["publish_s"] for p in publishes]),
            "pull_s": _summary([x["pull_s"] for x in loads]),
            "load_s": _summary([x["load_s"] for x in loads]),
            "versions_loaded": len(loads),
        },
        "restarts": restarts,
        "interrupted": interrupted,
        # per evaluated version: step, complete, off_version_tokens, per tag tasks/scored/failed/success/reward/turns
        "eval": [{k: v for k, v in row.items() if k != "trajectories"} for row in evals],
    }


def rebuild_report(out: Path) -> dict:
    """The report of the run in ``out`` from its record alone (an interrupted or killed run, or a
    report lost): steps, rewards and step times; no trajectory counts or weight-load figures."""
    from rollart.training.checkpoint import CheckpointStore

    try:
        run = json.loads((out / "run.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{out} holds no run (run.json: {exc})") from None
    record = CheckpointStore(out / "checkpoints").read_record()
    times = [r["time"] for r in record if "time" in r]
    started = run.get("started_at") or (min(times) if times else 0.0)
    report = build_report(job=run["job"], alpha=run.get("alpha"), record=record, loads=[], monitor={},
                          started_at=started, finished_at=max(times, default=started), restarts={},
                          interrupted=True, evals=read_evals(out))
    write_report(report, out)
    return report


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    try:
        plot_report(report, out / "report.png")
    except ImportError:  # matplotlib is the `report` extra
        pass


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    x = [s["step"] for s in steps]
    evals = report.get("eval") or []
    fig, axes = plt.subplots(3 if evals else 2, 1, figsize=(8, 10 if evals else 7), sharex=True)
    top, bottom = axes[0], axes[-1]
    top.plot(x, [s["reward_mean"] for s in steps], label="reward (batch mean)")
    top.plot(x, [s["success_rate"] for s in steps], label="success rate", alpha=0.7)
    top.set_ylabel("reward / success")
    top.set_title(f"{report['job']}  alpha={report['alpha']}  {report['tokens_per_s']:.0f} tokens/s")
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    if evals:
        _plot_evals(axes[1], evals)
    for phase in ("wait", "train", "publish"):
        bottom.plot(x, [s.get(f"{phase}_s") or 0.0 for s in steps], label=f"{phase} s")
    bottom.set_xlabel("training step")
    bottom.set_ylabel("seconds per step")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_evals(ax, evals: list[dict]) -> None:
    """Held-out success per tag against the training step of each evaluated version."""
    for tag in sorted({t for row in evals for t in row["tags"]}):
        rows = [r for r in evals if tag in r["tags"]]
        ax.plot([r["step"] for r in rows], [r["tags"][tag]["success_rate"] for r in rows], marker="o",
                label=f"eval {tag} success")
    ax.set_ylabel("eval success (held out)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
