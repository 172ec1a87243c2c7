"""The Megatron-core backend: Qwen2 ↔ Megatron conversion, and training equal to the PyTorch backend.

Megatron-core runs here on CPU with two test-only shims (see megatron_compare.py); on a GPU machine
scripts/device/trainer_check.py runs the same comparison on CUDA without them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from rollart.training.megatron_backend import megatron_to_qwen2, qwen2_to_megatron, shape_args
from tests.conftest import REPO


def test_conversion_round_trips_exactly(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model)
    state = {k: v for k, v in AutoModelForCausalLM.from_pretrained(tiny_model).state_dict().items()
             if k != "lm_head.weight"}
    shapes = shape_args(config)
    mg = qwen2_to_megatron(state, **shapes)
    assert mg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (3 * config.hidden_size, config.hidden_size)
    back = megatron_to_qwen2(mg, **shapes)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_grouped_query_layout_round_trips():
    # 4 query heads in 2 groups: the fused rows are [q0 q1 k0 v0 | q2 q3 k1 v1] per group.
    heads, kv, dim, hidden = 4, 2, 3, 5
    hf = {"model.embed_tokens.weight": torch.zeros(7, hidden), "model.norm.weight": torch.ones(hidden),
          "model.layers.0.self_attn.q_proj.weight": torch.arange(heads * dim * hidden, dtype=torch.float32).view(-1, hidden),
          "model.layers.0.self_attn.k_proj.weight": -torch.arange(kv * dim * hidden, dtype=torch.float32).view(-1, hidden),
          "model.layers.0.self_attn.v_proj.weight": 1000 + torch.arange(kv * dim * hidden, dtype=torch.float32).view(-1, hidden),
          "model.layers.0.self_attn.q_proj.bias": torch.arange(heads * dim, dtype=torch.float32),
          "model.layers.0.self_attn.k_proj.bias": -torch.arange(kv * dim, dtype=torch.float32),
          "model.layers.0.self_attn.v_proj.bias": 1000 + torch.arange(kv * dim, dtype=torch.float32),
          "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, heads * dim),
          "model.layers.0.input_layernorm.weight": torch.ones(hidden),
          "model.layers.0.post_attention_layernorm.weight": torch.ones(hidden),
          "model.layers.0.mlp.gate_proj.weight": torch.randn(8, hidden),
          "model.layers.0.mlp.up_proj.weight": torch.randn(8, hidden),
          "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, 8)}
    shapes = {"layers": 1, "heads": heads, "kv_heads": kv, "head_dim": dim}
    fused = qwen2_to_megatron(hf, **shapes)["decoder.layers.0.self_attention.linear_qkv.bias"]
    q, k, v = hf["model.layers.0.self_attn.q_proj.bias"], hf["model.layers.0.self_attn.k_proj.bias"], \
        hf["model.layers.0.self_attn.v_proj.bias"]
    assert torch.equal(fused, torch.cat([q[:6], k[:3], v[:3], q[6:], k[3:], v[3:]]))
    back = megatron_to_qwen2(qwen2_to_megatron(hf, **shapes), **shapes)
    assert all(torch.equal(back[k_], v_) for k_, v_ in hf.items())


def test_megatron_backend_trains_like_the_torch_backend(tiny_model):
    out = subprocess.run([sys.executable, str(REPO / "tests/training/megatron_compare.py"), str(tiny_model), "cpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["names_match"], "state_dict() must be in Hugging Face names (what engines load)"
    assert figures["gap_before"] < 1e-4, figures  # same forward
    assert abs(figures["loss_mg"] - figures["loss_pt"]) < 1e-4, figures  # same objective
    assert figures["gap_after"] < 1e-3 and figures["export_gap"] < 1e-3, figures  # same update


def test_megatron_trains_data_parallel_under_a_torchrun_style_launch(tiny_model):
    """trainer.world_size 2 with the Megatron backend, each rank its own process with RANK/WORLD_SIZE/
    MASTER_* (as torchrun or the Kubernetes rendering sets them): Megatron's parallel state is made
    over the trainer's ranks (data-parallel size 2) and the step equals the PyTorch backend's on one."""
    import os

    from rollart.training.ranks import Rendezvous

    port = Rendezvous.local(2).port
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests/training/megatron_dp.py"), str(tiny_model)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)})
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    figures = json.loads(outputs[0][0].strip().splitlines()[-1])
    assert figures["data_parallel_size"] == 2, figures
    assert abs(figures["loss_mg"] - figures["loss_pt"]) < 1e-4, figures  # same objective over the two ranks' rows
    assert abs(figures["grad_norm_mg"] - figures["grad_norm_pt"]) < 1e-3 * figures["grad_norm_pt"], figures
    assert figures["weight_gap"] < 1e-3, figures  # same update
