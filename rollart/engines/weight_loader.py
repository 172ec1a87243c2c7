"""Runs inside vLLM's worker process (``worker_extension_cls``): loads staged weight buckets.

Only a directory path crosses the RPC (tensors would be serialised to lists on the way). The model
runner's ``reload_weights`` is used rather than ``model.load_weights``: the CPU backend repacks some
weights after loading, and reload redoes that processing.
"""

from __future__ import annotations


class WeightLoaderExtension:
    def rollart_load_weights(self, directory: str) -> int:
        from rollart.weights.buckets import read_staged

        count = 0

        def weights():
            nonlocal count
            for item in read_staged(directory):
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=weights())
        refresh_cpu_gemm_copies(self.model_runner.get_model())
        return count


def refresh_cpu_gemm_copies(model) -> int:
    """Re-pack the CPU GEMM copies of layers that keep their weight beside a packed copy.

    On CPU, vLLM packs a copy of each GEMM weight at load time (``cpu_linear``). A tied ``lm_head``
    shares the embedding's parameter but owns its packed copy, and ``reload_weights`` skips it (the
    checkpoint has no lm_head when tied): the engine would keep sampling from the *initial* output
    projection. Found by the weight-sync test that perturbs every tensor. Layers whose weight was
    dropped after packing (``numel() == 0``) are re-packed by the reload itself."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform
    except ImportError:
        return 0
    if not current_platform.is_cpu():
        return 0
    refreshed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and weight is not None and weight.ndim == 2 and weight.numel() > 0
                and not weight.is_meta):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed += 1
    return refreshed
