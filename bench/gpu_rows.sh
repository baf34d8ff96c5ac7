#!/usr/bin/env bash
# Issue 42 on the lent GPU host, the rows not yet measured with this tree at 16 cores: bench/scale.py --parts
# probe,make,w1,w8,dcp (consolidate fp32 / default, verify and diff against the fp32 consolidation, warm and
# after drop_caches, of the 1.56B save at world 1, its world-8 reshard and its DCP reshard), then what a
# read-time CRC check costs diff at 16 cores (bench/check_cost.py, two 4 GiB files). SCALE_DIR (default
# /var/tmp/sd-1.5b, outside the checkout) holds the checkpoints.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true
D=${SCALE_DIR:-/var/tmp/sd-1.5b}  # not another size left by an earlier call on a warm machine (12:15)
for o in /var/tmp/sd /var/tmp/sd-*; do [ "$o" = "$D" ] || rm -rf "$o"; done
date -u
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make,w1,w8,dcp,drop-w1 --repeat "${REPEAT:-1}" \
  --cold 2>&1 | grep -E "PROBE|MADE|START-UP|^\||probe:"
python3 bench/check_cost.py --gib 4 --repeat 5 --dir "$D/cc" 2>&1 | grep -E "CHECK|floor"
date -u
