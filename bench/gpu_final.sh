#!/usr/bin/env bash
# Issue 42 on the lent GPU host, the 1.5B rows of this tree with the disk's sustained write beside them: the
# disk probe and the 1.5B save (bench/scale.py --parts probe,make), then AB_REPEAT rounds of [an O_DIRECT write
# of the fp32 output's size (dd, 64 MiB blocks, fsync: what the disk sustains at that moment), consolidate fp32
# warm, consolidate default dtype warm], both after drop_caches, and a py-spy --gil profile of the default
# dtype job into $OUT. SCALE_DIR (default /var/tmp/sd, outside the checkout) holds the checkpoint.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true
D=${SCALE_DIR:-/var/tmp/sd}
R=${AB_REPEAT:-3}
date -u
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make | grep -E "PROBE|MADE|compileall|START-UP"
CK=$D/ds-w1 OUTF=$D/ab.safetensors
find "$CK" -type f -exec cat {} + >/dev/null
AB="python3 bench/ab_trees.py --tree new=. --clean $OUTF --clean $OUTF.crc32.json"
for i in $(seq "$R"); do
  t0=$(date +%s.%N); dd if=/dev/zero of="$D/dd" bs=64M count=93 oflag=direct conv=fsync status=none
  t1=$(date +%s.%N); rm -f "$D/dd"
  python3 -c "print(f'DD-WRITE 6.24 GB: {$t1 - $t0:.2f} s = {6.2415 / ($t1 - $t0):.3f} GB/s')"
  $AB --repeat 1 --job "consolidate fp32 warm=consolidate $CK $OUTF --dtype fp32 --no-progress" \
    --job "consolidate default warm=consolidate $CK $OUTF --no-progress" | grep -v MEDIAN
done
$AB --repeat 1 --cold --job "consolidate fp32 drop_caches=consolidate $CK $OUTF --dtype fp32 --no-progress" \
  --job "consolidate default drop_caches=consolidate $CK $OUTF --no-progress" | grep -v MEDIAN
find "$CK" -type f -exec cat {} + >/dev/null; rm -f "$OUTF" "$OUTF.crc32.json"
py-spy record -r 100 --gil -t -f raw -o "${OUT:-/tmp}/prof-default-gil.txt" -- python3 -m zckpt.cli.app \
  consolidate "$CK" "$OUTF" --no-progress >/dev/null 2>&1
python3 -c "import json; print('PROBE', json.load(open('$D/probe.json')))"
