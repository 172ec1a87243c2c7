"""The PyTorch training backend: a Hugging Face causal LM on CPU or GPU.

Batches are whole trajectories (the token stream with its loss mask). Token ``t`` is predicted by the
logits at ``t - 1``, so every per-token tensor is shifted by one: position ``t`` of the model's
output lines up with token ``t + 1``. Gradient accumulation splits a batch into micro-batches; the
loss of each is scaled by its share of the batch's generated tokens, so the step equals one
token-mean over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rollart.messages import ScoredTrajectory
from rollart.training.algorithms import PolicyLossConfig, group_advantages, policy_loss


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1], aligned with the predicted tokens input_ids[:, 1:]
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    group_ids: list[str]


def collate(samples: list[ScoredTrajectory], *, pad_id: int, norm: str = "group") -> Batch:
    length = max(len(s.trajectory.token_ids) for s in samples)
    n = len(samples)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.float32)
    behaviour = torch.zeros((n, length), dtype=torch.float32)
    for i, s in enumerate(samples):
        t = s.trajectory
        k = len(t.token_ids)
        ids[i, :k] = torch.frombuffer(bytearray(t.token_ids), dtype=torch.int32).long()
        attention[i, :k] = 1
        mask[i, :k] = torch.frombuffer(bytearray(t.loss_mask), dtype=torch.uint8).float()
        behaviour[i, :k] = torch.frombuffer(bytearray(t.logprobs), dtype=torch.float32)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    group_ids = [s.trajectory.group_id for s in samples]
    return Batch(ids, attention, mask[:, 1:], behaviour[:, 1:], group_advantages(rewards, group_ids, norm),
                 rewards, group_ids)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position: ``[B, L-1]``."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class TorchBackend:
    def __init__(self, model_path: str | Path, *, lr: float = 5e-4, micro_batch: int = 8,
                 device: str | None = None, loss: PolicyLossConfig | None = None):
        from transformers import AutoModelForCausalLM

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), torch_dtype=torch.float32).to(self.device)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.micro_batch = micro_batch
        self.loss_cfg = loss or PolicyLossConfig()
        self.step = 0

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimiser step over the batch (micro-batched); returns averaged metrics."""
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = float(batch.loss_mask.sum().clamp(min=1.0))
        metrics: dict[str, float] = {}
        for start in range(0, batch.input_ids.shape[0], self.micro_batch):
            part = slice(start, start + self.micro_batch)
            ids = batch.input_ids[part].to(self.device)
            mask = batch.loss_mask[part].to(self.device)
            logprobs = token_logprobs(self.model, ids, batch.attention_mask[part].to(self.device))
            behaviour = batch.behaviour_logprobs[part].to(self.device)
            loss, m = policy_loss(logprobs, behaviour, batch.advantages[part].to(self.device), mask, self.loss_cfg)
            share = float(mask.sum()) / total_tokens
            (loss * share).backward()
            for key, value in m.items():
                metrics[key] = metrics.get(key, 0.0) + value * share
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.optimizer.step()
        self.step += 1
        return metrics

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step},
                   directory / "trainer.pt")

    def load(self, directory: str | Path) -> None:
        state = torch.load(Path(directory) / "trainer.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
