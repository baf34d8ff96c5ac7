#!/usr/bin/env bash
# Issue 42 on the lent GPU host: consolidate without torch, before/after in one call. The numpy casts against
# this host's torch (tests/test_cast.py: AVX-512 kernels may write other NaN bits than the dev machine's), the
# disk probe and the 1.5B real DeepSpeed ZeRO-3 save (bench/scale.py --parts probe,make), then
# bench/ab_trees.py interleaving an older tree (.abtree/old: `git archive <commit> zckpt | tar -x -C
# .abtree/old`, carried, with .whl) with this one: consolidate fp32 / default / fp16 warm, then fp32 and
# default after drop_caches. SCALE_DIR (default /var/tmp/sd, outside the checkout) holds the checkpoint;
# AB_REPEAT (default 2) warm runs per tree and job.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true
D=${SCALE_DIR:-/var/tmp/sd}
R=${AB_REPEAT:-2}
[ -d .abtree/old/zckpt ] || { echo ".abtree/old/zckpt missing: git archive <commit> zckpt | tar -x -C .abtree/old"; exit 2; }
{ date -u; nproc; grep -m1 'model name' /proc/cpuinfo; grep -o -m1 'avx512f' /proc/cpuinfo; } 2>&1
python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_cast.py 2>&1 | tail -3
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make
python3 -m compileall -q -j 0 .abtree/old
CK=$D/ds-w1 OUTF=$D/ab.safetensors
AB="python3 bench/ab_trees.py --tree old=.abtree/old --tree new=. --clean $OUTF --clean $OUTF.crc32.json"
$AB --repeat "$R" --job "consolidate fp32 warm=consolidate $CK $OUTF --dtype fp32 --no-progress" \
  --job "consolidate default warm=consolidate $CK $OUTF --no-progress" \
  --job "consolidate fp16 warm=consolidate $CK $OUTF --dtype fp16 --no-progress"
$AB --repeat 1 --cold --job "consolidate fp32 drop_caches=consolidate $CK $OUTF --dtype fp32 --no-progress" \
  --job "consolidate default drop_caches=consolidate $CK $OUTF --no-progress"
python3 -c "import json; print('PROBE', json.load(open('$D/probe.json')))"
