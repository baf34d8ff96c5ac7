#!/usr/bin/env bash
# `make demo`: train the demo GPT with the embedded engine (ZeRO-3, several CPU ranks), then inspect,
# verify, consolidate, evaluate, diff and reshard the result, and resume on another rank count. Pictures of
# inspect, diff and the run's series land in demo-plots/ (README, "Pictures").
set -euo pipefail
cd "$(dirname "$0")/../.."
WORLD=${1:-4}
NEW_WORLD=${2:-2}
BIN=.venv/bin
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
run() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

rm -rf out out-w$NEW_WORLD model.safetensors demo-plots
mkdir demo-plots
run $BIN/torchrun --standalone --nproc_per_node "$WORLD" docs/demo/train.py --steps 40 --save-every 10 --save out
run $BIN/zckpt inspect out/ --plot demo-plots/inspect.png
run $BIN/zckpt verify out/
run $BIN/zckpt consolidate out/ model.safetensors
run $BIN/python docs/demo/evaluate.py model.safetensors
run $BIN/zckpt diff out/ model.safetensors
printf '\n(what the last 20 steps changed; exit status 1 = "different")\n'
run $BIN/zckpt diff out/ out/ --tag-a global_step20 --tag-b global_step40 --top 5 --plot demo-plots/diff.png || true
printf '\n(the run tag by tag: one pair of checkpoints open at a time)\n'
run $BIN/zckpt diff --series out/ --plot demo-plots/series.html
run $BIN/zckpt reshard out/ out-w$NEW_WORLD --world "$NEW_WORLD"
run $BIN/torchrun --standalone --nproc_per_node "$NEW_WORLD" docs/demo/train.py --steps 5 --load out-w$NEW_WORLD
printf '\n(the same 5 steps on the original %s ranks, for comparison: the losses above should match)\n' "$WORLD"
run $BIN/torchrun --standalone --nproc_per_node "$WORLD" docs/demo/train.py --steps 5 --load out
