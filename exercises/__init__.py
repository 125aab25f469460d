"""Graded exercises: each `chNN_name/` holds a student stub, `reference.py` and point-carrying grader tests.

Run `make grade CH=NN` (or `python -m exercises.grade NN`) to grade your stub; `python -m exercises.selfcheck`
checks every grader against the `minillm` reference (full marks), the untouched stub and code that is not
the student's handed in as a submission (zero).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent
IMPL_ENV = "MINILLM_EXERCISE_IMPL"  # "stub" (default), "reference", or a path to a .py file
REPORT_ENV = "MINILLM_EXERCISE_REPORT"  # where the points plugin writes its JSON results
NOT_STUB = {"__init__.py", "conftest.py", "reference.py", "test_grade.py"}


def find_exercises() -> dict[str, Path]:
    """Exercise directories by two-digit chapter number, found by their `chNN_` prefix."""
    found = {}
    for path in sorted(ROOT.iterdir()):
        match = re.fullmatch(r"ch(\d\d)_\w+", path.name)
        if match and path.is_dir():
            if match.group(1) in found:
                raise RuntimeError(f"two exercises for chapter {match.group(1)}: {found[match.group(1)].name}, {path.name}")
            found[match.group(1)] = path
    return found


def stub_file(exercise_dir: Path) -> Path:
    """The student's file: the one .py file of an exercise that is not the reference, tests or package glue."""
    stubs = [p for p in sorted(exercise_dir.glob("*.py")) if p.name not in NOT_STUB]
    if len(stubs) != 1:
        names = ", ".join(p.name for p in stubs) or "none"
        raise RuntimeError(f"{exercise_dir.name} must hold exactly one stub file besides {sorted(NOT_STUB)}; found {names}")
    return stubs[0]
