#!/usr/bin/env bash
# Issue 42 on the lent GPU host, after the profiles of 2026-12-06 09:18 (the output CRC on one thread; the
# bf16 cast's fill threads at ~15 ns an element): bench/cpu_probe.py (CRC-32, memcpy and the numpy casts at
# 1-16 threads, the cast at several block sizes), the disk probe and the 1.5B save (bench/scale.py --parts
# probe,make), bench/ab_trees.py interleaving the trees under .abtree/ (each a folder with a zckpt package:
# base, b262144, ...) with this one (new) on consolidate fp32 and default dtype, warm; then this tree's verify
# of world-2 and world-8 copies (zckpt reshard), warm, and a py-spy profile of each into $OUT.
# SCALE_DIR (default /var/tmp/sd, outside the checkout) holds the checkpoints; AB_REPEAT runs per tree and job.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true
D=${SCALE_DIR:-/var/tmp/sd}
R=${AB_REPEAT:-2}
{ date -u; nproc; lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA node\(s\)|L2|L3'; grep -o -m1 -w 'pclmulqdq' /proc/cpuinfo
  python3 -c 'import numpy, isal; print("numpy", numpy.__version__, "isal", isal.__version__)'; } 2>&1
python3 bench/cpu_probe.py --threads 1,4,8,16 --mib 128 --blocks 262144,1048576
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make
for t in .abtree/*/; do python3 -m compileall -q -j 0 "$t" >/dev/null; done
CK=$D/ds-w1 OUTF=$D/ab.safetensors
TREES=""; for t in .abtree/*/; do TREES="$TREES --tree $(basename "$t")=$t"; done
python3 bench/ab_trees.py $TREES --tree new=. --clean "$OUTF" --clean "$OUTF.crc32.json" --repeat "$R" \
  --job "consolidate fp32 warm=consolidate $CK $OUTF --dtype fp32 --no-progress" \
  --job "consolidate default warm=consolidate $CK $OUTF --no-progress"
for w in 2 8; do
  [ -f "$D/w$w/latest" ] || python3 -m zckpt.cli.app reshard "$CK" "$D/w$w" --world "$w" --no-progress
done
find "$D/w2" "$D/w8" -type f -exec cat {} + >/dev/null  # warm: reshard wrote them past the page cache
python3 bench/ab_trees.py --tree new=. --repeat 3 --job "verify w2=verify $D/w2" --job "verify w8=verify $D/w8"
for w in 2 8; do
  py-spy record -r 100 --idle -t -f raw -o "${OUT:-/tmp}/prof-verify-w$w.txt" -- python3 -m zckpt.cli.app verify "$D/w$w" >/dev/null 2>&1
done
python3 -c "import json; print('PROBE', json.load(open('$D/probe.json')))"
