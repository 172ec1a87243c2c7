"""The trainer's CUDA path on a GPU machine (device tool): ``python scripts/device/trainer_check.py [--quick]``.

What CI cannot run (it has no GPU), checked on one GPU against the CPU, all in float32 with TF32 off:

* ``torch``: the PyTorch backend on CUDA against itself on CPU, same weights and batch, three steps:
  loss and grad norm per step, the weights after;
* ``megatron``: the Megatron backend on CUDA against the PyTorch backend on CUDA (the comparison
  tests/training/test_megatron_backend.py makes on CPU with shims, here with none);
* ``nccl``: the data-parallel path (rollart/training/distributed.py) over NCCL, a world of one rank
  (one GPU cannot hold two NCCL ranks): its collectives on CUDA tensors, its step equal to the plain one;
* ``bf16``: ``trainer.mixed_precision: bf16`` on CUDA, each backend against the float32 PyTorch
  backend (a looser tolerance: bfloat16 keeps 8 bits of mantissa);
* ``export``: what the trainer publishes from CUDA weights (safetensors buckets, bfloat16) read back;
* ``resume``: a CUDA checkpoint saved and loaded steps exactly as the run it came from;
* ``step_s``: seconds per training step of 32 trajectories of ~256 tokens, by model size and backend.

Prints one JSON object (and writes it to ``$OUT/trainer_check.json`` when OUT is set); exits 1 when a
check is outside its tolerance.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "training"))  # megatron_batch

TOLERANCE = {"loss": 1e-4, "grad_norm": 1e-3, "weights": 1e-4, "logprobs": 1e-3}
BF16_LOSS_TOLERANCE = 2e-2
BF16_GRAD_NORM_TOLERANCE = 5e-2
STEPS = 3


def model(root: Path, name: str, **shape) -> Path:
    from rollart.models.tiny import init_tiny_model

    return init_tiny_model(root / name, **shape)


def the_batch():
    from megatron_batch import eight_trajectories

    return eight_trajectories()


def timing_batch(vocab: int, samples: int = 32, length: int = 256):
    import random

    from rollart.bench.trainer_step import shaped_batch
    from rollart.training.torch_backend import collate

    rng = random.Random(0)
    lengths = [max(8, int(rng.gauss(length, length / 4))) for _ in range(samples)]
    return collate(shaped_batch(lengths, [n // 4 for n in lengths], 8, vocab, rng), pad_id=0)


def weight_gap(a: dict, b: dict) -> float:
    return max(float((a[k].detach().cpu() - b[k].detach().cpu()).abs().max()) for k in a)


def backend(kind: str, path: Path, device: str, micro_batch: int = 4):
    from rollart.training.algorithms import PolicyLossConfig

    loss = PolicyLossConfig(decoupled=True)
    torch.manual_seed(0)
    if kind == "megatron":
        from rollart.training.megatron_backend import MegatronBackend

        return MegatronBackend(path, lr=1e-3, micro_batch=micro_batch, loss=loss, device=device)
    from rollart.training.torch_backend import TorchBackend

    return TorchBackend(path, lr=1e-3, micro_batch=micro_batch, loss=loss, device=device)


def stepped_together(a, b, batch) -> dict:
    """Both backends take the same steps; the largest differences of each step's figures."""
    d_loss = d_norm = 0.0
    for _ in range(STEPS):
        ma, mb = a.train_step(batch), b.train_step(batch)
        d_loss = max(d_loss, abs(ma["loss"] - mb["loss"]))
        d_norm = max(d_norm, abs(ma["grad_norm"] - mb["grad_norm"]))
    return {"loss": d_loss, "grad_norm": d_norm, "last_loss": ma["loss"]}


def check_torch(path: Path, batch) -> dict:
    cpu, gpu = backend("torch", path, "cpu"), backend("torch", path, "cuda")
    out = stepped_together(cpu, gpu, batch)
    out["weights"] = weight_gap(cpu.state_dict(), gpu.state_dict())
    return out


def check_megatron(path: Path, batch) -> dict:
    from rollart.training.torch_backend import token_logprobs

    mg, pt = backend("megatron", path, "cuda"), backend("torch", path, "cuda")
    on_gpu = type(batch)(*(x.to("cuda") if isinstance(x, torch.Tensor) else x for x in vars(batch).values()))

    def logprob_gap() -> float:
        with torch.no_grad():
            a = mg.token_logprobs(on_gpu.input_ids, on_gpu.attention_mask)
            b = token_logprobs(pt.model, on_gpu.input_ids, on_gpu.attention_mask)
        return float((a - b)[on_gpu.loss_mask.bool()].abs().max())

    before = logprob_gap()
    out = stepped_together(mg, pt, batch)
    exported = mg.state_dict()
    names = set(pt.model.state_dict()) - {"lm_head.weight"}
    return {**out, "logprobs_before": before, "logprobs": logprob_gap(), "names_match": set(exported) == names,
            "weights": weight_gap(exported, pt.model.state_dict())}


def check_nccl(path: Path, batch, port: int = 29591) -> dict:
    """A world of one NCCL rank through DataParallelBackend against the plain backend."""
    from rollart.training.distributed import DataParallelBackend, init_group
    from rollart.training.ranks import Rendezvous

    rdzv = Rendezvous(rank=0, world_size=1, addr="127.0.0.1", port=port)
    init_group(rdzv, backend="nccl", timeout_s=60)
    dp = DataParallelBackend(backend("torch", path, "cuda"), rdzv, heartbeat_s=5.0, children=[])
    try:
        out = stepped_together(dp, backend("torch", path, "cuda"), batch)
        out["backend"] = torch.distributed.get_backend()
    finally:
        dp.close()
    return out


