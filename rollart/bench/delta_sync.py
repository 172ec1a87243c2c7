"""``rollart bench weight-sync`` (``--compare delta``, the default): full vs delta weight sync per version.

A Qwen2-shaped model (random, in memory) is trained by simulated steps: fp32 master weights each move
by Gaussian noise of scale ``lr`` (an optimiser step of that learning rate), and every step is
published in ``dtype`` (bf16, as engines serve it) by two publishers on the same transport, one per
``weights.sync`` mode, each followed by one puller that stages every version as a generation
consumer does (the delta puller keeps the version it holds). Per version and mode: bytes the puller
read, bytes the trainer wrote, and seconds (publish + pull); beside them, the fraction of the
published weights whose bits changed (slime: ~3% per sync). The two modes alternate which goes first.
"""

from __future__ import annotations

import shutil
import statistics
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rollart.config import RollartConfig
from rollart.weights.publish import WEIGHT_DTYPES, StagedVersion, WeightPublisher, sync_version
from rollart.weights.transport import make_transport

SYNC_MODES = ("full", "delta")


def qwen2_state(hidden: int, layers: int, vocab: int = 512, seed: int = 0) -> dict:
    """Random weights in the tiny Qwen2 model's layout (rollart.models.tiny, any size), fp32, with its
    initialisation (linear weights N(0, 0.02), zero biases, unit norms): how many bf16 weights a step
    changes depends on their magnitude. Built directly: no model class needed. The tied lm_head is
    the embedding (``pack_buckets`` writes it once), so it is left out."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * 0.02

    state = {"model.embed_tokens.weight": linear(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": torch.ones(hidden)}
        for proj in ("q_proj", "k_proj", "v_proj"):
            state |= {p + f"self_attn.{proj}.weight": linear(hidden, hidden), p + f"self_attn.{proj}.bias":
                      torch.zeros(hidden)}
        state |= {p + "self_attn.o_proj.weight": linear(hidden, hidden),
                  p + "post_attention_layernorm.weight": torch.ones(hidden),
                  p + "mlp.gate_proj.weight": linear(2 * hidden, hidden), p + "mlp.up_proj.weight":
                  linear(2 * hidden, hidden), p + "mlp.down_proj.weight": linear(hidden, 2 * hidden)}
    return state | {"model.norm.weight": torch.ones(hidden)}


def _unique(state: dict) -> dict:
    """``state`` without the second name of a tied tensor."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            out[name] = tensor
    return out


