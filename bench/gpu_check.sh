#!/usr/bin/env bash
# Issue 6's GPU validation, as one command for a short device lease (see bench/gpu_check.py):
#   bash bench/gpu_check.sh [OUT]          # OUT defaults to $OUT (the device tool's folder) or runs/gpu-check
# The device machine has torch and CUDA but no package registry and no optuna; nothing here needs
# either: paci-tune runs from this checkout (PYTHONPATH), the search commands are not used.
# Steps: nvidia-smi; the GPU-marked tests (tests/test_gpu.py); bench/gpu_check.py. Everything it
# prints is also kept in OUT (gpu_check.log, pytest-gpu.log), with the figures in gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
start=$(date +%s)
{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true
  "$py" -c 'import torch, click, rich, yaml, numpy, matplotlib; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$out/gpu_check.log"
# In one process (-o addopts="": not the suite's xdist workers): one GPU, and no xdist installed there.
# -v names each test as it runs and the time limit leaves gpu_check.py its turn: on 2026-12-04 a lease
# ran out inside the tests, and the log kept only dots (which test failed, and why, was lost).
timeout "${GPU_TESTS_SECONDS:-300}" "$py" -m pytest -v --tb=short -p no:cacheprovider -o addopts="" \
  tests/test_gpu.py 2>&1 | tee "$out/pytest-gpu.log"
tests=${PIPESTATUS[0]}
"$py" bench/gpu_check.py --out "$out" "${@:2}" 2>&1 | tee -a "$out/gpu_check.log"
check=${PIPESTATUS[0]}
echo "gpu tests exit $tests, gpu_check exit $check, $(( $(date +%s) - start )) s in all" | tee -a "$out/gpu_check.log"
exit $(( tests != 0 || check != 0 ))