def check_bf16(path: Path, batch) -> dict:
    """Each backend under bf16 autocast stepped beside the float32 PyTorch backend on CUDA (CPU tests
    cover the PyTorch backend; Megatron's layers take autocast on CUDA only, so only a GPU shows it)."""
    out = {}
    for kind in ("torch", "megatron"):
        mixed = backend(kind, path, "cuda")
        mixed.mixed_precision = torch.bfloat16
        out[kind] = stepped_together(mixed, backend("torch", path, "cuda"), batch)
    return out


def check_export(path: Path, batch) -> dict:
    from safetensors.torch import load

    from rollart.weights.buckets import pack_buckets

    gpu = backend("torch", path, "cuda")
    gpu.train_step(batch)
    state = gpu.state_dict()
    read = {}
    for _, data in pack_buckets(state, bucket_bytes=1 << 18, dtype=torch.bfloat16):
        read.update(load(data))
    want = {k: v.detach().cpu().to(torch.bfloat16) for k, v in state.items() if k in read}
    return {"tensors": len(read), "names_missing": sorted(set(state) - set(read) - {"lm_head.weight"}),
            "weights": weight_gap({k: v.float() for k, v in read.items()}, {k: v.float() for k, v in want.items()})}


def check_resume(path: Path, batch, root: Path) -> dict:
    first = backend("torch", path, "cuda")
    first.train_step(batch)
    first.save(root / "ckpt")
    second = backend("torch", path, "cuda")
    second.load(root / "ckpt")
    out = stepped_together(first, second, batch)
    out["weights"] = weight_gap(first.state_dict(), second.state_dict())
    return out


def step_seconds(kind: str, path: Path, device: str, steps: int) -> dict:
    from transformers import AutoConfig

    b = backend(kind, path, device, micro_batch=8)
    batch = timing_batch(AutoConfig.from_pretrained(str(path)).vocab_size)
    b.train_step(batch)  # allocations, kernel choice
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        b.train_step(batch)  # returns floats: the GPU's work is done
        seconds.append(time.perf_counter() - start)
    params = sum(p.numel() for p in b.model.parameters())
    del b
    torch.cuda.empty_cache()
    return {"backend": kind, "device": device, "params_m": round(params / 1e6, 2),
            "step_s": round(statistics.median(seconds), 4)}


def failures(report: dict) -> list[str]:
    bad = []
    for check in ("torch", "megatron", "nccl", "resume"):
        scale = 10 if check == "megatron" else 1  # two implementations: their float order differs more
        for key, limit in TOLERANCE.items():
            value = report[check].get(key)
            if value is not None and value > limit * scale:
                bad.append(f"{check}.{key} = {value:.3g} > {limit * scale:g}")
    for kind, gaps in report["bf16"].items():
        if not 0.0 < gaps["loss"] <= BF16_LOSS_TOLERANCE:  # 0: autocast changed nothing
            bad.append(f"bf16.{kind}.loss gap = {gaps['loss']:.3g}, not in (0, {BF16_LOSS_TOLERANCE:g}]")
        if gaps["grad_norm"] > BF16_GRAD_NORM_TOLERANCE:
            bad.append(f"bf16.{kind}.grad_norm gap = {gaps['grad_norm']:.3g} > {BF16_GRAD_NORM_TOLERANCE:g}")
    if report["export"]["weights"] != 0.0 or report["export"]["names_missing"]:
        bad.append(f"export: {report['export']}")
    if not report["megatron"]["names_match"]:
        bad.append("megatron: exported names differ from the Hugging Face model's")
    return bad


def main(quick: bool) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = Path(tempfile.mkdtemp(prefix="trainer-check-"))
    tiny = model(root, "tiny")  # what the tests train: hidden 128, 2 layers
    batch = the_batch()
    report: dict = {"gpu": torch.cuda.get_device_name(0), "torch_version": torch.__version__,
                    "cpu_threads": torch.get_num_threads()}
    report["nccl"] = check_nccl(tiny, batch)  # first: the process group Megatron then builds on
    report["torch"] = check_torch(tiny, batch)
    report["megatron"] = check_megatron(tiny, batch)
    report["bf16"] = check_bf16(tiny, batch)
    report["export"] = check_export(tiny, batch)
    report["resume"] = check_resume(tiny, batch, root)
    sizes = {"tiny": tiny}
    if not quick:
        sizes["h512x8"] = model(root, "h512x8", hidden=512, layers=8, heads=8)
        sizes["h1024x16"] = model(root, "h1024x16", hidden=1024, layers=16, heads=16)
    rows = []
    for name, path in sizes.items():
        for kind, device in (("torch", "cpu"), ("torch", "cuda"), ("megatron", "cuda")):
            if device == "cpu" and name == "h1024x16":
                continue  # minutes per step on CPU
            rows.append({"model": name, **step_seconds(kind, path, device, steps=3 if quick else 5)})
    report["step_s"] = rows
    report["failures"] = failures(report)
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "trainer_check.json").write_text(text)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main("--quick" in sys.argv))
