#!/usr/bin/env bash
# Issue 42 on the lent GPU host, the rows not yet measured with this tree at 16 cores: bench/scale.py --parts
# probe,make,w1 (consolidate fp32 / default, verify and diff against the fp32 consolidation, warm and after
# drop_caches, of the 1.56B save at world 1); SETTLED=N (default 3) rounds of warm consolidate fp32 and default
# dtype of that save timed as bench/gpu_settle.sh does (sync and SETTLE=10 s idle before the 4 GiB probe write
# and before each run) and a timeline of one default-dtype run; then --parts w8,dcp (its world-8 and DCP
# reshards, the same jobs on each); then what a read-time CRC check costs diff at 16 cores
# (bench/check_cost.py, two 4 GiB files; CHECKCOST=0 leaves it out). SCALE_DIR (default /var/tmp/sd-1.5b,
# outside the checkout) holds the checkpoints.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/settled.sh"
scale_dir 1.5b  # not another size left by an earlier call on a warm machine (12:15)
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make,w1 --repeat "${REPEAT:-1}" \
  --cold 2>&1 | grep -E "PROBE|MADE|START-UP|^\||probe:"
S=${SETTLE:-10} CK=$D/ds-w1 OUTF=$D/settled.safetensors
settled_rounds "$CK" "$OUTF" "${SETTLED:-3}"
rm -f "$OUTF" "$OUTF.crc32.json"; sync; sleep "$S"
python3 bench/timeline.py consolidate "$CK" "$OUTF" --no-progress 2>&1 | grep TIMELINE  # default dtype
rm -f "$OUTF" "$OUTF.crc32.json"
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts w8,dcp,drop-w1 --repeat "${REPEAT:-1}" \
  --cold 2>&1 | grep -E "PROBE|MADE|START-UP|^\||probe:"
[ "${CHECKCOST:-1}" = 0 ] || python3 bench/check_cost.py --gib 4 --repeat 5 --dir "$D/cc" 2>&1 | grep -E "CHECK|floor"
date -u
