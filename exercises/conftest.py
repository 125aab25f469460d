"""Fixtures for the grader tests: `impl` is the code under test, `ref` the minillm reference."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

from exercises import IMPL_ENV, stub_file


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
    """The reference: the minillm functions the exercise asks the student to rebuild."""
    return _load(Path(request.module.__file__).parent / "reference.py", "_exercise_reference")


@pytest.fixture(scope="module")
def impl(request, ref) -> ModuleType:
    """The implementation under test, chosen by $MINILLM_EXERCISE_IMPL: stub (default), reference, or a path."""
    choice = os.environ.get(IMPL_ENV, "stub")
    if choice == "reference":
        return ref
    path = stub_file(Path(request.module.__file__).parent) if choice == "stub" else Path(choice)
    return _load(path, "_exercise_impl")
