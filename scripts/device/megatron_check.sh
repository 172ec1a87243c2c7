#!/usr/bin/env bash
# On a GPU machine (device tool): Megatron backend vs PyTorch backend on CUDA, no CPU shims.
# Needs a venv with CUDA torch, megatron-core, transformers; prints one JSON line of figures.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
MODEL=${1:-/tmp/rollart-tiny}
[ -f "$MODEL/config.json" ] || "$PY" -c "from rollart.models.tiny import init_tiny_model; init_tiny_model('$MODEL')"
"$PY" tests/training/megatron_compare.py "$MODEL" cuda
