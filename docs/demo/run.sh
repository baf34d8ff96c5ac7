#!/usr/bin/env bash
# `make demo`: train the demo GPT with the embedded engine (ZeRO-3, several CPU ranks), then inspect,
# verify, consolidate, evaluate, diff and reshard the result, and resume on another rank count. Everything
# it writes goes into its own folder, demo-out/ in the checkout (DEMO_DIR=... picks another): the
# checkpoints, the consolidated model and the pictures of inspect, diff and the run's series (README,
# "Pictures"). It removes only a folder it made itself (one holding its .zckpt-demo mark), never a path of
# the user's: `out/` or `model.safetensors` in the checkout are left alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORLD=${1:-4}
NEW_WORLD=${2:-2}
BIN=.venv/bin
DIR=${DEMO_DIR:-demo-out}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
run() { printf '\n\033[1m$ %s\033[0m\n' "$*"; "$@"; }

if [ -e "$DIR" ]; then
  if [ ! -f "$DIR/.zckpt-demo" ]; then
    echo "error: $DIR exists and was not made by make demo; move it, or set DEMO_DIR to a new folder" >&2
    exit 2
  fi
  rm -rf "$DIR"  # the last demo's output, marked as such
fi
mkdir -p "$DIR/plots"
touch "$DIR/.zckpt-demo"
OUT=$DIR/out
run $BIN/torchrun --standalone --nproc_per_node "$WORLD" docs/demo/train.py --steps 40 --save-every 10 --save "$OUT"
run $BIN/zckpt inspect "$OUT/" --plot "$DIR/plots/inspect.png"
run $BIN/zckpt verify "$OUT/"
run $BIN/zckpt consolidate "$OUT/" "$DIR/model.safetensors"
run $BIN/python docs/demo/evaluate.py "$DIR/model.safetensors"
run $BIN/zckpt diff "$OUT/" "$DIR/model.safetensors"
printf '\n(what the last 20 steps changed; exit status 1 = "different")\n'
run $BIN/zckpt diff "$OUT/" "$OUT/" --tag-a global_step20 --tag-b global_step40 --top 5 --plot "$DIR/plots/diff.png" || true
printf '\n(the run tag by tag: one pair of checkpoints open at a time)\n'
run $BIN/zckpt diff --series "$OUT/" --plot "$DIR/plots/series.html"
run $BIN/zckpt reshard "$OUT/" "$OUT-w$NEW_WORLD" --world "$NEW_WORLD"
run $BIN/torchrun --standalone --nproc_per_node "$NEW_WORLD" docs/demo/train.py --steps 5 --load "$OUT-w$NEW_WORLD"
printf '\n(the same 5 steps on the original %s ranks, for comparison: the losses above should match)\n' "$WORLD"
run $BIN/torchrun --standalone --nproc_per_node "$WORLD" docs/demo/train.py --steps 5 --load "$OUT"
printf '\nthe demo wrote everything into %s/ (checkpoints, model.safetensors, plots/)\n' "$DIR"