def _step(state: dict, lr: float, seed: int) -> None:
    """One simulated optimiser step on the fp32 master weights, in place: each weight moves by N(0, lr)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for tensor in _unique(state).values():
        tensor.add_(torch.randn(tensor.shape, generator=g), alpha=lr)


def _bits(state: dict, dtype) -> dict:
    """The weights as published (cast to ``dtype``), viewed as integers: compared bit for bit."""
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    # a copy even where dtype is the master's own (float32): the snapshot must not follow later steps
    cast = {k: v.to(dtype, copy=True).contiguous() for k, v in _unique(state).items()}
    return {k: v.view(ints[v.element_size()]) for k, v in cast.items()}


def changed_fraction(before: dict, after: dict) -> float:
    """The share of published weights whose bits differ between two :func:`_bits` snapshots."""
    changed = sum(int((after[k] != before[k]).sum()) for k in after)
    return changed / sum(t.numel() for t in after.values())


def _open_transport(config: RollartConfig, work_dir: Path, transport: str):
    """Mooncake when asked, or under ``auto`` when the configured (or recorded local) stack has one;
    else a directory under ``work_dir``."""
    from rollart.endpoints import NoEndpointError, resolve_endpoints

    try:
        endpoints = resolve_endpoints(config)
    except NoEndpointError:  # no broker known: this bench needs none, only a configured Mooncake, if any
        endpoints = SimpleNamespace(mooncake_master=config.mooncake.master,
                                    mooncake_metadata=config.mooncake.metadata_server)
    weights = config.weights.model_copy(update={"transport": transport, "fs_root": work_dir / "store"})
    return make_transport(weights, endpoints)


class _Side:
    """One sync mode: its publisher and the puller that follows it."""

    def __init__(self, mode: str, transport, staging: Path, *, bucket_bytes: int, dtype: str, codec: str):
        self.mode = mode
        self.transport = transport
        self.staging = staging / mode
        self.publisher = WeightPublisher(transport, f"bench-ws-{mode}-{uuid.uuid4().hex[:6]}",
                                         bucket_bytes=bucket_bytes, dtype=dtype, sync=mode, codec=codec)
        self.base: StagedVersion | None = None

    def sync(self, version: int, state: dict) -> dict:
        started = time.perf_counter()
        manifest, _ = self.publisher.publish(version, state)
        publish_s = time.perf_counter() - started
        started = time.perf_counter()
        pulled = sync_version(self.transport, manifest, version, self.staging, self.base)
        pull_s = time.perf_counter() - started
        if self.base is not None:
            shutil.rmtree(self.base.directory, ignore_errors=True)
        self.base = StagedVersion(version, pulled.directory, manifest) if manifest.digest else None
        if self.base is None:
            shutil.rmtree(pulled.directory, ignore_errors=True)  # as a full-sync follower does after its load
        self.publisher.collect(version)  # the version just pulled is the only one kept
        stats = self.publisher.last
        return {"mode": self.mode, "version": version, "bytes": pulled.pulled_bytes, "seconds": publish_s + pull_s,
                "publish_s": publish_s, "pull_s": pull_s, "written_bytes": stats.written_bytes,
                "changed_buckets": stats.changed, "buckets": stats.buckets, "deltas": pulled.deltas,
                "fallbacks": pulled.fallbacks, "version_bytes": manifest.total_bytes}


async def bench_delta_sync(config: RollartConfig, work_dir: Path, *, versions: int = 6, hidden: int = 768,
                           layers: int = 12, dtype: str = "bfloat16", lr: float = 1e-6,
                           transport: str = "auto", bucket_bytes: int = 32 << 20,
                           codec: str = "sparse") -> dict[str, Any]:
    import asyncio

    return await asyncio.to_thread(_measure, config, work_dir, versions, hidden, layers, dtype, lr, transport,
                                   bucket_bytes, codec)


def _measure(config: RollartConfig, work_dir: Path, versions: int, hidden: int, layers: int, dtype: str,
             lr: float, transport_kind: str, bucket_bytes: int, codec: str = "sparse") -> dict[str, Any]:
    state = qwen2_state(hidden, layers)
    transport = _open_transport(config, work_dir, transport_kind)
    sides = [_Side(mode, transport, work_dir / "staging", bucket_bytes=bucket_bytes, dtype=dtype, codec=codec)
             for mode in SYNC_MODES]
    rows: list[dict] = []
    published = _bits(state, WEIGHT_DTYPES[dtype])
    try:
        for version in range(1, versions + 2):  # version 1: the initial weights, whole in both modes
            fraction = 1.0
            if version > 1:
                _step(state, lr, seed=version)
                now = _bits(state, WEIGHT_DTYPES[dtype])
                fraction, published = changed_fraction(published, now), now
            order = sides if version % 2 else sides[::-1]  # neither mode always runs on a warmer cache
            for row in sorted((side.sync(version, state) for side in order), key=lambda r: SYNC_MODES.index(r["mode"])):
                rows.append({**row, "changed_fraction": fraction})
    finally:
        transport.close()
    return {**_result(rows, transport.name, dtype, lr), "codec": codec}


def _result(rows: list[dict], transport: str, dtype: str, lr: float) -> dict[str, Any]:
    """Per-mode medians over the steps (version 1, the initial whole publish, left out)."""
    steps = [r for r in rows if r["version"] > 1]
    summary = {}
    for mode in SYNC_MODES:
        mine = [r for r in steps if r["mode"] == mode]
        summary[mode] = {"seconds": statistics.median(r["seconds"] for r in mine),
                         "bytes": statistics.median(r["bytes"] for r in mine),
                         "written_bytes": statistics.median(r["written_bytes"] for r in mine)}
    full, delta = summary["full"], summary["delta"]
    return {"benchmark": "weight-sync", "compare": "delta", "transport": transport, "dtype": dtype, "lr": lr,
            "speedup": full["seconds"] / delta["seconds"],
            "bytes_ratio": full["bytes"] / max(delta["bytes"], 1),
            "changed_fraction": statistics.mean(r["changed_fraction"] for r in steps if r["mode"] == "delta"),
            "version_bytes": rows[0]["version_bytes"], "summary": summary, "rows": rows}
