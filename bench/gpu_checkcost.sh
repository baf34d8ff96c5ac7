#!/usr/bin/env bash
# Issue 42 on the lent GPU host: what a read-time CRC check costs diff at 16 cores, this tree against the
# variant trees under .abtree/ (bench/check_cost.py under each, PYTHONPATH=tree, the files kept between), and
# a py-spy profile (--idle) of this tree's checked and unchecked diffs of the same two files into $OUT. The
# variants (12:15 found the check at 1.68x on 16 cores). Candidates: Python's mmap.madvise holds the GIL for each
# release (~0.1 ms per 4 MiB, more with the kernel's TLB flush on 16 busy cores: this tree calls libc's without
# it), CRC threads contending with the comparison's, memory bandwidth. Made here before the call and carried (.abtree):
#   for t in head nomadv inline; do mkdir -p .abtree/$t; git archive HEAD~N zckpt | tar -x -C .abtree/$t; done
#   sed -i 's/        mm.madvise(mmap.MADV_DONTNEED, start, end - start)/        pass/' .abtree/nomadv/zckpt/storage/fileio.py
#   sed -i 's/checks.offloaded(min(n, scan.cores() - n))/checks.offloaded(0)/' .abtree/inline/zckpt/ops/diff_numpy.py
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH
D=${SCALE_DIR:-/var/tmp/sd}/cc G=${GIB:-2}
date -u; nproc; lscpu | grep -E "Model name|L2|L3"
BASE=$PYTHONPATH
for round in 1 2; do
  for t in . .abtree/*/; do
    echo "TREE $t round $round"
    PYTHONPATH=$t:$BASE python3 bench/check_cost.py --gib "$G" --repeat 5 --dir "$D" --keep 2>&1 | grep -E "^CHECK"
  done
done
for v in True False; do
  py-spy record -r 200 --idle -t -f raw -o "${OUT:-/tmp}/prof-diff-verify-$v.txt" -- python3 -c \
    "import zckpt; [zckpt.diff('$D/a/model.safetensors', '$D/b/model.safetensors', verify_data=$v, progress=False) for _ in range(6)]" >/dev/null 2>&1
done
py-spy record -r 200 --gil -t -f raw -o "${OUT:-/tmp}/prof-diff-verify-gil.txt" -- python3 -c \
  "import zckpt; [zckpt.diff('$D/a/model.safetensors', '$D/b/model.safetensors', progress=False) for _ in range(6)]" \
  >/dev/null 2>&1  # who holds the GIL: per chunk ~0.1 ms of Python in the checked path (2 cores, cProfile)
date -u
