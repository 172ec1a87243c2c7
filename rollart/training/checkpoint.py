"""Trainer checkpoints and the training record.

A checkpoint is a directory ``step-<n>/`` holding the backend's state (model, optimizer, step) and
``trainer.json`` (the policy version those weights are announced as — a resumed trainer compares it
with the log and publishes again when the announcement never happened —, the ids of recently trained trajectories and the offsets trained up to). It is written
under a temporary name and renamed, so a crash mid-write leaves the previous checkpoint intact.

The record (``record.jsonl``) has one line per training step. On resume it is cut back to the
checkpoint's step, so a step that was trained but never checkpointed (and will be trained again
from the same samples) is not counted twice.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0  # the policy version of these weights
    trained_ids: list[str] = field(default_factory=list)  # recent ones: redeliveries are dropped
    offsets: dict[str, int] = field(default_factory=dict)  # "topic:partition" -> next offset trained up to


class CheckpointStore:
    def __init__(self, root: str | Path, *, keep: int = 2):
        self.root = Path(root)
        self.keep = keep

    @property
    def record_path(self) -> Path:
        return self.root / "record.jsonl"

    def latest(self) -> Path | None:
        steps = sorted(self.root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        return steps[-1] if steps else None

    def save(self, backend, state: TrainerState) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{state.step}"
        tmp = self.root / f".step-{state.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        backend.save(tmp)
        (tmp / "trainer.json").write_text(json.dumps(asdict(state)))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in sorted(self.root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self, backend) -> TrainerState | None:
        path = self.latest()
        if path is None:
            return None
        backend.load(path)
        return TrainerState(**json.loads((path / "trainer.json").read_text()))

    # -- the record -----------------------------------------------------------------------------

    def append_record(self, row: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.record_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def read_record(self) -> list[dict]:
        try:
            lines = self.record_path.read_text().splitlines()
        except OSError:
            return []
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break  # a line cut by a crash: everything after it is unreliable
        return rows

    def follow(self) -> "RecordFollower":
        return RecordFollower(self.record_path)

    def truncate_record(self, step: int) -> None:
        """Keep the record's lines up to ``step`` (the checkpoint being resumed)."""
        rows = [r for r in self.read_record() if r.get("step", 0) <= step]
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(self.record_path)


class RecordFollower:
    """The record's rows as they are appended, each line read once. A runner polls the record every
    half second through a run; reading the whole file each time grows with the run (the rows hold each
    step's trajectory ids: a 150-step record is ~0.5 MB of JSON). A line still being written is left for
    the next poll; a record cut back and rewritten (a resume) is read again from its start."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []
        self._offset = 0
        self._inode: int | None = None

    def poll(self) -> list[dict]:
        """The rows appended since the last poll (all rows again, after :attr:`rows` was reset)."""
        try:
            with open(self.path, "rb") as fh:
                stat = os.fstat(fh.fileno())
                if stat.st_ino != self._inode or stat.st_size < self._offset:  # rewritten: start over
                    self._inode, self._offset, self.rows = stat.st_ino, 0, []
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return []
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        new = []
        for line in complete.splitlines():
            try:
                new.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash, then appended to: not a row
        self.rows.extend(new)
        return new
