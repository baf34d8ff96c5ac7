# Sourced by bench/gpu_rows.sh and bench/gpu_3b.sh: settled_rounds CK OUT N [ARGS] runs N rounds of [a sync and
# SETTLE (10) idle seconds, the disk probe's 4 GiB depth-1 write (bench/write_modes.py), consolidate fp32 and
# default dtype of CK into OUT, each warm and after a sync and SETTLE idle seconds (bench/ab_trees.py --settle)];
# ARGS go to each consolidate. The runs find the disk as the probe does, not busy with the last run's writes.
settled_rounds() {
  local ck=$1 out=$2 n=$3 s=${SETTLE:-10} i j
  shift 3
  for i in $(seq "$n"); do
    find "$ck" -type f -exec cat {} + >/dev/null; sync; sleep "$s"
    python3 bench/write_modes.py "$(dirname "$out")" --gb 4.295 --modes append:64:1 --settle 0 | grep -v filesystem
    for j in "fp32=--dtype fp32" "default="; do
      python3 bench/ab_trees.py --tree new=. --clean "$out" --clean "$out.crc32.json" --repeat 1 --settle "$s" \
        --job "consolidate ${j%%=*} warm, settled=consolidate $ck $out ${j#*=} --no-progress $*" | grep -v MEDIAN
    done
  done
  rm -f "$out" "$out.crc32.json"
}
