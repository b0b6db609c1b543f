#!/usr/bin/env bash
# Validate shardline on a lent GPU machine in one call (bench/gpu/validate.py has the stages):
#
#   bash bench/gpu/prepare.sh                 # here, once, with the registry: the wheels the GPU image lacks
#   bash bench/gpu/validate.sh                # there: results under $OUT (the device tool's), else bench/out/gpu
#   bash bench/gpu/validate.sh --dry-run      # here or in CI: every stage's CPU-side logic, no GPU
#
# It runs from this source tree on the machine's own python and torch (no pip resolve: the GPU machine reaches
# no registry): the carried wheels (bench/gpu/carry/, from prepare.sh) are installed into a scratch folder with
# --no-index --no-deps, and `shardline` is importable through a scratch folder whose shardline/ links to this
# tree's plugins/, profiling/ and recipes/ (the mapping pyproject.toml gives an install). The Kineto scanner's
# C extension is not built there: the profiler's pure-Python path reads the traces (the same results).
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$repo/bench/out/gpu}"
python="${PYTHON:-python3}"
mkdir -p "$out"
scratch="$(mktemp -d /tmp/shardline-validate-XXXXXX)"
export SHARDLINE_VALIDATE_SCRATCH="$scratch"
mkdir -p "$scratch/src/shardline" "$scratch/site"
for part in plugins profiling recipes; do ln -s "$repo/$part" "$scratch/src/shardline/$part"; done
if [ "${1:-}" != "--dry-run" ] && compgen -G "$repo/bench/gpu/carry/*.whl" > /dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$scratch/site" \
    "$repo"/bench/gpu/carry/*.whl || { echo "validate: installing the carried wheels failed" >&2; exit 1; }
fi
export PYTHONPATH="$scratch/src:$scratch/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# torch.cuda.is_available() through NVML: a parent that asks it must not initialise CUDA before forking its ranks
export SHARDLINE_KINETO_NATIVE=0 TOKENIZERS_PARALLELISM=false PYTORCH_NVML_BASED_CUDA_CHECK=1
cd "$repo" || exit 1
"$python" bench/gpu/validate.py --out "$out" "$@" 2>&1 | tee "$out/validate.log"
status=${PIPESTATUS[0]}
[ -n "${SHARDLINE_VALIDATE_KEEP:-}" ] || rm -rf "$scratch"
exit "$status"
