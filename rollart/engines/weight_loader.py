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
        return count
