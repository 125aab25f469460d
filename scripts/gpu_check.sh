#!/usr/bin/env bash
# The one GPU check: environment, the test suite on CUDA (tiny random models against transformers, Triton
# kernels against PyTorch references), decode timings of a SmolLM2-shaped model with random weights (the
# real weights do not travel), the attention benchmark (our kernels vs SDPA vs naive), the quantized-matmul
# benchmark, and every chapter notebook executed on CUDA by scripts/run_notebook.py (no Jupyter needed).
# Chapters run in order, each in its own process under CHAPTER_TIMEOUT_S seconds (default 120) and all of them
# under CHAPTERS_BUDGET_S (default 300); chapters that load the default model are skipped, not failed, where
# its weights are absent (nothing is downloaded). Into $out/chapters go each chapter's printed output and any
# traceback (NN_name.txt), its cells' records (NN_name.json), its glued values (NN_name.glue.json), and
# summary.txt and summary.json. To run only the chapters:
#   python3 scripts/run_notebook.py --each chapters/*.ipynb --out DIR
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
chapter_s="${CHAPTER_TIMEOUT_S:-120}" chapters_s="${CHAPTERS_BUDGET_S:-300}"
timeout -k 10 "$((chapters_s + 60))" "$py" scripts/run_notebook.py --each chapters/*.ipynb --out "$out/chapters" \
  --timeout "$chapter_s" --budget "$chapters_s" 2>&1 | tee "$out/chapters.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo ok || echo FAILED); logs in $out"
exit $status
