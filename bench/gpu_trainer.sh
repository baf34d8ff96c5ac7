#!/usr/bin/env bash
# Issue 39 on the lent GPU host: bench/trainer_gpu.py (an HF Trainer ZeRO-3 bf16 run of a ~1B Llama) on real
# DeepSpeed 0.19.8 and on the engine, one after the other, beside the disk probe. DeepSpeed's wheel goes to a
# folder of its own (/tmp/site-ds), on the path only for its run: `engine.run` refuses where DeepSpeed is
# importable. Extra arguments go to both runs (e.g. --steps 10 --layers 16).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DS_BUILD_OPS=0 DS_ACCELERATOR=cuda TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp}
D=${TRAINER_DIR:-$PWD/trainer-data}
pip() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
pip --target /tmp/site $(ls .whl/*.whl | grep -v deepspeed) && pip --target /tmp/site-ds .whl/deepspeed-*.whl || exit 1
{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; df -h "$PWD" | tail -1
  python3 -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)'; } 2>&1
mkdir -p "$D"
PYTHONPATH=/tmp/site:$PWD python3 bench/disk_probe.py "$D/probe" --depths 1 --json "$O/probe.json"
rm -rf "$D/probe"
for impl in ds engine; do
  rm -rf "${D:?}/$impl"; mkdir -p "$D/$impl"
  if [ $impl = ds ]; then P=/tmp/site-ds:/tmp/site:$PWD; M=(); else P=/tmp/site:$PWD; M=(-m engine.run); fi
  echo "== $impl"
  PYTHONPATH=$P timeout 280 python3 -m torch.distributed.run --standalone --nproc-per-node 1 "${M[@]}" bench/trainer_gpu.py \
    --dir "$D/$impl" --out "$O/$impl.json" "$@" > "$O/$impl.log" 2>&1
  echo "rc=$? $(du -sh "$D/$impl/out" 2>/dev/null | cut -f1) in checkpoint; $(grep -iE -m3 'error|Traceback' "$O/$impl.log")"
  rm -rf "${D:?}/$impl"
done
PYTHONPATH=/tmp/site:$PWD python3 bench/trainer_gpu.py --report "$O/ds.json" "$O/engine.json"
