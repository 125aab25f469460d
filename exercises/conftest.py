"""Fixtures for the grader tests: `impl` is the code under test, `ref` the minillm reference.

A submission that hands in minillm's code for a graded name (see own_code.py) fails every test at setup, and
one that opens a shipped solution (loads it by its path, reads its source) fails every test from then on.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from exercises import IMPL_ENV, stub_file
from exercises.own_code import graded_names, not_own_code, watch_solution_reads


def _load(path: Path, name: str) -> ModuleType:
    """Execute a .py file as a fresh module, so each grading run sees exactly that file."""
    if not path.is_file():
        raise FileNotFoundError(f"no implementation file at {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ref(request) -> ModuleType:
    """The reference: the minillm functions the exercise asks the student to rebuild (`GRADED`, of its `__all__`)."""
    module = _load(Path(request.module.__file__).parent / "reference.py", "_exercise_reference")
    graded_names(module)  # a reference without GRADED is a grader bug: fail even the reference's run
    return module


def _impl_file(request) -> Path:
    """The file $MINILLM_EXERCISE_IMPL chooses: the exercise's stub (default), its reference.py, or a path."""
    directory, choice = Path(request.module.__file__).parent, os.environ.get(IMPL_ENV, "stub")
    if choice == "stub":
        return stub_file(directory)
    return directory / "reference.py" if choice == "reference" else Path(choice)


def _fail_on(problem: str | None) -> None:
    """Fail the test, with no traceback, when the submission is not the student's own code."""
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="module")
def solution_reads(request) -> Callable[[], str | None]:
    """Watches, from before the submission loads, for a shipped solution opened by anything but the graded file."""
    return watch_solution_reads(_impl_file(request).resolve())


@pytest.fixture(scope="module")
def impl(request, ref, solution_reads) -> ModuleType:
    """The implementation under test, chosen by $MINILLM_EXERCISE_IMPL: stub (default), reference, or a path.

    Anything but the reference must be the student's own code for every graded name.
    """
    if os.environ.get(IMPL_ENV, "stub") == "reference":
        return ref
    path = _impl_file(request)
    module = _load(path, "_exercise_impl")
    _fail_on(not_own_code(module, path.read_text(), ref) or solution_reads())
    return module


@pytest.fixture(autouse=True)
def no_solution_read(solution_reads) -> Iterator[None]:
    """Fail each test, before it runs and after, once a shipped solution was opened, even inside a graded call."""
    _fail_on(solution_reads())
    yield
    _fail_on(solution_reads())
