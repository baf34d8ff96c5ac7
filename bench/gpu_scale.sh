#!/usr/bin/env bash
# Issue 22 on the lent GPU host: bench/scale.py (a real DeepSpeed ZeRO-3 1.5B save, its world-8 and DCP copies,
# every zckpt command against its floor and its peer, beside the disk probe). Arguments go to bench/scale.py;
# SCALE_DIR (default ./scale-data, on the disk under test) holds the checkpoints between parts of one call.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  df -h "$PWD"; findmnt -T "$PWD" -o SOURCE,FSTYPE,OPTIONS | tail -1; grep -m1 'model name' /proc/cpuinfo
  python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)'; } 2>&1
python3 bench/scale.py --dir "${SCALE_DIR:-$PWD/scale-data}" --out "${OUT:-/tmp}" "$@"
