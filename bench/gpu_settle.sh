#!/usr/bin/env bash
# Issue 42 on the lent GPU host: warm consolidate fp32 against the disk probe with the disk rested alike before
# each. The filesystem and how it takes a job-sized O_DIRECT file by request size, depth and preallocation
# (bench/write_modes.py); the disk probe and the save (bench/scale.py --parts probe,make; SIZE 1.5b or 3b);
# then AB_REPEAT rounds of [the probe's depth-1 write of 4 GiB, then consolidate fp32 warm under each tree in
# .abtree/ and this one (new), order alternating], SETTLE idle seconds after a sync before each; one
# drop_caches round, and a timeline of one warm run (bench/timeline.py: where the write starts and ends).
# SCALE_DIR (default /var/tmp/sd-SIZE, outside the checkout) holds the checkpoint.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
SIZE=${SIZE:-1.5b}
scale_dir "$SIZE"  # one folder per size: a warm machine may still hold the other size
R=${AB_REPEAT:-3}
S=${SETTLE:-10}
for q in /sys/block/*/queue; do echo "$q $(cat $q/max_sectors_kb 2>/dev/null) kB max, depth $(cat $q/nr_requests 2>/dev/null), sched $(cat $q/scheduler 2>/dev/null)"; done
python3 bench/write_modes.py "$D" --gb "${WM_GB:-6.23}" --settle "$S" ${WM_MODES:+--modes "$WM_MODES"}
if [ "$SIZE" = 3b ]; then MK="--size 3b --micro 1"; else MK=""; fi
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make $MK | grep -E "PROBE|MADE|made|START-UP"
for t in .abtree/*/; do python3 -m compileall -q -j 0 "$t" >/dev/null; done
CK=$D/ds-w1 OUTF=$D/ab.safetensors
find "$CK" -type f -exec cat {} + >/dev/null
T1=""; for t in .abtree/*/; do T1="$T1 --tree $(basename "$t")=$t"; done
for i in $(seq "$R"); do
  sync; sleep "$S"
  python3 bench/write_modes.py "$D" --gb 4.295 --modes append:64:1 --settle 0 | grep -v filesystem
  if [ $((i % 2)) = 1 ]; then TR="$T1 --tree new=."; else TR="--tree new=. $T1"; fi
  python3 bench/ab_trees.py $TR --clean "$OUTF" --clean "$OUTF.crc32.json" --repeat 1 --settle "$S" \
    --job "consolidate fp32 warm=consolidate $CK $OUTF --dtype fp32 --no-progress" | grep -v MEDIAN
done
python3 bench/ab_trees.py $T1 --tree new=. --clean "$OUTF" --clean "$OUTF.crc32.json" --repeat 1 --cold \
  --settle "$S" --job "consolidate fp32 drop_caches=consolidate $CK $OUTF --dtype fp32 --no-progress" | grep -v MEDIAN
rm -f "$OUTF" "$OUTF.crc32.json"; find "$CK" -type f -exec cat {} + >/dev/null; sync; sleep "$S"
python3 bench/timeline.py consolidate "$CK" "$OUTF" --dtype fp32 --no-progress 2>&1 | grep TIMELINE
rm -f "$OUTF" "$OUTF.crc32.json"
python3 -c "import json; print('PROBE', json.load(open('$D/probe.json')))"
date -u
