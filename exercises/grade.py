"""Grade an exercise: `python -m exercises.grade NN [--impl stub|reference|PATH]`.

Runs the chapter's grader tests in a fresh pytest subprocess (so each run imports the implementation
anew and a crashing or hanging solution cannot take the grader down), then prints points per test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from exercises import IMPL_ENV, REPORT_ENV, ROOT, find_exercises, stub_file

TIMEOUT_S = 600
REASON_WIDTH = 100


class GraderError(RuntimeError):
    """The grader itself could not run (a broken test file, a missing points marker, a timeout)."""


@dataclass
class TestResult:
    name: str
    points: float
    passed: bool
    reason: str

    @property
    def earned(self) -> float:
        return self.points if self.passed else 0


def run_grader(exercise_dir: Path, impl: str = "stub") -> list[TestResult]:
    """Run one exercise's grader tests against `impl` ("stub", "reference" or a file path)."""
    if impl not in ("stub", "reference"):
        impl = str(Path(impl).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, **{IMPL_ENV: impl, REPORT_ENV: str(report), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT.parent), env.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "pytest", str(exercise_dir), "-c", str(ROOT / "pytest.ini"),
               "--rootdir", str(ROOT), "-p", "exercises.points", "-q", "--tb=no", "--no-header"]
        try:
            proc = subprocess.run(cmd, cwd=ROOT.parent, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise GraderError(f"grading took over {TIMEOUT_S} s (an infinite loop?)") from None
        if not report.exists():
            raise GraderError(f"pytest wrote no results\n{proc.stdout}{proc.stderr}")
        data = json.loads(report.read_text())
    if data["errors"] or not data["tests"]:
        raise GraderError("; ".join(data["errors"]) or "no grader tests collected")
    return [TestResult(**t) for t in data["tests"]]


def score(results: list[TestResult]) -> tuple[float, float]:
    """(points earned, points possible)."""
    return sum(r.earned for r in results), sum(r.points for r in results)


def _num(x: float) -> str:
    return f"{x:g}"


def format_table(results: list[TestResult]) -> str:
    """One row per test: name, earned/possible, PASS or FAIL with a one-line reason; then the score."""
    width = max(len("test"), *(len(r.name) for r in results))
    rows = [f"{'test':<{width}}  {'points':>6}  result", f"{'-' * width}  {'-' * 6}  {'-' * 6}"]
    for r in results:
        reason = r.reason if len(r.reason) <= REASON_WIDTH else r.reason[: REASON_WIDTH - 1] + "…"
        verdict = "PASS" if r.passed else f"FAIL  {reason}"
        rows.append(f"{r.name:<{width}}  {_num(r.earned) + '/' + _num(r.points):>6}  {verdict}")
    earned, possible = score(results)
    rows.append(f"\nscore: {_num(earned)}/{_num(possible)}")
    return "\n".join(rows)


def resolve_chapter(arg: str) -> Path:
    """The exercise directory for a chapter argument like "00", "0" or "ch00"; a clear error otherwise."""
    exercises = find_exercises()
    digits = arg.lower().removeprefix("ch").split("_")[0]
    key = f"{int(digits):02d}" if digits.isdigit() else arg
    if key not in exercises:
        raise ValueError(f"no exercise for chapter {arg!r}; available: {available()}")
    return exercises[key]


def available() -> str:
    return ", ".join(f"{n} ({d.name})" for n, d in find_exercises().items()) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exercises.grade", description=__doc__.splitlines()[0])
    parser.add_argument("chapter", nargs="?", help="chapter number, e.g. 00")
    parser.add_argument("--impl", default="stub",
                        help="what to grade: stub (your file, the default), reference, or a path to a .py file")
    args = parser.parse_args(argv)
    if args.chapter is None:
        parser.error(f"give a chapter number; available: {available()}")
    try:
        exercise_dir = resolve_chapter(args.chapter)
    except ValueError as e:
        parser.error(str(e))  # exits with status 2
    target = {"stub": stub_file(exercise_dir), "reference": exercise_dir / "reference.py"}.get(args.impl)
    shown = os.path.relpath(target) if target else args.impl
    print(f"grading {shown} with {os.path.relpath(exercise_dir / 'test_grade.py')}\n")
    try:
        results = run_grader(exercise_dir, args.impl)
    except GraderError as e:
        print(f"grader error: {e}", file=sys.stderr)
        return 1
    print(format_table(results))
    return 0  # a grade, not a check: failing tests still exit 0


if __name__ == "__main__":
    sys.exit(main())
