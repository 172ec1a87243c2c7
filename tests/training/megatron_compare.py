"""The Megatron backend against the PyTorch one on the same batch: ``python megatron_compare.py MODEL [cpu|cuda]``.

Run on CPU by test_megatron_backend.py (scripts/device/trainer_check.py makes the same comparison on
a GPU). Megatron-core is a GPU library; on CPU two test-only shims let its GPTModel run:
``torch.cuda.current_device`` (asked for by the rotary embedding) answers "cpu", and the CUDA RNG
tracker's fork (used around dropout, which is 0) is a no-op. Prints one JSON line of figures.
"""

import contextlib
import json
import sys

import torch

DEVICE = sys.argv[2] if len(sys.argv) > 2 else "cpu"
if DEVICE == "cpu":
    torch.cuda.current_device = lambda: "cpu"


def main(model_dir: str) -> None:
    from megatron.core import tensor_parallel

    from megatron_batch import eight_trajectories

    from rollart.training.algorithms import PolicyLossConfig
    from rollart.training.megatron_backend import MegatronBackend, init_parallel_state
    from rollart.training.torch_backend import TorchBackend, token_logprobs

    init_parallel_state("gloo" if DEVICE == "cpu" else "nccl", port=29577)
    if DEVICE == "cpu":
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    batch = eight_trajectories()
    if DEVICE != "cpu":
        batch = type(batch)(*(x.to(DEVICE) if isinstance(x, torch.Tensor) else x for x in vars(batch).values()))
    loss = PolicyLossConfig(decoupled=True)
    mg = MegatronBackend(model_dir, lr=1e-3, micro_batch=4, loss=loss, device=DEVICE)
    pt = TorchBackend(model_dir, lr=1e-3, micro_batch=4, loss=loss, device=DEVICE)

    def gap() -> float:
        with torch.no_grad():
            a = mg.token_logprobs(batch.input_ids, batch.attention_mask)
            b = token_logprobs(pt.model, batch.input_ids, batch.attention_mask)
        mask = batch.loss_mask.bool()
        return float((a - b)[mask].abs().max())

    before = gap()
    m_mg, m_pt = mg.train_step(batch), pt.train_step(batch)
    after = gap()
    hf_names = set(pt.model.state_dict()) - {"lm_head.weight"}
    exported = mg.state_dict()
    print(json.dumps({"gap_before": before, "gap_after": after, "loss_mg": m_mg["loss"], "loss_pt": m_pt["loss"],
                      "names_match": set(exported) == hf_names,
                      "export_gap": max(float((exported[k] - pt.model.state_dict()[k]).abs().max()) for k in exported),
                      "device": DEVICE}))


if __name__ == "__main__":
    main(sys.argv[1])
