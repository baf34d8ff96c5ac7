#!/usr/bin/env bash
# Largest model trainable on the lent GPU with params and optimizer offloaded to host RAM (issue 7, item 4):
# bench/max_model.py for the engine and for DeepSpeed. Usage: bash bench/gpu_max.sh IMPL LAYERS... (ascending)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LOG=${OUT:-/tmp}/gpu_max.log
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | sed -n 2p; nproc; } | tee -a "$LOG"
impl=$1; shift
python3 bench/max_model.py --impl "$impl" --layers "$@" --timeout "${TIMEOUT:-280}" 2>&1 | tee -a "$LOG"
