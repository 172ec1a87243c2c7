"""A batch's rows as one tree of their distinct prefixes, for a forward pass that runs each prefix once.

The rows of an agentic RL batch repeat one another: every member of a GRPO group starts with the
task's prompt, and where an environment answers the same action with the same observation, the
members share turns as well (in the demo's FrozenLake batches the distinct prefixes are 9% of the
tokens). A causal model's state at a token depends on the tokens up to it alone, so each distinct
prefix needs computing once: the tree's nodes run as one sequence in which a node attends to its
ancestors only (position = depth), and each row reads its tokens' states back from its path. Backward
sums every row's gradient into the shared nodes. The result is the padded batch's forward; only float
rounding differs (the same idea as Prefix Grouper, Liu et al. 2025, for a group's prompt, and as
tree training, for whole agent trajectories).

Node ids follow the rows in lexicographic order, so they are a depth-first preorder of the tree: a
node's subtree is the contiguous id range ``[node, end[node])``, which makes the attention mask a
comparison, not a walk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixTree:
    tokens: torch.Tensor  # [N]: each node's token id
    depths: torch.Tensor  # [N]: each node's position in its rows
    parents: torch.Tensor  # [N]: each node's parent (a root: itself)
    ends: torch.Tensor  # [N]: one past the last id in the node's subtree
    paths: torch.Tensor  # [B, L]: the node at each row's position (padding: the row's last node)

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> "PrefixTree":
        """The tree of right-padded rows (``attention_mask`` 1 on each row's tokens, which come first)."""
        lengths = attention_mask.sum(dim=1).tolist()
        rows = [input_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        paths = torch.zeros(input_ids.shape, dtype=torch.long)
        tokens: list[int] = []
        depths: list[int] = []
        previous = None
        for r, shared in sorted_rows(rows):
            row = rows[r]
            if previous is not None:
                paths[r, :shared] = paths[previous, :shared]
            paths[r, shared:len(row)] = torch.arange(len(tokens), len(tokens) + len(row) - shared)
            paths[r, len(row):] = paths[r, len(row) - 1]
            tokens.extend(row[shared:])
            depths.extend(range(shared, len(row)))
            previous = r
        return cls._linked(torch.tensor(tokens), torch.tensor(depths), paths, lengths)

    @classmethod
    def _linked(cls, tokens: torch.Tensor, depths: torch.Tensor, paths: torch.Tensor,
                lengths: list[int]) -> "PrefixTree":
        """Parents and subtree ends from the rows' paths: a row's last node is the largest id on its path,
        and a subtree ends after the last node of the last row through it."""
        parents = torch.arange(len(tokens))
        inside = torch.arange(1, paths.shape[1])[None, :] < torch.tensor(lengths)[:, None]  # not padding
        parents[paths[:, 1:][inside]] = paths[:, :-1][inside]
        last = paths[torch.arange(paths.shape[0]), torch.tensor(lengths) - 1]
        ends = torch.zeros(len(tokens), dtype=torch.long)
        ends.scatter_reduce_(0, paths.flatten(), last.repeat_interleave(paths.shape[1]) + 1, reduce="amax")
        return cls(tokens, depths, parents, ends, paths)

    def __len__(self) -> int:
        return len(self.tokens)

    def attends(self) -> torch.Tensor:
        """``[N, N]`` boolean: node ``n`` (row) sees node ``m`` (column) iff ``m`` is ``n`` or an ancestor."""
        ids = torch.arange(len(self.tokens))
        return (ids[None, :] <= ids[:, None]) & (ids[:, None] < self.ends[None, :])


def sorted_rows(rows: list[list[int]]) -> list[tuple[int, int]]:
    """The rows' indices in lexicographic order, each with how many leading tokens it shares with the
    row before it (the first: 0). Sorted, no earlier row shares more with a row than the one before it
    does, so the tokens past that are the row's new prefixes: ``sum(len - shared)`` is the tree's size."""
    order = sorted(range(len(rows)), key=rows.__getitem__)
    return [(r, _common_prefix(rows[order[k - 1]], rows[r]) if k else 0) for k, r in enumerate(order)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tree_states(decoder, tree: PrefixTree, *, attn_implementation: str) -> torch.Tensor:
    """The decoder's last hidden state at every node, ``[N, H]``: one sequence, each node seeing its
    ancestors (an additive mask for eager attention, a boolean one for SDPA's)."""
    device = next(decoder.parameters()).device
    sees = tree.attends().to(device)
    if attn_implementation == "eager":
        dtype = next(decoder.parameters()).dtype
        mask = torch.zeros(sees.shape, dtype=dtype, device=device).masked_fill(~sees, torch.finfo(dtype).min)
    else:
        mask = sees
    return decoder(input_ids=tree.tokens[None].to(device), attention_mask=mask[None, None],
                   position_ids=tree.depths[None].to(device)).last_hidden_state[0]


# Attention implementations that take an arbitrary 4-D mask (flash attention takes none)
TREE_ATTENTION = frozenset({"sdpa", "eager"})
