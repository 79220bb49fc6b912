#!/usr/bin/env bash
# The GPU suite on the GPU host, in the checkout's root (extra arguments go to pytest):
#   bash tests/gpu/run.sh [-k PATTERN] [tests/gpu/test_x.py ...]   (carry .sglbundle and
#   .gpucarry; see docs/pages/development.md, "The GPU suite")
# On a host of several GPUs, one pytest-xdist worker per GPU takes whole modules.
set -euo pipefail
source "$(dirname "$0")/setup.sh"
gpus=$(nvidia-smi -L | wc -l)
parallel=()
if [ "$gpus" -gt 1 ]; then
  parallel=(-n "$gpus" --dist loadfile)
fi
# The whole suite, unless the arguments name modules of it.
paths=(tests/gpu)
for arg in "$@"; do
  case $arg in tests/*) paths=() ;; esac
done
exec python3 -m pytest -p no:cacheprovider -p no:benchmark -q -rA "${parallel[@]}" \
  "${paths[@]}" "$@"
