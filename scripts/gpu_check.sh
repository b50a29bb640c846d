#!/usr/bin/env bash
# GPU check: install the gpu extra, run the GPU tests, run a short benchmark, write results.
# Finishes in under 5 minutes on one GPU. Usage: bash scripts/gpu_check.sh [results.json]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results/gpu.json}"
mkdir -p "$(dirname "$out")"
python -m pip install -q -e ".[gpu,test]" 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 180 python -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15
tests_rc=${PIPESTATUS[0]}
timeout 100 python benchmarks/gpu_bench.py --out "$out" --tests-rc "$tests_rc"
echo "results in $out"
