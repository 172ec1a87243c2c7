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
comparison, not a walk. Attention runs by runs of consecutive nodes, each against the nodes it sees
(its root paths), not as one dense N x N: in the demo's trees that is a third of the pairs.
"""

from __future__ import annotations

import functools
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

    @functools.cached_property
    def blocks(self) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
        """The runs the tree's attention takes (:meth:`runs` of 128 nodes; computed once per tree)."""
        return self.runs(128)

    def attention_pairs(self) -> int:
        """(query, key) pairs the tree's attention computes, masked ones included."""
        return sum((queries.stop - queries.start) * len(keys) for queries, keys, _ in self.blocks)

    def runs(self, size: int) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
        """The nodes in runs of ``size``, each with the nodes any of them sees and which sees which:
        ``(queries, keys, mask)``. A run of consecutive (preorder) nodes sees its few root paths, not the
        whole tree: attention over these is a fraction of the dense N x N one (the demo's train step
        0.156 s with one dense attention, 0.100-0.104 s in runs of 64-256 nodes, 0.14-0.15 s in 16s)."""
        sees = self.attends()
        out = []
        for start in range(0, len(self.tokens), size):
            queries = slice(start, min(start + size, len(self.tokens)))
            keys = sees[queries].any(dim=0).nonzero().flatten()
            out.append((queries, keys, sees[queries][:, keys]))
        return out


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


def tree_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                   scaling: float | None = None, dropout: float = 0.0, tree_blocks=None, **_):
    """Attention over a prefix tree's nodes, run by runs of nodes against the nodes each run sees
    (:meth:`PrefixTree.runs`); ``[1, heads, N, d]`` in, ``[1, N, heads, d]`` out, as Hugging Face's
    attention functions."""
    repeats = query.shape[1] // key.shape[1]  # grouped-query attention: each key head serves several
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    parts = []
    for queries, keys, mask in tree_blocks:
        keys, mask = keys.to(query.device), mask.to(query.device)
        parts.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, queries], key[:, :, keys], value[:, :, keys], attn_mask=mask, dropout_p=dropout,
            scale=scaling))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


TREE_ATTENTION_NAME = "rollart_prefix_tree"


def tree_states(decoder, tree: PrefixTree) -> torch.Tensor:
    """The decoder's last hidden state at every node, ``[N, H]``: one sequence, each node seeing its
    ancestors, by runs of nodes (:func:`tree_attention`, in place of the model's own attention: a
    model whose layers call Hugging Face's attention interface; :func:`tree_matches_rows` checks)."""
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION_NAME, tree_attention)
    device = next(decoder.parameters()).device
    config = decoder.config
    own = config._attn_implementation
    config._attn_implementation = TREE_ATTENTION_NAME
    try:
        # a 4-D mask is taken as given (here unused): no N x N mask is built
        return decoder(input_ids=tree.tokens[None].to(device),
                       attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
                       position_ids=tree.depths[None].to(device), tree_blocks=tree.blocks).last_hidden_state[0]
    finally:
        config._attn_implementation = own


def tree_matches_rows(model, forward) -> bool:
    """Whether ``forward(model, ids, attention, where, tree)`` (the backend's logprobs) on a probe of
    two rows sharing a prefix gives the padded rows' logprobs: a model whose attention does not go
    through Hugging Face's attention interface would ignore the tree's and see every node."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    where = attention[:, 1:].float()
    device = next(model.parameters()).device
    ids, attention, where = ids.to(device), attention.to(device), where.to(device)
    training = model.training
    model.eval()  # no dropout: the two forwards must see the same weights
    try:
        with torch.no_grad():
            rows = forward(model, ids, attention, where=where)
            tree = forward(model, ids, attention, where=where, tree=PrefixTree.of(ids.cpu(), attention.cpu()))
    finally:
        model.train(training)
    return bool(torch.allclose(rows, tree, atol=1e-4, rtol=1e-3))
