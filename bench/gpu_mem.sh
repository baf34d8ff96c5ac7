#!/usr/bin/env bash
# Issue 16 on the lent GPU in one call: the engine's CUDA tests (copy stream, external params, live budget),
# then GPT 1.5B (48 layers, d 1600, 25 heads, vocab 50304, bf16, ZeRO-3, client AdamW, micro-batch 4 x 1024
# tokens, world 1): peak GPU memory and step time for the engine, DeepSpeed and plain PyTorch, each with one
# more step under the allocator's recorder (--mem-trace: peak per phase, what is live at the peak, by line);
# then the 355M GPT with params and optimizer offloaded (the copy stream's step time).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LOG=${OUT:-/tmp}/gpu_mem.log
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c 'import torch; print("torch", torch.__version__)'; } 2>&1 | tee -a "$LOG"
timeout "${T_TESTS:-120}" python3 -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py 2>&1 | tail -25 | tee -a "$LOG"
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
B="bench/engine_bench.py ${MEM_ARGS:---size 1.5b --micro 4 --dtype bf16 --steps 5 --warmup 2} --mem-trace"
run() {  # seconds, args...
  local t=$1; shift
  timeout "$t" $TR "$@" 2>&1 | grep -E '^(RESULT|MEMPHASES|MEMSITE|MEMTRACE)|Error|error' | tail -24 | tee -a "$LOG"
}
run "${T_ENGINE:-100}" $B --impl engine
run "${T_DS:-140}" $B --impl deepspeed
run "${T_OFFLOAD:-50}" bench/engine_bench.py --impl engine ${OFF_ARGS:---size 355m --dtype bf16 --steps 6 --warmup 2} --offload
run "${T_PLAIN:-70}" $B --impl plain
