"""Check every grader: the minillm reference must earn full marks; the untouched stub, a re-export of minillm
and a copy of reference.py must earn exactly zero; and where an exercise keeps a solution written from its
stub alone (`solution/<stub name>`), that solution must earn full marks too, which proves the stub's
signatures and docstrings say everything the grader checks, while a submission importing it earns zero.

`python -m exercises.selfcheck` prints one line per exercise (two exercises are checked at a time) and exits
non-zero on any failure.
"""

from __future__ import annotations

import ast
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from exercises import find_exercises, stub_file
from exercises.grade import TestResult, run_grader, score
from exercises.own_code import MARK, is_minillm


def reexport_source(reference: Path) -> str:
    """A submission that imports from minillm exactly the names reference.py exports from minillm."""
    tree = ast.parse(reference.read_text())
    exported = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    imports = [ast.ImportFrom(node.module, [a for a in node.names if (a.asname or a.name) in exported], 0)
               for node in tree.body if isinstance(node, ast.ImportFrom) and is_minillm(node.module)]
    return "".join(ast.unparse(node) + "\n" for node in imports if node.names)


def _problems(reference: list[TestResult], stub: list[TestResult], cheats: dict[str, list[TestResult]]) -> list[str]:
    """A line per test that fails the reference; that the untouched stub passes or fails other than by
    NotImplementedError (then it never called the student's code, or hides a grader bug); or that a submission
    of minillm's own code passes or fails without saying it is not the student's own code."""
    lines = ([f"    {r.name}: reference fails: {r.reason}" for r in reference if not r.passed]
             + [f"    {r.name}: passes with the untouched stub" for r in stub if r.passed]
             + [f"    {r.name}: stub fails other than by NotImplementedError: {r.reason}"
                for r in stub if not r.passed and "NotImplementedError" not in r.reason])
    for what, results in cheats.items():
        lines += ([f"    {r.name}: passes with a {what}" for r in results if r.passed]
                  + [f"    {r.name}: a {what} fails other than as {MARK!r}: {r.reason}"
                     for r in results if not r.passed and MARK not in r.reason])
    return lines


def _grade_cheats(directory: Path, stub: Path) -> dict[str, list[TestResult]]:
    """Grade submissions of code that is not the student's: a re-export of minillm's names, reference.py copied,
    and an import of the solution the exercise ships, if any."""
    reference, solution = directory / "reference.py", directory / "solution" / stub.name
    with tempfile.TemporaryDirectory() as tmp:
        reexport, copy = Path(tmp) / "reexport.py", Path(tmp) / "reference_copy.py"
        reexport.write_text(reexport_source(reference))
        copy.write_text(reference.read_text())
        cheats = {"re-export": run_grader(directory, str(reexport)), "reference copy": run_grader(directory, str(copy))}
        if solution.is_file():
            imported = Path(tmp) / "solution_import.py"
            imported.write_text(f"from exercises.{directory.name}.solution.{solution.stem} import *\n")
            cheats["solution import"] = run_grader(directory, str(imported))
        return cheats


def _grade_solution(directory: Path, stub: Path) -> list[TestResult] | None:
    """Grade the exercise's solution written from the stub alone, if it keeps one; None if it does not."""
    solution = directory / "solution" / stub.name
    return run_grader(directory, str(solution)) if solution.is_file() else None


def check(directory: Path) -> tuple[bool, str]:
    """Grade the reference, the untouched stub, minillm's code handed in as a submission and the solution
    written from the stub, if any; (ok, report lines)."""
    start = time.perf_counter()
    try:
        stub_path = stub_file(directory)
        ref, stub = run_grader(directory, "reference"), run_grader(directory, "stub")
        cheats = _grade_cheats(directory, stub_path)
        solution = _grade_solution(directory, stub_path)
    except RuntimeError as e:  # a GraderError, or no single stub file
        return False, f"{directory.name}: FAIL  grader error: {e}"
    (ref_earned, total), (stub_earned, _) = score(ref), score(stub)
    cheat_earned = {what: score(results)[0] for what, results in cheats.items()}
    problems = _problems(ref, stub, cheats)
    if solution is not None:
        problems += [f"    {r.name}: the solution from the stub fails: {r.reason}" for r in solution if not r.passed]
    ok = ref_earned == total and stub_earned == 0 and not any(cheat_earned.values()) and not problems
    line = (f"{directory.name}: {'ok' if ok else 'FAIL'}  reference {ref_earned:g}/{total:g}, "
            + (f"solution from the stub {score(solution)[0]:g}/{total:g}, " if solution is not None else "")
            + f"stub {stub_earned:g}/{total:g}, "
            + "".join(f"{what} {earned:g}/{total:g}, " for what, earned in cheat_earned.items())
            + f"{len(ref)} tests, {time.perf_counter() - start:.1f} s")
    return ok, "\n".join([line, *problems])


def main() -> int:
    exercises = find_exercises()
    if not exercises:
        print("selfcheck: no exercises found", file=sys.stderr)
        return 1
    failed = 0
    # the graders run in subprocesses that mostly import and wait, so two at a time fill two cores
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        for ok, report in pool.map(check, exercises.values()):
            print(report, flush=True)
            failed += not ok
    print(f"selfcheck: {len(exercises) - failed}/{len(exercises)} exercises ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
