"""Check every grader: the minillm reference must earn full marks and the untouched stub exactly zero.

`python -m exercises.selfcheck` prints one line per exercise and exits non-zero on any failure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from exercises import find_exercises, stub_file
from exercises.grade import TestResult, run_grader, score


def _problems(reference: list[TestResult], stub: list[TestResult]) -> list[str]:
    """A line per test that fails the reference, or that the untouched stub fails other than by NotImplementedError
    (a test passing with the stub never called the student's code; one failing otherwise hides a grader bug)."""
    return ([f"    {r.name}: reference fails: {r.reason}" for r in reference if not r.passed]
            + [f"    {r.name}: passes with the untouched stub" for r in stub if r.passed]
            + [f"    {r.name}: stub fails other than by NotImplementedError: {r.reason}"
               for r in stub if not r.passed and "NotImplementedError" not in r.reason])


def check(directory: Path) -> tuple[bool, str]:
    """Grade the reference and the untouched stub of one exercise; (ok, report lines)."""
    start = time.perf_counter()
    try:
        stub_file(directory)
        ref, stub = run_grader(directory, "reference"), run_grader(directory, "stub")
    except RuntimeError as e:  # a GraderError, or no single stub file
        return False, f"{directory.name}: FAIL  grader error: {e}"
    (ref_earned, total), (stub_earned, _) = score(ref), score(stub)
    problems = _problems(ref, stub)
    ok = ref_earned == total and stub_earned == 0 and not problems
    line = (f"{directory.name}: {'ok' if ok else 'FAIL'}  reference {ref_earned:g}/{total:g}, "
            f"stub {stub_earned:g}/{total:g}, {len(ref)} tests, {time.perf_counter() - start:.1f} s")
    return ok, "\n".join([line, *problems])


def main() -> int:
    exercises = find_exercises()
    if not exercises:
        print("selfcheck: no exercises found", file=sys.stderr)
        return 1
    failed = 0
    for directory in exercises.values():
        ok, report = check(directory)
        print(report, flush=True)
        failed += not ok
    print(f"selfcheck: {len(exercises) - failed}/{len(exercises)} exercises ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
