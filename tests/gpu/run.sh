#!/usr/bin/env bash
# The GPU suite on the GPU host, in the checkout's root (extra arguments go to pytest):
#   bash tests/gpu/run.sh [-k PATTERN]   (carry .sglbundle and .gpucarry; see
#   docs/pages/development.md, "The GPU suite")
set -euo pipefail
source "$(dirname "$0")/setup.sh"
exec python3 -m pytest -p no:cacheprovider -q -rA tests/gpu "$@"
