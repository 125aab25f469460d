#!/usr/bin/env bash
# `make test-portable`: the notebook checks as another machine would see them, on this one.
#  1. another instruction set: PyTorch's kernels (ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA) and
#     minillm's C kernels (MINILLM_CPU_MARCH) held to AVX2 where this CPU has AVX-512. Where AVX2 is already
#     this CPU's best, the same settings change nothing, and the script says so.
#  2. a busy neighbour: a process spinning on one core for the whole run (as a laptop's browser would),
#     started and stopped here, with the chapters run one at a time beside it.
# Usage: bash scripts/test_portable.sh "SHARED CHAPTERS" "ALONE CHAPTERS"   (the Makefile passes its lists)
set -euo pipefail
cd "$(dirname "$0")/.."
shared=($1)
alone=($2)
py=.venv/bin/python
nbval=("$py" -m pytest -q --nbval --nbval-sanitize-with .ci/nbval_sanitize.cfg -p no:cacheprovider)
status=0

native=$("$py" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
echo "== 1. instruction set held to AVX2 (this CPU's best, as PyTorch sees it: $native)"
[ "$native" = "AVX2" ] && echo "   AVX2 is this CPU's best already: this pass runs what a plain 'make test' runs"
start=$SECONDS
isa=(env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MINILLM_CPU_MARCH=x86-64-v3)
"${isa[@]}" "$py" -c "import torch; print('   PyTorch now dispatches to', torch.backends.cpu.get_cpu_capability())"
# (an empty list runs nothing: pytest given no file would run its testpaths, the whole of tests/)
[ ${#shared[@]} -eq 0 ] || "${isa[@]}" "${nbval[@]}" -n 2 --dist loadfile "${shared[@]}" || status=1
[ ${#alone[@]} -eq 0 ] || "${isa[@]}" "${nbval[@]}" "${alone[@]}" || status=1
echo "== 1. done in $((SECONDS - start)) s"

echo "== 2. a busy neighbour on one core"
start=$SECONDS
"$py" -c "while True: pass" &
neighbour=$!
trap 'kill $neighbour 2>/dev/null || true' EXIT
"${nbval[@]}" "${shared[@]}" "${alone[@]}" || status=1
kill $neighbour
wait $neighbour 2>/dev/null || true
echo "== 2. done in $((SECONDS - start)) s"

echo "test-portable: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
