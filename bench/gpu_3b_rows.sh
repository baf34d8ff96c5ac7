#!/usr/bin/env bash
# Issue 42 at ~3B on the lent GPU host: the rows against the probe of the same call, every run rested as the
# probe is. A real DeepSpeed 0.19.8 ZeRO-3 bf16 save of GPT 2.96B (bench/scale.py --parts make --size 3b
# --micro 1; kept while the machine stays warm), then bench/scale.py --parts probe,w1 --settle SETTLE (10): a
# sync and SETTLE idle seconds before the probe and before each run, each job REPEAT (3) times warm and once
# after drop_caches. JOBS names the jobs (scale.py's names, comma-separated; all when empty), PEERS=1 adds
# zero_to_fp32 + sync. Two calls fit the 10-minute limit:
#   JOBS="consolidate fp32,consolidate default,verify" bash bench/gpu_3b_rows.sh
#   JOBS="consolidate fp32,diff vs fp32 consolidation" PEERS=1 bash bench/gpu_3b_rows.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
scale_dir 3b
S=${SETTLE:-10}
if [ ! -e "$D/ds-w1/latest" ]; then
  python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts make --size 3b --micro 1 2>&1 \
    | grep --line-buffered -E "PROBE|MADE|START-UP|compileall|Error|error"
fi
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,w1 --size 3b --settle "$S" \
  --repeat "${REPEAT:-3}" --cold ${JOBS:+--only-jobs "$JOBS"} ${PEERS:+--peers} 2>&1 \
  | grep --line-buffered -E "PROBE|SCALE|START-UP|compileall|Error|error"
date -u
