#!/usr/bin/env bash
# Issue 42 at ~3B on the lent GPU host, the warm rows, in one call: the disk probe and a real DeepSpeed 0.19.8
# ZeRO-3 bf16 save of GPT 2.96B (bench/scale.py --parts probe,make --size 3b --micro 1); how the disk takes
# an O_DIRECT file of the fp32 output's size (bench/write_modes.py, WM_GB, rested); ROUNDS rounds (default 2)
# of [the probe's 4 GiB depth-1 write, consolidate fp32 warm, consolidate default dtype warm], each after a
# sync and SETTLE (10) idle seconds, as bench/gpu_settle.sh times them; a timeline of one warm fp32 run
# (bench/timeline.py). The cold rows and the zero_to_fp32 peer come from a second call on the same warm
# machine: bench/scale.py --dir /var/tmp/sd-3b --parts probe,w1 --size 3b --cold --peers (the save stays).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
source "$(dirname "$0")/settled.sh"
scale_dir 3b
S=${SETTLE:-10}
python3 bench/scale.py --dir "$D" --out "${OUT:-/tmp}" --parts probe,make --size 3b --micro 1 2>&1 \
  | grep -E "PROBE|MADE|START-UP|compileall|Error|error"
python3 bench/write_modes.py "$D" --gb "${WM_GB:-11.86}" --modes "${WM_MODES:-append:64:1,append:16:8,buffered:16:1}" --settle "$S"
CK=$D/ds-w1 OUTF=$D/settled.safetensors
settled_rounds "$CK" "$OUTF" "${ROUNDS:-2}"
rm -f "$OUTF" "$OUTF.crc32.json"; sync; sleep "$S"
python3 bench/timeline.py consolidate "$CK" "$OUTF" --dtype fp32 --no-progress 2>&1 | grep TIMELINE
rm -f "$OUTF" "$OUTF.crc32.json"
python3 -c "import json; print('PROBE', json.load(open('$D/probe.json')))"
date -u
