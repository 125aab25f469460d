"""Fixtures for the grader tests: `impl` is the code under test, `ref` the minillm reference.

A submission that hands in minillm's code for a graded name (see own_code.py) fails every test at setup.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from exercises import IMPL_ENV, stub_file
from exercises.own_code import graded_names, not_own_code


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


@pytest.fixture(scope="module")
def impl(request, ref) -> ModuleType:
    """The implementation under test, chosen by $MINILLM_EXERCISE_IMPL: stub (default), reference, or a path.

    Anything but the reference must be the student's own code for every graded name.
    """
    choice = os.environ.get(IMPL_ENV, "stub")
    if choice == "reference":
        return ref
    path = stub_file(Path(request.module.__file__).parent) if choice == "stub" else Path(choice)
    module = _load(path, "_exercise_impl")
    if problem := not_own_code(module, path.read_text(), ref):
        pytest.fail(problem, pytrace=False)
    return module
