"""What the eval stage has heard of one version's evaluation, and the summary it makes of it.

Records arrive on ``eval.results`` in any order (the reward stage scores concurrently): a member's
score, its group's GroupEnded (which members completed), an Abort for a member whose reward was
dead-lettered. A version's evaluation is over when every one of its groups has ended and every member
a group completed is scored or failed. Records are kept by trajectory / group id, so a redelivered
copy changes nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from statistics import mean

from rollart.messages import Abort, EvalSummary, EvalTagResult, GroupEnded, ScoredTrajectory


@dataclass(frozen=True)
class EvalRow:
    traj_id: str
    tag: str
    reward: float
    success: float
    turns: int
    versions: tuple[int, ...]  # the distinct policy versions of its generated tokens

    @classmethod
    def of(cls, scored: ScoredTrajectory) -> "EvalRow":
        t = scored.trajectory
        generated = {v for m, v in zip(t.loss_mask, t.versions) if m}
        return cls(t.traj_id, t.tag, scored.reward, t.metrics.get("success", 0.0), t.turns, tuple(sorted(generated)))


@dataclass
class VersionEval:
    """One version's evaluation: its groups (id → tag) and what came back for them."""

    version: int
    step: int
    groups: dict[str, str]
    group_size: int
    started_at: float = field(default_factory=time.time)
    ended: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group → members that completed
    rows: dict[str, EvalRow] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    off_version_tokens: int = 0

    def add(self, message: ScoredTrajectory | GroupEnded | Abort) -> bool:
        """Take one record of this version; False when it is not one (another version's, or a copy)."""
        if isinstance(message, ScoredTrajectory):
            t = message.trajectory
            if t.group_id not in self.groups or t.traj_id in self.rows:
                return False
            self.rows[t.traj_id] = EvalRow.of(message)
            self.off_version_tokens += sum(1 for m, v in zip(t.loss_mask, t.versions) if m and v != self.version)
            return True
        if message.group_id not in self.groups:
            return False
        if isinstance(message, GroupEnded):
            if message.replaces:  # a dead-lettered member's replacement: its completions join the group's
                self.ended[message.group_id] = (*self.ended.get(message.group_id, ()), *message.completed)
            elif message.group_id not in self.ended:
                self.ended[message.group_id] = message.completed
            else:
                return False
            return True
        if message.traj_id in self.failed:
            return False
        self.failed.add(message.traj_id)
        return True

    def over(self) -> bool:
        if len(self.ended) < len(self.groups):
            return False
        return all(m in self.rows or m in self.failed for members in self.ended.values() for m in members)

    def summary(self, job: str, *, complete: bool) -> EvalSummary:
        tags = {}
        for tag in sorted(set(self.groups.values())):
            rows = [r for r in self.rows.values() if r.tag == tag]
            tasks = sum(1 for t in self.groups.values() if t == tag)
            tags[tag] = EvalTagResult(
                tasks=tasks, scored=len(rows), failed=max(0, tasks * self.group_size - len(rows)),
                success_rate=round(mean(r.success for r in rows), 6) if rows else 0.0,
                reward_mean=round(mean(r.reward for r in rows), 6) if rows else 0.0,
                turns_mean=round(mean(r.turns for r in rows), 6) if rows else 0.0)
        return EvalSummary(job=job, version=self.version, step=self.step, tags=tags, complete=complete,
                           off_version_tokens=self.off_version_tokens, started_at=self.started_at,
                           finished_at=time.time())


def summary_row(summary: EvalSummary, rows: list[EvalRow] | None = None) -> dict:
    """A summary as a JSON row (the eval record, ``report.json``), optionally with its trajectories."""
    out = {"version": summary.version, "step": summary.step, "complete": summary.complete,
           "off_version_tokens": summary.off_version_tokens,
           "seconds": round(summary.finished_at - summary.started_at, 3),
           "tags": {tag: {"tasks": r.tasks, "scored": r.scored, "failed": r.failed, "success_rate": r.success_rate,
                          "reward_mean": r.reward_mean, "turns_mean": r.turns_mean}
                    for tag, r in summary.tags.items()}}
    if rows is not None:
        out["trajectories"] = [{"traj_id": r.traj_id, "tag": r.tag, "reward": r.reward, "success": r.success,
                                "turns": r.turns, "versions": list(r.versions)} for r in rows]
    return out


def tracker_scalars(summary: EvalSummary) -> dict[str, float]:
    """The figures an experiment tracker gets (``eval/<tag>/<figure>``)."""
    out = {"eval/version": float(summary.version)}
    for tag, r in summary.tags.items():
        out.update({f"eval/{tag}/success_rate": r.success_rate, f"eval/{tag}/reward_mean": r.reward_mean,
                    f"eval/{tag}/turns_mean": r.turns_mean, f"eval/{tag}/failed": float(r.failed)})
    return out
