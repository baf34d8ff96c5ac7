# Sourced by the bench/gpu_*.sh scripts: the lent GPU machine's environment. NVLink multicast off (the device
# notes say why), DeepSpeed without compiled ops, and the wheels the GPU image lacks (DeepSpeed 0.19.8 built
# with DS_BUILD_OPS=0, pydantic, pytest, typer...) installed once from .whl/ into /tmp/site.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export DS_BUILD_OPS=0 DS_ACCELERATOR=cuda  # the wheel is built on a machine without CUDA (it records "cpu")
if [ -d .whl ] && [ ! -d /tmp/site/deepspeed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$PWD; else export PYTHONPATH=$PWD; fi
export PATH=/tmp/site/bin:$PATH AWS_EC2_METADATA_DISABLED=true

# scale_dir SIZE: set D to the folder of one model size's save (SCALE_DIR, default /var/tmp/sd-SIZE) and make
# it, removing the other sizes' (the 64 GB disk holds one); prints the date and the filesystem.
scale_dir() {
  D=${SCALE_DIR:-/var/tmp/sd-$1}
  for o in /var/tmp/sd /var/tmp/sd-*; do [ "$o" = "$D" ] || rm -rf "$o"; done
  date -u; findmnt -T /var/tmp -o SOURCE,FSTYPE,OPTIONS 2>/dev/null || df -T /var/tmp
  mkdir -p "$D"
}
