"""Export a trainer checkpoint as a Hugging Face model directory (config, safetensors, tokenizer).

A checkpoint (``step-N/trainer.pt``) holds the model's weights for resuming: Hugging Face names from
the PyTorch backend, Megatron-core names from the Megatron backend (converted back here, as the trainer
does when it publishes weights). The export starts from the run's base model directory (its config,
tokenizer and generation config), loads the trained weights into it (every tensor must match, or the
export fails naming them), and writes it with ``save_pretrained``: transformers and vLLM load the result
as they load any model. ``rollart_export.json`` beside it says which step and policy version it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

EXPORT_INFO = "rollart_export.json"


def find_checkpoint(path: Path) -> Path:
    """``path`` itself (a ``step-N`` folder), or the latest step under a checkpoints folder or a run's OUT."""
    path = Path(path)
    if (path / "trainer.pt").exists():
        return path
    for root in (path, path / "checkpoints"):
        steps = sorted(root.glob("step-*"), key=lambda p: int(p.name.split("-")[1]) if p.name[5:].isdigit() else -1)
        steps = [s for s in steps if (s / "trainer.pt").exists()]
        if steps:
            return steps[-1]
    raise ValueError(f"no trainer checkpoint in {path} (a step-N folder with trainer.pt, or a folder holding them)")


def trained_state(checkpoint: Path, hf_config) -> dict[str, torch.Tensor]:
    """The checkpoint's model weights under Hugging Face names."""
    file = checkpoint / "trainer.pt"
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)["model"]
    except Exception:  # noqa: BLE001 - a Megatron checkpoint keeps extra state that is not a tensor
        from rollart.training.megatron_backend import checkpoint_model_state

        state = checkpoint_model_state(file)
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if any(k.startswith("model.") for k in state):
        return state
    from rollart.training.megatron_backend import megatron_to_qwen2, shape_args

    return megatron_to_qwen2(state, **shape_args(hf_config))


def export_checkpoint(checkpoint: Path, base_model: Path, out: Path) -> dict:
    """Write ``out`` as a Hugging Face model directory of ``checkpoint``'s weights; returns its info."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = find_checkpoint(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(str(base_model), dtype=torch.float32)
    state = trained_state(checkpoint, model.config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{checkpoint} does not fit {base_model}: missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_model)).save_pretrained(str(out))
    trainer = json.loads((checkpoint / "trainer.json").read_text()) if (checkpoint / "trainer.json").exists() else {}
    info = {"checkpoint": str(checkpoint), "base_model": str(base_model), "step": trainer.get("step"),
            "version": trainer.get("version"), "parameters": sum(t.numel() for t in model.state_dict().values())}
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=1))
    return info
