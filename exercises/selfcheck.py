"""Check every grader: the minillm reference must earn full marks; the untouched stub and every submission of
code that is not the student's must earn exactly zero, each failing test saying "not your own code": a re-export
of minillm, a copy of reference.py, an import of reference.py (`from ... import *`, and the module with each
exported name read from it), an import of the exercise's solution if it keeps one, that solution (reference.py
where there is none) run by its path (loaded with importlib, run with runpy, its source read and exec'd), and
each file in `chNN_name/refused/` (required where reference.py declares FORBIDDEN: a submission that would earn
points by letting a barred library do the work). Where an exercise keeps a solution written from its stub alone
(`solution/<stub name>`), that solution must earn full marks too, which proves the stub's signatures and
docstrings say everything the grader checks.

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


BY_PATH = {  # submissions that run the shipped answer at {path} by its file and keep every name it defines
    "by spec": ("import importlib.util\nimport sys\n\n"
                "spec = importlib.util.spec_from_file_location('answer', {path!r})\n"
                "answer = sys.modules['answer'] = importlib.util.module_from_spec(spec)\n"
                "spec.loader.exec_module(answer)\n"
                "globals().update((k, v) for k, v in vars(answer).items() if not k.startswith('__'))\n"),
    "by runpy": ("import runpy\n\n"
                 "globals().update((k, v) for k, v in runpy.run_path({path!r}).items() if not k.startswith('__'))\n"),
    "by exec": "exec(open({path!r}).read())\n",
}


def declared(reference: Path, name: str) -> object | None:
    """The literal value reference.py assigns to `name` at module level (`__all__`, `FORBIDDEN`), or None."""
    tree = ast.parse(reference.read_text())
    return next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)), None)


def reexport_source(reference: Path) -> str:
    """A submission that imports from minillm exactly the names reference.py exports from minillm."""
    tree, exported = ast.parse(reference.read_text()), declared(reference, "__all__")
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


def _cheat_sources(directory: Path, stub: Path) -> dict[str, str]:
    """The submissions of code that is not the student's, by name: a re-export of minillm's names, reference.py
    copied, reference.py imported (all of it, and as a module whose exported names are read), the solution the
    exercise ships imported, if any, and that solution (or reference.py) run by its path in each way of BY_PATH."""
    reference, solution = directory / "reference.py", directory / "solution" / stub.name
    module, exported = f"exercises.{directory.name}.reference", declared(reference, "__all__")
    cheats = {"re-export": reexport_source(reference), "reference copy": reference.read_text(),
              "reference import": f"from {module} import *\n",
              "reference module": f"import {module} as r\n\n" + "".join(f"{n} = r.{n}\n" for n in exported)}
    if solution.is_file():
        cheats["solution import"] = f"from exercises.{directory.name}.solution.{solution.stem} import *\n"
    answer, kind = (solution, "solution") if solution.is_file() else (reference, "reference")
    cheats.update((f"{kind} {how}", template.format(path=str(answer))) for how, template in BY_PATH.items())
    return cheats


def _grade_cheats(directory: Path, stub: Path) -> dict[str, list[TestResult]]:
    """Grade each cheat of `_cheat_sources`, then each file in `refused/`, named by its stem."""
    with tempfile.TemporaryDirectory() as tmp:
        graded = {}
        for i, (what, source) in enumerate(_cheat_sources(directory, stub).items()):
            path = Path(tmp) / f"cheat_{i}.py"
            path.write_text(source)
            graded[what] = run_grader(directory, str(path))
    for path in sorted((directory / "refused").glob("*.py")):
        graded[path.stem.replace("_", " ")] = run_grader(directory, str(path))
    return graded


def _grade_solution(directory: Path, stub: Path) -> list[TestResult] | None:
    """Grade the exercise's solution written from the stub alone, if it keeps one; None if it does not."""
    solution = directory / "solution" / stub.name
    return run_grader(directory, str(solution)) if solution.is_file() else None


def check(directory: Path) -> tuple[bool, str]:
    """Grade the reference, the untouched stub, minillm's code handed in as a submission and the solution
    written from the stub, if any; (ok, report lines)."""
    start = time.perf_counter()
    if declared(directory / "reference.py", "FORBIDDEN") and not any((directory / "refused").glob("*.py")):
        return False, f"{directory.name}: FAIL  reference.py declares FORBIDDEN, but refused/ shows no submission using it"
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
