#!/usr/bin/env bash
# Issue 42 on the lent GPU host: what a read-time CRC check costs diff at 16 cores, this tree against the
# variant trees under .abtree/ (bench/check_cost.py under each, PYTHONPATH=tree, the files kept between), and
# a py-spy profile (--idle) of this tree's checked and unchecked diffs of the same two files into $OUT. The
# variants (12:15 found the check at 1.68x on 16 cores; 14:44: the CRC threads of checks.offloaded cost more than
# CRCs on the comparison's own threads, and page releases cost ~0.05 s). Made here before the call, carried (.abtree):
# (the trees of 14:44 / 15:06, from dfe9069, the last tree with checks.offloaded):
#   for t in head inline inlinenomadv; do mkdir -p .abtree/$t; git archive dfe9069 zckpt | tar -x -C .abtree/$t; done
#   sed -i 's/checks.offloaded(min(n, scan.cores() - n))/checks.offloaded(0)/' .abtree/inline*/zckpt/ops/diff_numpy.py
#   sed -i 's/^        _madvise_dontneed(mm, start, end - start)/        pass/' .abtree/inlinenomadv/zckpt/storage/fileio.py
# ROUNDS (default 2) rounds over the trees; PROFILE=0 leaves the py-spy profiles out.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH
D=${SCALE_DIR:-/var/tmp/sd}/cc G=${GIB:-2}
date -u; nproc; lscpu | grep -E "Model name|L2|L3"
BASE=$PYTHONPATH
for round in $(seq "${ROUNDS:-2}"); do
  for t in . .abtree/*/; do
    echo "TREE $t round $round"
    PYTHONPATH=$t:$BASE python3 bench/check_cost.py --gib "$G" --repeat 5 --dir "$D" --keep 2>&1 | grep -E "^CHECK"
  done
done
[ "${PROFILE:-1}" = 0 ] && { date -u; exit 0; }
for v in True False; do
  py-spy record -r 200 --idle -t -f raw -o "${OUT:-/tmp}/prof-diff-verify-$v.txt" -- python3 -c \
    "import zckpt; [zckpt.diff('$D/a/model.safetensors', '$D/b/model.safetensors', verify_data=$v, progress=False) for _ in range(6)]" >/dev/null 2>&1
done
py-spy record -r 200 --gil -t -f raw -o "${OUT:-/tmp}/prof-diff-verify-gil.txt" -- python3 -c \
  "import zckpt; [zckpt.diff('$D/a/model.safetensors', '$D/b/model.safetensors', progress=False) for _ in range(6)]" \
  >/dev/null 2>&1  # who holds the GIL: per chunk ~0.1 ms of Python in the checked path (2 cores, cProfile)
date -u
