#!/usr/bin/env bash
# Issue 42's cold path on the lent GPU host, before/after in one call: the 1.5B real DeepSpeed ZeRO-3 save and
# the disk probe with its concurrent read+write figure (bench/scale.py --parts probe,make), then
# bench/ab_trees.py interleaving an older tree (.abtree/old: `git archive <commit> zckpt | tar -x -C
# .abtree/old`, carried, as bench/gpu_ab.sh) with this one: consolidate --dtype fp32 and verify with the
# checkpoint's pages evicted before each run (--evict: torch's libraries stay cached), then consolidate after
# drop_caches (--cold: everything read from the disk). SCALE_DIR (default ./scale-data) holds the checkpoint;
# AB_REPEAT (default 3) runs per tree and job. Floors: the PROBE lines (read, write, read+write at once).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true DS_ACCELERATOR=cuda
D=${SCALE_DIR:-$PWD/scale-data}
R=${AB_REPEAT:-3}
[ -d .abtree/old/zckpt ] || { echo ".abtree/old/zckpt missing: git archive <commit> zckpt | tar -x -C .abtree/old"; exit 2; }
{ date -u; nproc; free -g | head -2; df -h "$PWD" | tail -1; grep -m1 'model name' /proc/cpuinfo; } 2>&1
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make
python3 -m compileall -q -j 0 .abtree/old
CK=$D/ds-w1 OUTF=$D/ab-fp32.safetensors
AB="python3 bench/ab_trees.py --tree old=.abtree/old --tree new=. --clean $OUTF --clean $OUTF.crc32.json"
$AB --repeat "$R" --evict "$CK" \
  --job "consolidate fp32 cold-inputs=consolidate $CK $OUTF --dtype fp32 --no-progress" \
  --job "verify cold-inputs=verify $CK --no-progress"
$AB --repeat 2 --cold --job "consolidate fp32 drop_caches=consolidate $CK $OUTF --dtype fp32 --no-progress"
python3 -c "import json; print('PROBE', json.load(open('$D/probe.json')))"
