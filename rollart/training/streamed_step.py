"""An optimiser step built from a batch's groups as they complete (``trainer.stream_batch``).

Under a staleness bound the loop's pace is a chain: a batch's last group completes, the trainer trains
on the batch and publishes, and only then may the feeder admit the groups of the batch after next
(alpha = 1: about (a batch's rollout + the train step + publish and load) / 2 a step). The forward
and backward of the groups that completed earlier need not wait for the last one: each runs as its
group completes, while the rest of the batch still rolls out, and once the batch is whole only the last
groups' part and the optimiser step are left on that chain.

It is the step the whole batch would take: each part's loss is summed over its tokens (or rows, under
``sequence_mean``), and the sums are divided by the whole batch's count once it is known (before the
gradient clip); advantages are per group (``advantage_norm`` group, group_mean or none), so a group's
are the same alone as in the batch. Per group, the prefix tree also finds more of what rows share
(a group's prompt and turns) than in micro-batches cut across groups.
"""

from __future__ import annotations

from rollart.messages import ScoredTrajectory
from rollart.training.algorithms import MAX_METRICS, combine_metrics, over_trained_rows
from rollart.training.buffer import Group
from rollart.training.thread_clock import ThreadTimes, in_thread
from rollart.training.torch_backend import AccumulatingBackend, collate


class StreamedStep:
    """Gradients of a batch accumulated part by part (from zero: the backend's gradients are cleared
    when the step is made); :meth:`finish` takes the optimiser step."""

    def __init__(self, backend: AccumulatingBackend, *, norm: str, per_step: bool, version: int, pad_id: int):
        self.backend = backend
        self.norm, self.per_step, self.version, self.pad_id = norm, per_step, version, pad_id
        self.groups: list[Group] = []
        self.samples: list[ScoredTrajectory] = []
        self.metrics: dict[str, float] = {}
        self.normaliser = 0.0  # the batch's tokens (or rows) so far
        self.times = ThreadTimes(0.0, 0.0, 0.0)  # the parts' and the step's, in their worker threads
        backend.optimizer.zero_grad(set_to_none=True)

    async def add(self, groups: list[Group]) -> None:
        """Forward and backward of ``groups`` (in a thread: the consumer goes on meanwhile)."""
        if not groups:
            return
        samples = [s for g in groups for s in g.members.values()]

        def part() -> tuple[dict[str, float], float]:
            batch = collate(samples, pad_id=self.pad_id, norm=self.norm, per_step=self.per_step, version=self.version)
            metrics = self.backend.accumulate(batch, range(batch.input_ids.shape[0]), normaliser=1.0)
            return metrics, self.backend.loss_normaliser(batch)

        (metrics, normaliser), times = await in_thread(part)
        combine_metrics(self.metrics, metrics)
        self.normaliser += normaliser
        self.groups += groups
        self.samples += samples
        self.times += times

    async def finish(self) -> dict[str, float]:
        """Divide the sums by the whole batch's count, clip and step; returns the step's metrics."""
        total = max(self.normaliser, 1.0)
        metrics = {k: v if k in MAX_METRICS else v / total for k, v in self.metrics.items()}

        def step() -> float:
            self.backend.scale_gradients(1.0 / total)
            return self.backend.apply_gradients()

        grad_norm, times = await in_thread(step)
        self.times += times
        return {**over_trained_rows(metrics), "grad_norm": grad_norm}
