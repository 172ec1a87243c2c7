"""`rollart export`: a trainer checkpoint becomes a Hugging Face directory that transformers and vLLM load,
with the trainer's logprobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch
from typer.testing import CliRunner

from rollart.cli import app
from rollart.training.checkpoint import CheckpointStore, TrainerState
from rollart.training.torch_backend import TorchBackend, token_logprobs
from tests.conftest import REPO

PROMPT = list(range(3, 40))

# a file, not -c: vLLM spawns its engine core, which imports the main module again
VLLM_PROMPT_LOGPROBS = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
        ids = json.loads(sys.argv[2])
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        print("LOGPROBS", json.dumps([lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]))
""")


def trained_checkpoint(tiny_model, root):
    """A checkpoint whose weights differ visibly from the base model (every tensor moved)."""
    backend = TorchBackend(tiny_model, device="cpu")
    with torch.no_grad():
        generator = torch.Generator().manual_seed(7)
        for tensor in backend.model.parameters():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.5 * tensor.std().clamp(min=0.02))
    CheckpointStore(root).save(backend, TrainerState(step=3, version=3))
    return backend


def logprobs_of(model) -> torch.Tensor:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids))[0]


def test_an_exported_checkpoint_loads_in_transformers_and_vllm_with_the_trainers_logprobs(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = trained_checkpoint(tiny_model, tmp_path / "run" / "checkpoints")
    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["export", str(tmp_path / "run"), "--out", str(out),
                                      "--base-model", str(tiny_model)])
    assert result.exit_code == 0, result.output
    info = json.loads((out / "rollart_export.json").read_text())
    assert (info["step"], info["version"]) == (3, 3) and info["checkpoint"].endswith("step-3")
    assert (out / "model.safetensors").exists() and AutoTokenizer.from_pretrained(str(out)).vocab_size > 0

    trainer = logprobs_of(backend.model)
    exported = logprobs_of(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32))
    base = logprobs_of(AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32))
    assert float((exported - trainer).abs().max()) < 1e-5, "transformers: the trained weights, exactly"
    assert float((base - trainer).abs().max()) > 0.05, "the checkpoint is not the base model"

    script = tmp_path / "vllm_prompt_logprobs.py"
    script.write_text(VLLM_PROMPT_LOGPROBS)
    proc = subprocess.run([sys.executable, str(script), str(out), json.dumps(PROMPT)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("LOGPROBS ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    engine = torch.tensor(json.loads(line.split(" ", 1)[1]))
    assert float((engine - trainer).abs().max()) < 2e-3, "vLLM serves the exported policy"


def test_no_checkpoint_is_a_clear_error(tmp_path, tiny_model):
    result = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "x"),
                                      "--base-model", str(tiny_model)])
    assert result.exit_code == 2 and "no trainer checkpoint" in result.output


def test_a_megatron_checkpoint_is_converted_back_to_hugging_face_names(tiny_model, tmp_path):
    """The Megatron backend's checkpoints hold Megatron-core names (built here by the same conversion
    the backend loads with, so no Megatron process is needed); the export converts them back."""
    from transformers import AutoModelForCausalLM

    from rollart.training.megatron_backend import qwen2_to_megatron, shape_args

    backend = trained_checkpoint(tiny_model, tmp_path / "torch")
    hf = {k: v for k, v in backend.model.state_dict().items() if k != "lm_head.weight"}
    step = tmp_path / "megatron" / "step-5"
    step.mkdir(parents=True)
    torch.save({"model": qwen2_to_megatron(hf, **shape_args(backend.model.config)), "optimizer": {}, "step": 5},
               step / "trainer.pt")
    result = CliRunner().invoke(app, ["export", str(step), "--out", str(tmp_path / "out"),
                                      "--base-model", str(tiny_model)])
    assert result.exit_code == 0, result.output
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert float((logprobs_of(exported) - logprobs_of(backend.model)).abs().max()) < 1e-5
