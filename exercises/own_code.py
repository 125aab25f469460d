"""Refuse a submission that hands in minillm's code as its own, so that re-exporting the answer earns nothing.

Each reference.py lists `GRADED`, the names the grader checks; the rest of its `__all__` is given to the
student. A submission fails every test when a graded name comes from minillm (is minillm's object, a subclass
of one, a wrapper around one, or runs code from a minillm file), or when anything in it uses the minillm
modules that reference.py takes its code from, other than the given names. The check reads the loaded
module and its source; it never patches minillm, so a grader can still run minillm's code beside the
student's (chapter 4 drives minillm's Scheduler with the student's block manager). The solutions shipped
with the exercises (`chNN_name/solution/`) are refused the same way, by module name.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from types import FunctionType, MethodType, ModuleType

MARK = "not your own code"  # every refusal starts with it; selfcheck looks for it
MINILLM_DIR = Path(importlib.util.find_spec("minillm").origin).parent
METHODS = (FunctionType, MethodType, staticmethod, classmethod, property, functools.partial)  # class-body methods
Source = tuple[str, str]  # (minillm module, qualified name in it; "" for the module itself)


def is_minillm(name: object) -> bool:
    """Whether `name` is the dotted name of minillm or of something inside it."""
    return isinstance(name, str) and (name == "minillm" or name.startswith("minillm."))


def is_solution(name: object) -> bool:
    """Whether `name` is the dotted name of an exercise's shipped solution, or of something inside it."""
    return isinstance(name, str) and re.fullmatch(r"exercises\.ch\d\d_\w+\.solution(\..+)?", name) is not None


def off_limits(name: object) -> bool:
    """Whether `name` names code a submission may not hand in as its own: minillm's or a shipped solution's."""
    return is_minillm(name) or is_solution(name)


def graded_names(ref: ModuleType) -> list[str]:
    """The names the exercise grades: its reference's GRADED, which must be part of its __all__."""
    graded, exported = getattr(ref, "GRADED", None), getattr(ref, "__all__", None)
    if graded is None or exported is None or not set(graded) <= set(exported):
        raise RuntimeError("reference.py must define __all__ and GRADED, the names of __all__ that are graded")
    return list(graded)


def given_objects(ref: ModuleType) -> tuple[object, ...]:
    """The objects the student may take from minillm: the reference's exports that are not graded."""
    graded = graded_names(ref)
    return tuple(getattr(ref, name) for name in ref.__all__ if name not in graded)


def _code_source(code) -> Source | None:
    """The minillm module a code object was compiled from, found by its file."""
    path = Path(code.co_filename).resolve()
    if not path.is_relative_to(MINILLM_DIR):
        return None
    parts = ("minillm", *path.relative_to(MINILLM_DIR).with_suffix("").parts)
    return ".".join(p for p in parts if p != "__init__"), code.co_qualname


def minillm_source(obj: object, allowed: tuple[object, ...] = (), _seen: set[int] | None = None) -> Source | None:
    """Where in minillm `obj` comes from: itself, what it wraps, a base class or a method; None if nowhere.

    Objects in `allowed` (the given names) count as the student's own, and so do classes built on them.
    """
    seen = set() if _seen is None else _seen
    if id(obj) in seen or any(obj is a for a in allowed):
        return None
    seen.add(id(obj))

    def inner(*objs: object) -> Source | None:
        return next((s for o in objs if o is not None and (s := minillm_source(o, allowed, seen))), None)

    if isinstance(obj, ModuleType):
        return (obj.__name__, "") if off_limits(obj.__name__) else None
    if isinstance(obj, functools.partial):
        return inner(obj.func)
    if isinstance(obj, (MethodType, staticmethod, classmethod)):
        return inner(obj.__func__)
    if isinstance(obj, property):
        return inner(obj.fget, obj.fset, obj.fdel)
    if isinstance(obj, type):
        for cls in obj.__mro__[:-1]:  # every class but `object`
            if any(cls is a for a in allowed):
                continue
            if off_limits(cls.__module__):
                return cls.__module__, cls.__qualname__
            if found := inner(*(v for v in vars(cls).values() if isinstance(v, METHODS))):
                return found
        return None
    if isinstance(obj, FunctionType):
        if off_limits(obj.__module__):
            return obj.__module__, obj.__qualname__
        if found := _code_source(obj.__code__):
            return found
    wrapped = getattr(obj, "__wrapped__", None) if callable(obj) else None
    return inner(wrapped)


def rebuilt_modules(ref: ModuleType) -> set[str]:
    """The minillm modules the exercise rebuilds: those its reference.py takes objects from."""
    return {src[0] for value in vars(ref).values() if (src := minillm_source(value))}


def _named(source: str) -> Iterator[tuple[int, str]]:
    """(line, dotted minillm name) for each import of minillm, each attribute read on an imported name, and
    each string that is a dotted minillm name."""
    tree = ast.parse(source)
    aliases = {}  # local name -> the dotted minillm name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in (a for a in node.names if off_limits(a.name)):
                yield node.lineno, a.name
                bound = a.name if a.asname else a.name.split(".")[0]  # `import minillm.x` binds `minillm`
                aliases[a.asname or bound] = bound
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                full = node.module if a.name == "*" else f"{node.module}.{a.name}"
                if off_limits(full):  # `from exercises.chNN_x import solution` too
                    yield node.lineno, full
                    aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and off_limits(node.value) and all(
                part.isidentifier() for part in node.value.split(".")):  # importlib.import_module("minillm.x")
            yield node.lineno, node.value
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in aliases:
            yield node.lineno, ".".join([aliases[node.id], *reversed(chain)])


def _resolve(dotted: str) -> object | None:
    """The object a dotted minillm name stands for (importing submodules on the way), or None."""
    parts = dotted.split(".")
    try:
        obj = importlib.import_module(parts[0])
        for i in range(1, len(parts)):
            try:
                obj = getattr(obj, parts[i])
            except AttributeError:
                if not isinstance(obj, ModuleType):
                    return None
                obj = importlib.import_module(".".join(parts[: i + 1]))
    except (ImportError, AttributeError):
        return None
    return obj


def _problems(module: ModuleType, source: str, ref: ModuleType) -> Iterator[str]:
    """Each way the submission uses minillm's code: graded names first, then its source, then its other names."""
    graded, given, rebuilt = graded_names(ref), given_objects(ref), rebuilt_modules(ref)
    for name in graded:
        if hasattr(module, name) and (src := minillm_source(getattr(module, name), given)):
            yield f"`{name}` comes from {_dotted(src)}"
    for line, dotted in _named(source):
        if (src := minillm_source(_resolve(dotted), given)) and (src[0] in rebuilt or is_solution(src[0])):
            yield f"line {line} uses {dotted}"
    for name, value in vars(module).items():
        if not name.startswith("__") and (src := minillm_source(value, given)) and (
                src[0] in rebuilt or is_solution(src[0])):
            yield f"`{name}` comes from {_dotted(src)}"


def _dotted(src: Source) -> str:
    return ".".join(filter(None, src))


def not_own_code(module: ModuleType, source: str, ref: ModuleType) -> str | None:
    """The first way the submission hands in minillm's code for what is graded, as a one-line reason; or None."""
    problem = next(_problems(module, source, ref), None)
    return f"{MARK}: {problem}" if problem else None
