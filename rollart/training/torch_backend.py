"""The PyTorch training backend: a Hugging Face causal LM on CPU or GPU.

Batches are whole trajectories (the token stream with its loss mask). Token ``t`` is predicted by the
logits at ``t - 1``, so every per-token tensor is shifted by one: position ``t`` of the model's
output lines up with token ``t + 1``. Gradient accumulation splits a batch into micro-batches; the
loss of each is scaled by its share of the batch's generated tokens, so the step equals one
token-mean over the whole batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from rollart.messages import ScoredTrajectory
from rollart.training.algorithms import (
    PolicyLossConfig,
    combine_metrics,
    group_advantages,
    old_logprobs,
    over_trained_rows,
    policy_loss,
)
from rollart.training.prefix_tree import PrefixTree, tree_matches_rows, tree_states

log = logging.getLogger(__name__)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1], aligned with the predicted tokens input_ids[:, 1:]
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    staleness: torch.Tensor  # [B, L-1]: versions between the trained one and the token's (0 off the loss mask)
    advantages: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    group_ids: list[str]

    def micro_batches(self, rows: Sequence[int], size: int, *, by_prefix: bool = False) -> list["Batch"]:
        """``rows`` in micro-batches of up to ``size``, shortest rows first, each cut to its own longest
        row: collate pads every row to the batch's longest, and a micro-batch of short rows would
        otherwise compute over that padding (in the demo's batches, 15-25% of the padded tokens).
        Rows are right-padded, so the columns cut carry no token any kept position attends to.
        ``by_prefix``: rows in lexicographic order instead, so that rows sharing a prefix (a group's
        prompt) share a micro-batch (for the prefix-tree forward, which computes no padding)."""
        lengths = self.attention_mask.sum(dim=1).tolist()
        if by_prefix:
            order = sorted(rows, key=lambda i: self.input_ids[i, :lengths[i]].tolist())
        else:
            order = sorted(rows, key=lengths.__getitem__)
        chunks = [order[k:k + size] for k in range(0, len(order), size)]
        return [self._rows(chunk, max(lengths[i] for i in chunk)) for chunk in chunks]

    def _rows(self, rows: list[int], width: int) -> "Batch":
        index = torch.tensor(rows, dtype=torch.long)
        width = max(width, 2)  # one predicted position at least
        return Batch(self.input_ids[index, :width], self.attention_mask[index, :width],
                     self.loss_mask[index, :width - 1], self.behaviour_logprobs[index, :width - 1],
                     self.staleness[index, :width - 1], self.advantages[index], self.rewards[index],
                     [self.group_ids[i] for i in rows])


def turn_samples(trajectory) -> list[tuple[int, list[int]]]:
    """Per-step samples of a multi-turn trajectory: ``[(end, mask)]``, one per LLM turn, each the
    context up to the end of that turn with the loss mask on that turn's tokens only."""
    mask = list(trajectory.loss_mask)
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((i, [0] * start + [1] * (i - start)))
            start = None
    return out


def collate(samples: list[ScoredTrajectory], *, pad_id: int, norm: str = "group", per_step: bool = False,
            version: int | None = None) -> Batch:
    """Pad scored trajectories into a batch; ``per_step`` makes one sample per LLM turn (the
    trajectory's advantage on each) instead of one whole-trajectory sample. ``version``: the policy
    version being trained, for each token's staleness (None: every token on-policy)."""
    rows = []  # (token ids, loss mask, behaviour logprobs, staleness, sample index)
    for index, s in enumerate(samples):
        t = s.trajectory
        ids = torch.frombuffer(bytearray(t.token_ids), dtype=torch.int32).long()
        mask = torch.frombuffer(bytearray(t.loss_mask), dtype=torch.uint8).float()
        logprobs = torch.frombuffer(bytearray(t.logprobs), dtype=torch.float32)
        staleness = torch.zeros_like(logprobs)
        if version is not None:
            versions = torch.frombuffer(bytearray(t.versions), dtype=torch.int32).float()
            staleness = torch.where(mask > 0, (version - versions).clamp(min=0), staleness)
        if per_step:
            for end, turn_mask in turn_samples(t):
                rows.append((ids[:end], torch.tensor(turn_mask, dtype=torch.float32), logprobs[:end],
                             staleness[:end], index))
        else:
            rows.append((ids, mask, logprobs, staleness, index))
    length = max(len(r[0]) for r in rows)
    n = len(rows)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.float32)
    behaviour = torch.zeros((n, length), dtype=torch.float32)
    stale = torch.zeros((n, length), dtype=torch.float32)
    for i, (row_ids, row_mask, row_logprobs, row_staleness, _) in enumerate(rows):
        k = len(row_ids)
        ids[i, :k] = row_ids
        attention[i, :k] = 1
        mask[i, :k] = row_mask
        behaviour[i, :k] = row_logprobs
        stale[i, :k] = row_staleness
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    group_ids = [s.trajectory.group_id for s in samples]
    advantages = group_advantages(rewards, group_ids, norm)
    index = torch.tensor([r[4] for r in rows], dtype=torch.long)
    return Batch(ids, attention, mask[:, 1:], behaviour[:, 1:], stale[:, 1:], advantages[index], rewards[index],
                 [group_ids[i] for i in index.tolist()])


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, with_entropy: bool = False,
                   where: torch.Tensor | None = None,
                   tree: PrefixTree | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(token t+1 | tokens <= t) for every position: ``[B, L-1]`` (and the entropy there).

    ``where`` (``[B, L-1]``, the loss mask): the output layer and the softmax over the vocabulary run
    only at those positions; the rest are 0. An agent's turns train a few generated tokens after long
    observations, so most positions need no logits (a model whose head does more than a linear layer,
    such as Gemma's soft-capping, takes the full path). Under mixed precision that output layer runs in
    float32: logits rounded to bfloat16 (±0.04 at a logit of 20) would move every importance ratio.
    ``tree`` (the rows' :class:`~rollart.training.prefix_tree.PrefixTree`, with ``where``): the decoder
    runs each distinct prefix once, and the head each distinct predicted token once."""
    if where is not None and _plain_head(model):
        keep = where.bool()
        if tree is not None:
            hidden = tree_states(model.get_decoder(), tree)
            children, at = torch.unique(tree.paths[:, 1:][keep.cpu()], return_inverse=True)
            before, targets = tree.parents[children].to(hidden.device), tree.tokens[children].to(hidden.device)
            at = at.to(hidden.device)
        else:
            hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            hidden, before, targets, at = hidden[:, :-1], keep, input_ids[:, 1:][keep], None
        picked, entropy = _head_logprobs(model, hidden[before], targets, with_entropy)
        spread = torch.zeros(keep.shape, dtype=picked.dtype, device=picked.device)
        if at is not None:  # one value per distinct node: back to every position that predicts it
            picked, entropy = picked[at], (entropy[at] if entropy is not None else None)
        if entropy is None:
            return spread.masked_scatter(keep, picked)
        return spread.masked_scatter(keep, picked), spread.masked_scatter(keep, entropy)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return picked
    return picked, -(log_probs.exp() * log_probs).sum(-1)


def _head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) from the output layer at ``hidden`` (``[K, H]``), in float32 (and the entropy)."""
    with torch.autocast(hidden.device.type, enabled=False):  # mixed precision: the head in float32
        logits = model.get_output_embeddings()(hidden.float()).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked, (-(log_probs.exp() * log_probs).sum(-1) if with_entropy else None)


def _plain_head(model) -> bool:
    """The causal LM's logits are its output layer applied to its decoder's last hidden state."""
    config = getattr(model, "config", None)
    return (hasattr(model, "get_decoder") and model.get_output_embeddings() is not None
            and not getattr(config, "final_logit_softcapping", None) and getattr(config, "logit_scale", None) is None)


def autocast_dtype(mixed_precision: str, device: str) -> torch.dtype | None:
    """``trainer.mixed_precision`` as the forward's autocast dtype on ``device`` (None: float32). A GPU
    without bfloat16 fails here, naming the field; a CPU without bf16 instructions runs it emulated
    (slower than float32), which is worth a warning, not a refusal."""
    if mixed_precision == "no":
        return None
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        from rollart.config import ConfigError

        raise ConfigError(f"trainer.mixed_precision: bf16 needs a GPU with bfloat16; {torch.cuda.get_device_name()} has none")
    native = kind != "cpu" or cpu_has_bf16()
    if not native:
        log.warning("trainer.mixed_precision: bf16 on a CPU without avx512_bf16 or AMX is emulated and "
                    "slower than float32")
    log.info("trainer.mixed_precision: the forward in bfloat16 (autocast on %s, native bf16: %s)", kind,
             "yes" if native else "no")
    return torch.bfloat16


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (x86 ``avx512_bf16`` or ``amx_bf16``; Arm ``bf16``)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    words = set(flags.split())
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def zero_missing_gradients(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Give every trainable parameter without a gradient (no row reached it) a zero one; returns the
    trainable parameters. Adam then steps them on zeros, and an all-reduce has a buffer for each."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return params


class AccumulatingBackend:
    """One optimiser step per batch over micro-batches; a backend supplies ``_micro_loss`` and holds
    ``model``, ``optimizer``, ``micro_batch``, ``loss_cfg``, ``grad_clip`` and ``step``."""

    def _micro_loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        raise NotImplementedError

    mixed_precision: torch.dtype | None = None  # the forward's autocast dtype (trainer.mixed_precision)
    prefix_tree: bool = False  # micro-batches of rows sharing prefixes, each run once (trainer.prefix_tree)

    def autocast(self) -> torch.autocast:
        """The forward's precision: float32, or ``mixed_precision`` for what autocast lowers (matrix
        products); the loss's own arithmetic is on float32 logprobs either way."""
        device = torch.device(self.device).type
        return torch.autocast(device, dtype=self.mixed_precision or torch.float32,
                              enabled=self.mixed_precision is not None)

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimiser step over the batch (micro-batched); returns averaged metrics."""
        self.optimizer.zero_grad(set_to_none=True)
        metrics = over_trained_rows(self.accumulate(batch, range(batch.input_ids.shape[0])))
        metrics["grad_norm"] = self.apply_gradients()
        return metrics

    def accumulate(self, batch: Batch, rows: Sequence[int], *, normaliser: float | None = None) -> dict[str, float]:
        """Forward and backward over ``rows`` of the batch, micro-batched, adding to the gradients.
        Each micro-batch's loss is a mean over its own tokens (or sequences): it is weighed by its
        share of the *whole* batch's, so the gradients of disjoint ``rows`` (data-parallel ranks)
        sum to the whole batch's gradient, and so do the returned metrics (weighted sums: see
        :func:`~rollart.training.algorithms.over_trained_rows`). Rows that carry no gradient are skipped.
        ``normaliser``: what a share is taken of, by default this batch's :meth:`loss_normaliser`; 1.0
        leaves sums (a step built from parts divides them once the whole is known: :meth:`scale_gradients`)."""
        normaliser = max(self.loss_normaliser(batch) if normaliser is None else normaliser, 1.0)
        metrics: dict[str, float] = {"loss": 0.0, "trained_fraction": 0.0}
        for micro in batch.micro_batches(self._rows_with_gradient(batch, rows), self.micro_batch,
                                         by_prefix=self.prefix_tree):
            with self.autocast():
                loss, m, mask = self._micro_loss(micro)
            share = (float(mask.sum()) if self.loss_cfg.token_mean else mask.shape[0]) / normaliser
            (loss * share).backward()
            combine_metrics(metrics, {**m, "trained_fraction": 1.0}, share)
        return metrics

    def loss_normaliser(self, batch: Batch) -> float:
        """What the batch's loss is a mean over: its generated tokens (``token_mean``) or its rows."""
        if self.loss_cfg.token_mean:
            return float(batch.loss_mask.sum())
        return float(batch.input_ids.shape[0])

    def scale_gradients(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (sums over parts, into the whole's mean)."""
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def _rows_with_gradient(self, batch: Batch, rows: Sequence[int]) -> list[int]:
        """``rows`` less those with advantage 0 where the loss gives them no gradient (their tokens still
        count in the normaliser, :meth:`loss_normaliser`)."""
        if not self.loss_cfg.skips_zero_advantage_rows:
            return list(rows)
        advantages = batch.advantages.tolist()
        return [i for i in rows if advantages[i] != 0.0]

    def apply_gradients(self) -> float:
        """Clip the accumulated gradients and take the optimiser step; returns the gradient norm."""
        zero_missing_gradients(self.model)  # no row trained: Adam steps on zeros, as it did before
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        self.optimizer.step()
        self.step += 1
        return grad_norm

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # Model, optimizer and step; the trainer stage adds its own state (version, trained ids) beside.
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step},
                   directory / "trainer.pt")


class TorchBackend(AccumulatingBackend):
    """One optimiser step per batch. The decoupled objective's proximal policy is the version before the
    one trained (:func:`~rollart.training.algorithms.proximal_logprobs`), from the forward pass's own
    logprobs and the behaviour's: no extra forward pass."""

    def __init__(self, model_path: str | Path, *, lr: float = 5e-4, micro_batch: int = 8,
                 device: str | None = None, loss: PolicyLossConfig | None = None, grad_clip: float = 1.0,
                 prefix_tree: bool = True):
        from transformers import AutoModelForCausalLM

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.micro_batch = micro_batch
        self.loss_cfg = loss or PolicyLossConfig()
        self.grad_clip = grad_clip
        self.prefix_tree = prefix_tree and self._tree_works()
        self.reference = None
        if self.loss_cfg.kl_coef:
            self.reference = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
            self.reference.to(self.device).eval().requires_grad_(False)
        self.step = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def _micro_loss(self, micro: Batch) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        ids = micro.input_ids.to(self.device)
        attention = micro.attention_mask.to(self.device)
        mask = micro.loss_mask.to(self.device)
        cfg = self.loss_cfg
        tree = self._tree(micro)
        logprobs, entropy = token_logprobs(self.model, ids, attention, with_entropy=True, where=mask, tree=tree)
        behaviour = micro.behaviour_logprobs.to(self.device)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference, ids, attention, where=mask, tree=tree)
        old = old_logprobs(cfg, logprobs, behaviour, micro.staleness.to(self.device))
        loss, metrics = policy_loss(logprobs, old, micro.advantages.to(self.device), mask, cfg,
                                    behaviour_logprobs=behaviour, ref_logprobs=ref,
                                    entropy=entropy if cfg.entropy_coef else None)
        metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1.0))
        return loss, metrics, mask

    def _tree_works(self) -> bool:
        if not _plain_head(self.model):
            return False  # logprobs take the full model's logits there (token_logprobs), not the tree's
        if tree_matches_rows(self.model, token_logprobs):
            return True
        log.warning("trainer.prefix_tree: %s's attention does not take the tree's (a probe's logprobs differ from "
                    "the padded rows'); training on padded rows", type(self.model).__name__)
        return False

    def _tree(self, micro: Batch) -> PrefixTree | None:
        """The micro-batch's prefix tree, where its forward costs less than the padded rows': a token's
        layers cost ~12 H² multiply-adds, a pair of tokens in attention ~4 H; the rows' attention is
        W x W per row, the tree's its runs of nodes against the nodes each sees."""
        if not self.prefix_tree:
            return None
        tree = PrefixTree.of(micro.input_ids, micro.attention_mask)
        rows, width = micro.input_ids.shape
        per_token = 3 * int(self.model.config.hidden_size)  # (12 H²) / (4 H): a token's layers in attention pairs
        cheaper = len(tree) * per_token + tree.attention_pairs() < rows * width * per_token + rows * width ** 2
        return tree if cheaper else None

    def load(self, directory: str | Path) -> None:
        state = torch.load(Path(directory) / "trainer.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
