#!/usr/bin/env bash
# Engine on the lent GPU (tool `device`): CUDA parity tests at world 1, the demo model in fp16/bf16 with
# and without offload, and the 355M step-time comparison (plain PyTorch / engine / DeepSpeed ZeRO-3).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LOG=${OUT:-/tmp}/gpu.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())' | tee -a "$LOG"
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
part=${1:-all}
if [ "$part" = all ] || [ "$part" = tests ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py 2>&1 | tail -15 | tee -a "$LOG"
  for dt in bf16 fp16; do for off in "" --offload; do
    $TR bench/engine_bench.py --impl engine --size small --dtype $dt $off --steps 10 2>&1 | grep -E 'RESULT|Error' | tee -a "$LOG"
  done; done
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
  S=${SIZE:-355m}
  $TR bench/engine_bench.py --impl plain --size $S --dtype bf16 2>&1 | grep -E 'RESULT|Error' | tee -a "$LOG"
  for impl in engine deepspeed; do for off in "" --offload; do
    $TR bench/engine_bench.py --impl $impl --size $S --dtype bf16 $off 2>&1 | grep -E 'RESULT|Error|error' | tail -3 | tee -a "$LOG"
  done; done
fi
