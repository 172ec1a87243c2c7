"""The Megatron-core training backend (GPU clusters), for Qwen2-architecture models.

Same interface as :class:`~rollart.training.torch_backend.TorchBackend` (``train_step``, ``state_dict``,
``save``, ``load``, ``step``), so the trainer stage does not know which one runs. Weights come in and
go out in Hugging Face (Qwen2) names, because that is what the generation engines load: the
trainer publishes ``state_dict()`` exactly as with the PyTorch backend.

The name/layout conversion is plain tensor code (tested on CPU). Megatron-core's GPTModel itself
needs CUDA (its rotary embedding calls ``torch.cuda``), so the backend refuses to start without a
GPU; ``scripts/device/trainer_check.py`` checks it against the PyTorch backend on a GPU.
Tensor/pipeline parallelism are 1 here: the conversion is written for unsharded tensors. Data
parallelism is the trainer's (``trainer.world_size``): the ranks join first, and Megatron's parallel
state is made over them (data-parallel size = world size).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollart.training.algorithms import PolicyLossConfig, old_logprobs, policy_loss
from rollart.training.torch_backend import AccumulatingBackend


def qwen2_to_megatron(hf: dict[str, torch.Tensor], *, layers: int, heads: int, kv_heads: int,
                      head_dim: int) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen2 names → Megatron-core GPTModel (local spec) names, unsharded."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    per_group = heads // kv_heads
    for i in range(layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = (hf[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            # Megatron fuses QKV per query group: [q heads of the group, k, v] for each group.
            q = q.reshape(kv_heads, per_group * head_dim, *q.shape[1:])
            k = k.reshape(kv_heads, head_dim, *k.shape[1:])
            v = v.reshape(kv_heads, head_dim, *v.shape[1:])
            out[f"{dst}self_attention.linear_qkv.{kind}"] = torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])
        out[f"{dst}self_attention.linear_proj.weight"] = hf[f"{src}self_attn.o_proj.weight"]
        out[f"{dst}input_layernorm.weight"] = hf[f"{src}input_layernorm.weight"]
        out[f"{dst}pre_mlp_layernorm.weight"] = hf[f"{src}post_attention_layernorm.weight"]
        out[f"{dst}mlp.linear_fc1.weight"] = torch.cat([hf[f"{src}mlp.gate_proj.weight"],
                                                        hf[f"{src}mlp.up_proj.weight"]], dim=0)
        out[f"{dst}mlp.linear_fc2.weight"] = hf[f"{src}mlp.down_proj.weight"]
    return out


def megatron_to_qwen2(mg: dict[str, torch.Tensor], *, layers: int, heads: int, kv_heads: int,
                      head_dim: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`qwen2_to_megatron` (the tied lm_head is left to the engine)."""
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
           "model.norm.weight": mg["decoder.final_layernorm.weight"]}
    per_group = heads // kv_heads
    for i in range(layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            fused = mg[f"{src}self_attention.linear_qkv.{kind}"]
            grouped = fused.reshape(kv_heads, (per_group + 2) * head_dim, *fused.shape[1:])
            q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
            for name, part in zip("qkv", (q, k, v)):
                out[f"{dst}self_attn.{name}_proj.{kind}"] = part.reshape(-1, *fused.shape[1:]).contiguous()
        out[f"{dst}self_attn.o_proj.weight"] = mg[f"{src}self_attention.linear_proj.weight"]
        out[f"{dst}input_layernorm.weight"] = mg[f"{src}input_layernorm.weight"]
        out[f"{dst}post_attention_layernorm.weight"] = mg[f"{src}pre_mlp_layernorm.weight"]
        gate, up = mg[f"{src}mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[f"{dst}mlp.gate_proj.weight"] = gate.contiguous()
        out[f"{dst}mlp.up_proj.weight"] = up.contiguous()
        out[f"{dst}mlp.down_proj.weight"] = mg[f"{src}mlp.linear_fc2.weight"]
    return out


def checkpoint_model_state(file: Path) -> dict:
    """The model state of a checkpoint this backend wrote (its own file, never message content; the
    extra state Transformer Engine keeps is not a tensor, so weights_only cannot read it)."""
    return torch.load(file, map_location="cpu", weights_only=False)["model"]


def shape_args(hf_config) -> dict[str, int]:
    heads = hf_config.num_attention_heads
    return {"layers": hf_config.num_hidden_layers, "heads": heads,
            "kv_heads": getattr(hf_config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads}


def transformer_config(hf_config, *, dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = False):
    """Megatron-core TransformerConfig for a Hugging Face Qwen2 config."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = shape_args(hf_config)
    return TransformerConfig(
        num_layers=s["layers"], hidden_size=hf_config.hidden_size, num_attention_heads=s["heads"],
        num_query_groups=s["kv_heads"], kv_channels=s["head_dim"], ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype, use_cpu_initialization=use_cpu_initialization,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)


def build_gpt_model(hf_config, *, use_cpu_initialization: bool = False):
    """A Megatron GPTModel shaped like ``hf_config`` (torch.distributed and model-parallel state must
    be initialised; see :func:`init_parallel_state`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(config=transformer_config(hf_config, use_cpu_initialization=use_cpu_initialization),
                    transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=int(getattr(hf_config, "rope_theta", 10000)),
                    share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings))


def init_parallel_state(backend: str = "nccl", port: int = 29512) -> None:
    """Megatron's model-parallel state (TP = PP = 1) over torch.distributed's world: the trainer's
    data-parallel ranks when they joined first (rollart/training/distributed.py: data-parallel size N),
    else a one-process world started here."""
    import os

    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


class MegatronBackend(AccumulatingBackend):
    def __init__(self, model_path: str | Path, *, lr: float = 5e-4, micro_batch: int = 8,
                 loss: PolicyLossConfig | None = None, grad_clip: float = 1.0, device: str | None = None):
        # device="cpu" is for tests only: Megatron-core then needs two shims (tests/training/megatron_cpu.py).
        if device is None and not torch.cuda.is_available():
            raise RuntimeError("trainer.backend megatron needs a CUDA GPU (Megatron-core's model calls torch.cuda); "
                               "use trainer.backend: torch on CPUs")
        from safetensors.torch import load_file
        from transformers import AutoConfig

        self.device = device or "cuda"
        on_cpu = self.device == "cpu"
        init_parallel_state("gloo" if on_cpu else "nccl")
        if not on_cpu:
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(1234)
        self.hf_config = AutoConfig.from_pretrained(str(model_path))
        self.shapes = shape_args(self.hf_config)
        self.model = build_gpt_model(self.hf_config, use_cpu_initialization=on_cpu).to(self.device)
        hf_state = {}
        for file in sorted(Path(model_path).glob("*.safetensors")):
            hf_state.update(load_file(file))
        self.model.load_state_dict(qwen2_to_megatron(hf_state, **self.shapes), strict=False)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.micro_batch = micro_batch
        self.loss_cfg = loss or PolicyLossConfig()
        self.grad_clip = grad_clip
        self.step = 0

    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)
        logits = self.model(input_ids, positions, ~allowed.unsqueeze(1))[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    def _micro_loss(self, micro):
        ids = micro.input_ids.to(self.device)
        mask = micro.loss_mask.to(self.device)
        logprobs = self.token_logprobs(ids, micro.attention_mask.to(self.device))
        behaviour = micro.behaviour_logprobs.to(self.device)
        old = old_logprobs(self.loss_cfg, logprobs, behaviour, micro.staleness.to(self.device))
        loss, metrics = policy_loss(logprobs, old, micro.advantages.to(self.device), mask, self.loss_cfg,
                                    behaviour_logprobs=behaviour)
        return loss, metrics, mask

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face names (what the engines load)."""
        mg = {k: v for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        return megatron_to_qwen2(mg, **self.shapes)

    def load(self, directory: str | Path) -> None:
        state = torch.load(Path(directory) / "trainer.pt", map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
