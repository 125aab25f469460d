#!/usr/bin/env bash
# The one GPU check: environment, the test suite on CUDA (tiny random models against transformers, Triton
# kernels against PyTorch references), decode timings of a SmolLM2-shaped model with random weights (the
# real weights do not travel), and the attention benchmark (our kernels vs SDPA vs naive).
# Usage: bash scripts/gpu_check.sh [output dir]   (default: $OUT, else _build/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-_build/gpu_check}}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
status=0

"$py" scripts/gpu_timing.py --env-only 2>&1 | tee "$out/env.txt" || status=1
"$py" -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$py" scripts/gpu_timing.py 2>&1 | tee "$out/timing.txt" || status=1
"$py" benchmarks/attention.py 2>&1 | tee "$out/attention.txt" || status=1
"$py" benchmarks/quant_gpu.py 2>&1 | tee "$out/quant_gpu.txt" || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo ok || echo FAILED); logs in $out"
exit $status
