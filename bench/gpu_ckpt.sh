#!/usr/bin/env bash
# Issue 16 checkpoints on the lent GPU (world 1, GPT, bf16, ZeRO-3, client AdamW): the disk's raw sequential
# O_DIRECT write/read bandwidth (dd, 4 GiB, and a Python probe with random data, 1 and 2 writes in flight),
# sha256 speed of one core and of 4 threads, then `bench/ckpt_bench.py` for the engine (sync save, async save, load) and
# DeepSpeed (sync save, load, decoupled save) at 1.5B and 355M, the engine's CUDA tests and the 355M step
# time with params and optimizer offloaded. PARTS picks what runs (default: all but e15s, in this order):
#   disk e15s e15 e355 off355 tests d15 d355      (e15s: the engine's sync save and load only, at 1.5B)
# STEADY=N: N steady-state async saves at $BIG (default 1). LOAD_DEPTHS=3,1,2: e15s loads once per number of
# reads in flight.
# Checkpoints go to CKPT_DIR (default ./ckpt-bench, on the disk under test) and are deleted as measured.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LOG=${OUT:-/tmp}/gpu_ckpt.log
CK=${CKPT_DIR:-$PWD/ckpt-bench}
PARTS=${PARTS:-disk e15 e355 off355 tests d15 d355}
BIG=${BIG:-1.5b} MID=${MID:-355m}  # model sizes (a dry run elsewhere: BIG=tiny MID=tiny DEVARGS="--device cpu")
DEVARGS=${DEVARGS:-}
has() { [[ " $PARTS " == *" $1 "* ]]; }
say() { echo "### $*" | tee -a "$LOG"; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  df -h "$PWD" /tmp; findmnt -T "$PWD" -o SOURCE,FSTYPE,OPTIONS | tail -1
  grep -m1 'model name' /proc/cpuinfo; grep -o -m1 sha_ni /proc/cpuinfo || echo "no sha_ni"
  python3 -c 'import torch; print("torch", torch.__version__)'; } 2>&1 | tee -a "$LOG"

if has disk; then
  say "dd: 4 GiB of zeros, bs=64M, oflag=direct + fsync; then read back with iflag=direct after drop_caches"
  mkdir -p "$CK"
  dd if=/dev/zero of="$CK/dd.bin" bs=64M count=64 oflag=direct conv=fsync 2>&1 | tail -1 | tee -a "$LOG"
  sync; echo 3 > /proc/sys/vm/drop_caches
  dd if="$CK/dd.bin" of=/dev/null bs=64M iflag=direct 2>&1 | tail -1 | tee -a "$LOG"
  rm -f "$CK/dd.bin"
  say "probe: random data, O_DIRECT, 64 MiB writes/reads, 1 and 2 in flight, 4 GiB each"
  timeout 120 python3 bench/disk_probe.py "$CK" 2>&1 | tee -a "$LOG"
fi

TR="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
bench() {  # seconds, label, args...
  local t=$1 label=$2; shift 2
  say "$label: ckpt_bench.py $*"
  timeout "$t" $TR bench/ckpt_bench.py --dir "$CK/run" ${DROP---drop-caches} $DEVARGS "$@" 2>&1 \
    | grep -E '^(CKPT|CKPTSUM|\[engine checkpoint\])|Error|error|Traceback|GB written|created checkpoint' | tee -a "$LOG"
  rm -rf "$CK/run"
}
has e15s && bench "${T_E15S:-110}" "engine $BIG, sync save + load only" --impl engine --size "$BIG" --micro 4 --sync-only ${LOAD_DEPTHS:+--load-depths "$LOAD_DEPTHS"}
has e15 && bench "${T_E15:-330}" "engine $BIG" --impl engine --size "$BIG" --micro 4 --verify --steady "${STEADY:-1}"
has e355 && bench "${T_E355:-150}" "engine $MID" --impl engine --size "$MID" --micro 8 --verify
if has off355; then
  say "engine 355M, params and optimizer offloaded: step time"
  timeout "${T_OFF:-90}" $TR bench/engine_bench.py --impl engine --size 355m --dtype bf16 --steps 6 --warmup 2 \
    --offload 2>&1 | grep -E '^RESULT|Error' | tee -a "$LOG"
fi
if has tests; then
  say "tests/test_engine_cuda.py"
  timeout "${T_TESTS:-180}" python3 -m pytest -q -p no:cacheprovider tests/test_engine_cuda.py 2>&1 | tail -15 | tee -a "$LOG"
fi
has d15 && bench "${T_D15:-400}" "DeepSpeed $BIG" --impl deepspeed --size "$BIG" --micro 4
has d355 && bench "${T_D355:-200}" "DeepSpeed $MID" --impl deepspeed --size "$MID" --micro 8
rm -rf "$CK"
say "done"
