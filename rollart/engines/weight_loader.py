"""Runs inside vLLM's worker process (``worker_extension_cls``): loads staged weight buckets.

Only a directory path crosses the RPC (tensors would be serialised to lists on the way).
``generation.weight_reload`` picks how the tensors go in:

* ``direct``: what vLLM's loader does at start-up, into the live model: the model's own
  ``load_weights`` copies each tensor into its parameter (stacked q/k/v and gate/up shards included),
  then each layer's processing after loading runs again (on CPU: each GEMM's packed copy is made again
  from the new weight). The plain weights must still be there: vLLM's CPU backend drops them after
  packing unless the plugin keeps them (:func:`rollart.engines.vllm_plugin.keep_gemm_weights`).
* ``layerwise``: the model runner's ``reload_weights``: vLLM's generic reload restores each layer from
  its recorded metadata, loads it and runs the layer's processing again (the CPU packing included).
  It handles any model (a quantized one too), at 2-4x the time of ``direct`` on the demo's model.

After a layerwise reload a tied ``lm_head`` is re-packed too (:func:`refresh_cpu_gemm_copies`).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class WeightLoaderExtension:
    def rollart_load_weights(self, directory: str, direct: bool = False) -> int:
        from rollart.weights.buckets import read_staged

        count = 0

        def weights():
            nonlocal count
            for item in read_staged(directory):
                count += 1
                yield item

        model = self.model_runner.get_model()
        if self.rollart_weight_reload(direct) == "direct":
            load_directly(model, self.model_runner.model_config, weights())
        else:
            self.model_runner.reload_weights(weights_iterator=weights())
            refresh_cpu_gemm_copies(model)
        return count

    def rollart_weight_reload(self, direct: bool) -> str:
        """How a load asked to be ``direct`` (or not) goes in this worker: "direct" or "layerwise"."""
        if not direct:
            return "layerwise"
        if loads_directly(self.model_runner.get_model(), self.model_runner.model_config):
            return "direct"
        if not getattr(self, "_rollart_warned", False):
            self._rollart_warned = True
            log.warning("rollart: this model reloads layerwise (quantized, or its GEMM weights were dropped)")
        return "layerwise"


def load_directly(model, model_config, weights) -> None:
    """What vLLM's loader does at start-up, into the live model: ``load_weights`` (each tensor into its
    parameter), then every layer's processing after loading (on CPU each GEMM's packed copy, the tied
    ``lm_head``'s included; an attention layer's derived weights, as MLA's)."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with torch.no_grad():
        model.load_weights(weights)
        device = next(model.parameters()).device
        process_weights_after_loading(model, model_config, device)


def loads_directly(model, model_config) -> bool:
    """Whether ``model.load_weights`` can take a new version: an unquantized model whose every linear
    layer still holds its plain weight (on CPU: kept beside the packed copy)."""
    if getattr(model_config, "quantization", None) is not None:
        return False
    return all(module.weight.numel() > 0 for module in model.modules()
               if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None)


def refresh_cpu_gemm_copies(model) -> int:
    """Re-pack the CPU GEMM copies of layers that keep their weight beside a packed copy.

    On CPU, vLLM packs a copy of each GEMM weight at load time (``cpu_linear``). A tied ``lm_head``
    shares the embedding's parameter but owns its packed copy, and ``reload_weights`` skips it (the
    checkpoint has no lm_head when tied): the engine would keep sampling from the *initial* output
    projection. Found by the weight-sync test that perturbs every tensor. Layers whose weight was
    dropped after packing (``numel() == 0``) were re-packed by the reload itself."""
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
