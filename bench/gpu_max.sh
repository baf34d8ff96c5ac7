#!/usr/bin/env bash
# Largest model trainable on the lent GPU with params and optimizer offloaded to host RAM (issue 7, item 4):
# bench/max_model.py for the engine and for DeepSpeed. Usage: bash bench/gpu_max.sh IMPL LAYERS... (ascending)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 DS_BUILD_OPS=0
if [ -d .whl ] && [ ! -d /tmp/site/deepspeed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
LOG=${OUT:-/tmp}/gpu_max.log
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | sed -n 2p; nproc; } | tee -a "$LOG"
impl=$1; shift
python3 bench/max_model.py --impl "$impl" --layers "$@" --timeout "${TIMEOUT:-280}" 2>&1 | tee -a "$LOG"
