# Sourced on the GPU host, in the checkout's root: unpack the SGLang (and nixl) bundle and the
# prepared folder, and export what the GPU suite and benchmarks/sglang_gpu.py need.
#   source tests/gpu/setup.sh   (carry .sglbundle and .gpucarry; docs/pages/development.md)
SITE=${ACTORSERVE_GPU_SITE:-/tmp/site}
CARRY=${ACTORSERVE_GPU_CARRY:-.gpucarry}
if [ ! -d "$SITE/sglang" ]; then
  mkdir -p "$SITE"
  tar xJf .sglbundle/sglang-site.tar.xz -C "$SITE"
fi
if [ -f .sglbundle/nixl-site.tar.xz ] && [ ! -d "$SITE/nixl" ]; then
  tar xJf .sglbundle/nixl-site.tar.xz -C "$SITE"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$CARRY"/wheels/*.whl
if [ ! -f "$CARRY/model/tokenizer.json" ]; then
  python3 -c 'import lzma, sys; open(sys.argv[1][:-3], "wb").write(lzma.open(sys.argv[1]).read())' \
    "$CARRY/model/tokenizer.json.xz"
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
export ACTORSERVE_GPU_MODEL="$PWD/$CARRY/model"
# The GPU hosts keep NVLink multicast off; so do the engines' NCCL groups.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import sglang; print("sglang", sglang.__version__)'
