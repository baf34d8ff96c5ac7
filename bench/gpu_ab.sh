#!/usr/bin/env bash
# Issue 38's "no speed regression" on the lent GPU host: bench/scale.py's world-1 rows (a real DeepSpeed
# 0.19.8 ZeRO-3 bf16 1.5B save made in the call, warm and cold, with the peers), then bench/ab_trees.py
# interleaving an older tree (.abtree/old: `git archive <commit> zckpt | tar -x -C .abtree/old`, carried)
# against this one on the same input. Extra arguments go to bench/scale.py.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true DS_ACCELERATOR=cuda
D=${SCALE_DIR:-$PWD/scale-data}
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
  df -h "$PWD" | tail -1; python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)'; } 2>&1
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" "$@"
python3 -m compileall -q -j 0 .abtree/old
R=${AB_REPEAT:-2}
python3 bench/ab_trees.py --tree old=.abtree/old --tree new=. --repeat "$R" \
  --clean "$D/ab.safetensors" --clean "$D/ab-w8" \
  --job "consolidate fp32=consolidate $D/ds-w1 $D/ab.safetensors --dtype fp32 --no-progress" \
  --job "consolidate default=consolidate $D/ds-w1 $D/ab.safetensors --no-progress" \
  --job "verify=verify $D/ds-w1" \
  --job "reshard 1-8=reshard $D/ds-w1 $D/ab-w8 --world 8 --no-progress"
