#!/usr/bin/env bash
# Chapter 9 — an environment of its own for KServe: minillm's pinned stack, then the `kserve` extra, with what the
# extra moves printed (a pip freeze before and after) and pip's own consistency check. KServe does not go into
# the main .venv: it needs protobuf<7, psutil<6 and python-dateutil<3, older than what the stack resolves to.
#
#   scripts/kserve_env.sh [VENV]   (default: .venv-kserve); then
#   PYTHONPATH=. VENV/bin/python -m pytest -q tests/test_kserve.py
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-kserve}
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r requirements.txt
"$venv/bin/pip" freeze | sort > "$venv/freeze-before.txt"
start=$(date +%s)
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/pip" install -q -e ".[kserve]"
echo "kserve extra installed in $(( $(date +%s) - start )) s"
"$venv/bin/pip" freeze --exclude-editable | sort > "$venv/freeze-after.txt"
echo "what the kserve extra changed (< before, > after):"
diff "$venv/freeze-before.txt" "$venv/freeze-after.txt" || true
"$venv/bin/pip" check || echo "(pip check: the mismatches above are the price of the kserve extra)"
du -sh "$venv"
