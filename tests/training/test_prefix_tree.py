"""The prefix-tree forward: each distinct prefix of a micro-batch's rows runs once, and the logprobs,
entropies, gradients and optimiser steps are the padded rows' own."""

from __future__ import annotations

import copy

import pytest
import torch

from rollart.training.algorithms import PolicyLossConfig
from rollart.training.prefix_tree import PrefixTree
from rollart.training.torch_backend import Batch, TorchBackend, token_logprobs

# Two groups' prompts; rows share a prompt, some a turn more, one row is another's prefix, and one row
# shares nothing with the rest (a tree of two roots)
ROWS = [
    [5, 6, 7, 8, 9, 10, 11],
    [5, 6, 7, 8, 9, 12],
    [5, 6, 7, 8, 9, 10, 11, 13, 14],
    [5, 6, 7, 8, 9, 10],
    [5, 6, 7, 15, 16, 17, 18, 19],
    [20, 21, 22, 23],
]


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
    return ids, attention


def distinct_prefixes(rows: list[list[int]]) -> set[tuple[int, ...]]:
    return {tuple(row[:k]) for row in rows for k in range(1, len(row) + 1)}


def test_the_tree_holds_each_distinct_prefix_once_and_each_node_sees_its_ancestors_only():
    ids, attention = padded(ROWS)
    tree = PrefixTree.of(ids, attention)
    assert len(tree) == len(distinct_prefixes(ROWS)) == 19
    prefix_of = {}
    for i, row in enumerate(ROWS):
        path = tree.paths[i, :len(row)]
        assert tree.tokens[path].tolist() == row  # each row reads its own tokens back along its path
        assert tree.depths[path].tolist() == list(range(len(row)))
        assert (tree.paths[i, len(row):] == path[-1]).all()  # padding points at the row's last node
        for k, node in enumerate(path.tolist()):
            assert prefix_of.setdefault(node, tuple(row[:k + 1])) == tuple(row[:k + 1])  # one node, one prefix
            assert int(tree.parents[node]) == (path[k - 1] if k else node)
    sees = tree.attends()
    for node, prefix in prefix_of.items():
        visible = {prefix_of[m] for m in sees[node].nonzero().flatten().tolist()}
        assert visible == {prefix[:k] for k in range(1, len(prefix) + 1)}, prefix


def test_attention_runs_by_runs_of_nodes_against_the_nodes_each_sees():
    ids, attention = padded(ROWS)
    tree = PrefixTree.of(ids, attention)
    sees = tree.attends()
    runs = tree.runs(4)
    assert [q.start for q, _, _ in runs] == list(range(0, len(tree), 4)) and runs[-1][0].stop == len(tree)
    for queries, keys, mask in runs:
        assert set(keys.tolist()) == set(sees[queries].any(dim=0).nonzero().flatten().tolist())
        assert torch.equal(mask, sees[queries][:, keys])
    assert sum((q.stop - q.start) * len(k) for q, k, _ in runs) < len(tree) ** 2


@pytest.mark.parametrize("attention_kind", ["sdpa", "eager"])
def test_logprobs_entropies_and_gradients_are_the_padded_forwards(tiny_model, attention_kind):
    backend = TorchBackend(tiny_model)
    model = backend.model
    model.config._attn_implementation = attention_kind
    ids, attention = padded(ROWS)
    where = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, row in enumerate(ROWS):
        where[i, 3:len(row) - 1] = 1.0  # inside the shared prompt too: rows weigh a shared token differently
    weight = torch.linspace(-1.0, 1.0, len(ROWS))[:, None]
    results = []
    for tree in (None, PrefixTree.of(ids, attention)):
        model.zero_grad()
        logprobs, entropy = token_logprobs(model, ids, attention, with_entropy=True, where=where, tree=tree)
        ((logprobs + 0.3 * entropy) * weight * where).sum().backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_rows, ent_rows, grad_rows), (lp_tree, ent_tree, grad_tree) = results
    assert lp_rows.abs().sum() > 0
    assert torch.allclose(lp_tree, lp_rows, atol=1e-5) and torch.allclose(ent_tree, ent_rows, atol=1e-5)
    assert ((lp_tree != 0) == (where != 0)).all()
    for a, b in zip(grad_tree, grad_rows):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def _batch(rows: list[list[int]]) -> Batch:
    ids, attention = padded(rows)
    loss_mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, row in enumerate(rows):
        loss_mask[i, 4:len(row) - 1] = 1.0
    n = len(rows)
    return Batch(ids, attention, loss_mask, torch.full(loss_mask.shape, -6.0), torch.zeros(loss_mask.shape),
                 torch.linspace(-1.0, 1.0, n), torch.zeros(n), [f"g{i % 2}" for i in range(n)])


def test_a_batchs_gradient_on_the_tree_is_the_padded_rows_gradient(tiny_model):
    """Micro-batches of 3 rows (lexicographic: rows sharing a prompt together), accumulated each way.
    (Not the parameters after a step: Adam's first step is lr x sign(gradient), and a gradient of ~0
    takes either sign by rounding.)"""
    loss = PolicyLossConfig(algorithm="grpo", decoupled=True)
    padded_rows = TorchBackend(tiny_model, lr=1e-2, micro_batch=3, loss=loss, prefix_tree=False)
    tree = TorchBackend(tiny_model, lr=1e-2, micro_batch=3, loss=loss)
    assert tree.prefix_tree and not padded_rows.prefix_tree
    batch = _batch(ROWS)
    assert [m.input_ids[:, 0].tolist() for m in batch.micro_batches(range(6), 3, by_prefix=True)] == [[5, 5, 5], [5, 5, 20]]
    assert all(tree._tree(m) is not None for m in batch.micro_batches(range(6), 3, by_prefix=True))
    a, b = padded_rows.accumulate(copy.deepcopy(batch), range(6)), tree.accumulate(batch, range(6))
    assert a["loss"] != 0 and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert a["clip_fraction"] == b["clip_fraction"]
    for p, q in zip(padded_rows.model.parameters(), tree.model.parameters()):
        assert p.grad.abs().sum() > 0 and torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4)


def test_rows_sharing_nothing_run_padded(tiny_model):
    """Without shared prefixes the tree saves no token and its attention (every node against every
    node) would outgrow the rows' own: the backend runs the padded rows."""
    backend = TorchBackend(tiny_model)
    apart = _batch([[i * 10 + k for k in range(8)] for i in range(1, 5)])
    assert backend._tree(apart) is None
    assert backend._tree(_batch(ROWS)) is not None


def test_a_model_whose_attention_ignores_the_tree_trains_on_padded_rows(tiny_model, monkeypatch, caplog):
    """A model whose layers do not call Hugging Face's attention interface would attend across the
    tree's branches: the backend's probe finds its logprobs differ and trains on padded rows."""
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    class OwnAttention:  # the model's own attention, whatever the config names
        @staticmethod
        def get_interface(name, default):
            return qwen2.eager_attention_forward

    monkeypatch.setattr(qwen2, "ALL_ATTENTION_FUNCTIONS", OwnAttention)
    backend = TorchBackend(tiny_model)
    assert not backend.prefix_tree and "does not take the tree's" in caplog.text
    assert backend._tree(_batch(ROWS)) is None
