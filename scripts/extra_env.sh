#!/usr/bin/env bash
# Chapter 9 — an environment of its own for one of the serving extras, kserve or triton: minillm's pinned stack,
# then the extra, with what the extra moves printed (a pip freeze before and after) and pip's own consistency
# check. Neither goes into the main .venv: kserve 0.21 needs protobuf<7, psutil<6 and python-dateutil<3, and
# nvidia-pytriton 0.7 needs numpy<2, older than what the stack resolves to.
#
#   scripts/extra_env.sh kserve|triton [VENV]   (default: .venv-EXTRA); then
#   PYTHONPATH=. VENV/bin/python -m pytest -q tests/test_EXTRA.py      (`make test-extras` does both, for both)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:?usage: scripts/extra_env.sh kserve|triton [VENV]}
case "$extra" in kserve|triton) ;; *) echo "unknown extra: $extra (kserve or triton)" >&2; exit 2 ;; esac
venv=${2:-.venv-$extra}
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r requirements.txt
"$venv/bin/pip" freeze | sort > "$venv/freeze-before.txt"
start=$(date +%s)
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/pip" install -q -e ".[$extra]"
echo "$extra extra installed in $(( $(date +%s) - start )) s"
"$venv/bin/pip" freeze --exclude-editable | sort > "$venv/freeze-after.txt"
echo "what the $extra extra changed (< before, > after):"
diff "$venv/freeze-before.txt" "$venv/freeze-after.txt" || true
"$venv/bin/pip" check || echo "(pip check: the mismatches above are the price of the $extra extra)"
du -sh "$venv"
