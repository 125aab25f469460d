"""Refuse a submission that hands in code it did not write, so that re-exporting an answer earns nothing.

Each reference.py lists `GRADED`, the names the grader checks; the rest of its `__all__` is given to the
student. Off limits to a submission are minillm, the answers shipped with the exercises (every
`chNN_name/reference.py` and `chNN_name/solution/`), and what reference.py names in `FORBIDDEN`, if it
does: dotted names of modules or objects that would do the exercise's work, each barring itself and
everything defined inside it. Chapter 6 bars `gguf.quants`, so the gguf package's block decoders are refused
by whatever name reaches them (`gguf.quants.dequantize`, `gguf.dequantize`, `gguf.quants.Q4_1`), while the
rest of gguf (`gguf.GGMLQuantizationType`) stays usable. Only the submission is barred: a grader may call
them to check it.

A submission fails every test when a graded name comes from code off limits (is such an object, a subclass of
one, a wrapper around one, or runs code from a minillm file or a reference.py), or when anything in it reaches
a shipped answer, a FORBIDDEN name, or one of the minillm modules that reference.py takes its code from, other
than through the given names. "Anything in it" is its source (imports, attribute chains on imported names,
dotted names written as strings, inside functions too) and its module-level names. Other minillm modules stay
usable (`minillm.config`). The check reads the loaded module and its source; it never patches anything, so a
grader can still run minillm's code beside the student's (chapter 4 drives minillm's Scheduler with the
student's block manager).

A shipped solution run by its file leaves no name to read, so `watch_solution_reads` catches it as it opens
the file instead: an audit hook records each file of a `solution/` folder the process opens (to load it by its
path, run it with runpy, or read its source for exec), by its real path or as a link to one.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FunctionType, MethodType, ModuleType

MARK = "not your own code"  # every refusal starts with it; selfcheck looks for it
MINILLM_DIR = Path(importlib.util.find_spec("minillm").origin).parent
EXERCISES_DIR = Path(__file__).resolve().parent
EXERCISE = r"ch\d\d_\w+"  # an exercise's directory (and package) name
SOLUTION = rf"{EXERCISE}/solution(/.*)?"  # a shipped solution's folder or a file in it, relative to EXERCISES_DIR
METHODS = (FunctionType, MethodType, staticmethod, classmethod, property, functools.partial)  # class-body methods
Source = tuple[str, str]  # (module off limits, qualified name in it; "" for the module itself)


def is_minillm(name: object) -> bool:
    """Whether `name` is the dotted name of minillm or of something inside it."""
    return isinstance(name, str) and (name == "minillm" or name.startswith("minillm."))


def is_shipped(name: object) -> bool:
    """Whether `name` is the dotted name of an answer shipped with the exercises (a reference.py or a solution),
    or of something inside one."""
    return isinstance(name, str) and re.fullmatch(rf"exercises\.{EXERCISE}\.(solution|reference)(\..+)?", name) is not None


def within(name: object, prefixes: tuple[str, ...]) -> bool:
    """Whether the dotted `name` is one of `prefixes` or something inside one."""
    return isinstance(name, str) and any(name == p or name.startswith(p + ".") for p in prefixes)


def off_limits(name: object, forbidden: tuple[str, ...] = ()) -> bool:
    """Whether `name` names code a submission may not hand in as its own: minillm's, a shipped answer's, or a
    name in `forbidden` (the exercise's FORBIDDEN)."""
    return is_minillm(name) or is_shipped(name) or within(name, forbidden)


def _leads_off_limits(name: object, forbidden: tuple[str, ...]) -> bool:
    """Whether `name` is off limits or a package above such code (`gguf` above `gguf.quants`, `exercises` above
    every shipped answer), so that the names a submission reads through it must be checked."""
    return off_limits(name, forbidden) or isinstance(name, str) and (
        re.fullmatch(rf"exercises(\.{EXERCISE})?", name) is not None or any(p.startswith(name + ".") for p in forbidden))


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


def forbidden_names(ref: ModuleType) -> tuple[str, ...]:
    """The dotted names the exercise bars besides minillm and the shipped answers: its reference's FORBIDDEN."""
    return tuple(getattr(ref, "FORBIDDEN", ()))


def _code_source(code) -> Source | None:
    """The minillm module or exercise reference a code object was compiled from, found by its file (whatever
    name the file was loaded under)."""
    path = Path(code.co_filename).resolve()
    if path.is_relative_to(MINILLM_DIR):
        parts = ("minillm", *path.relative_to(MINILLM_DIR).with_suffix("").parts)
        return ".".join(p for p in parts if p != "__init__"), code.co_qualname
    if path.name == "reference.py" and path.parent.parent == EXERCISES_DIR and re.fullmatch(EXERCISE, path.parent.name):
        return f"exercises.{path.parent.name}.reference", code.co_qualname
    return None


def source_of(obj: object, forbidden: tuple[str, ...] = (), allowed: tuple[object, ...] = (),
              _seen: set[int] | None = None) -> Source | None:
    """Where off limits `obj` comes from: itself, what it wraps, a base class or a method; None if nowhere.

    Objects in `allowed` (the given names) count as the student's own, and so do classes built on them.
    """
    seen = set() if _seen is None else _seen
    if id(obj) in seen or any(obj is a for a in allowed):
        return None
    seen.add(id(obj))

    def inner(*objs: object) -> Source | None:
        return next((s for o in objs if o is not None and (s := source_of(o, forbidden, allowed, seen))), None)

    if isinstance(obj, ModuleType):
        return (obj.__name__, "") if off_limits(obj.__name__, forbidden) else None
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
            if off_limits(cls.__module__, forbidden):
                return cls.__module__, cls.__qualname__
            if found := inner(*(v for v in vars(cls).values() if isinstance(v, METHODS))):
                return found
        return None
    if isinstance(obj, FunctionType):
        if off_limits(obj.__module__, forbidden):
            return obj.__module__, obj.__qualname__
        if found := _code_source(obj.__code__):
            return found
    wrapped = getattr(obj, "__wrapped__", None) if callable(obj) else None
    return inner(wrapped)


def rebuilt_modules(ref: ModuleType) -> set[str]:
    """The minillm modules the exercise rebuilds: those its reference.py takes objects from."""
    return {src[0] for value in vars(ref).values() if (src := source_of(value)) and is_minillm(src[0])}


def _named(source: str, forbidden: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    """(line, dotted name) for each import that may lead off limits, each attribute read on a name it binds, and
    each string that is such a dotted name."""
    tree = ast.parse(source)
    aliases = {}  # local name -> the dotted name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in (a for a in node.names if _leads_off_limits(a.name, forbidden)):
                yield node.lineno, a.name
                bound = a.name if a.asname else a.name.split(".")[0]  # `import minillm.x` binds `minillm`
                aliases[a.asname or bound] = bound
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                full = node.module if a.name == "*" else f"{node.module}.{a.name}"
                if _leads_off_limits(node.module, forbidden) or _leads_off_limits(full, forbidden):
                    yield node.lineno, full  # `from exercises.chNN_x import solution`, `from gguf import x` too
                    aliases[a.asname or a.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and _leads_off_limits(node.value, forbidden) and all(
                part.isidentifier() for part in node.value.split(".")):  # importlib.import_module("minillm.x")
            yield node.lineno, node.value
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in aliases:
            yield node.lineno, ".".join([aliases[node.id], *reversed(chain)])


def _resolve(dotted: str) -> object | None:
    """The object a dotted name stands for (importing submodules on the way), or None."""
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
    """Each way the submission uses code off limits: graded names first, then its source, then its other names."""
    graded, given, forbidden, rebuilt = graded_names(ref), given_objects(ref), forbidden_names(ref), rebuilt_modules(ref)

    def barred(src: Source | None) -> bool:  # any minillm module is fine to use but those the exercise rebuilds
        return src is not None and (src[0] in rebuilt or is_shipped(src[0]) or within(src[0], forbidden))

    for name in graded:
        if hasattr(module, name) and (src := source_of(getattr(module, name), forbidden, given)):
            yield f"`{name}` comes from {_dotted(src)}"
    for line, dotted in _named(source, forbidden):
        if barred(source_of(_resolve(dotted), forbidden, given)):
            yield f"line {line} uses {dotted}"
    for name, value in vars(module).items():
        if not name.startswith("__") and barred(src := source_of(value, forbidden, given)):
            yield f"`{name}` comes from {_dotted(src)}"


def _dotted(src: Source) -> str:
    return ".".join(filter(None, src))


def not_own_code(module: ModuleType, source: str, ref: ModuleType) -> str | None:
    """The first way the submission hands in code off limits for what is graded, as a one-line reason; or None."""
    problem = next(_problems(module, source, ref), None)
    return f"{MARK}: {problem}" if problem else None


def _inode(path: str | Path) -> tuple[int, int]:
    """(device, inode) of the file at `path`: the same for every name of one file."""
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def _solution_files(own: set[str]) -> dict[tuple[int, int], str]:
    """The source files of the shipped solutions but those in `own`, named relative to the repository, by
    (device, inode) so that a link to one counts as that file."""
    files = (p for p in EXERCISES_DIR.glob("*/solution/**/*.py") if str(p) not in own
             and re.fullmatch(SOLUTION, p.relative_to(EXERCISES_DIR).as_posix()))
    return {_inode(p): p.relative_to(EXERCISES_DIR.parent).as_posix() for p in files}


def _opened_solution(path: object, files: dict[tuple[int, int], str], own: set[str]) -> str | None:
    """The shipped solution file (relative to the repository) that an opened `path` is, by its real path or as a
    link to one of `files`; None for any other file and for those in `own`. Never raises: it runs in every open."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return None  # a file descriptor, opened earlier by its name
    try:
        real = Path(os.path.realpath(os.fsdecode(path)))
        if str(real) in own:
            return None
        if real.is_relative_to(EXERCISES_DIR) and re.fullmatch(SOLUTION, real.relative_to(EXERCISES_DIR).as_posix()):
            return real.relative_to(EXERCISES_DIR.parent).as_posix()  # bytecode cached after the watch began too
        inode = _inode(real)
    except (OSError, ValueError):  # not a path, or no file there yet (one being created)
        return None
    return files.get(inode)


def watch_solution_reads(own: Path) -> Callable[[], str | None]:
    """Record from now on, with an audit hook, each shipped solution this process opens, whatever code asks:
    loading one by its path (importlib, runpy, its cached bytecode) and reading its source to exec it both open
    it. `own`, the file being graded, and its bytecode do not count. Returns the refusal once one was opened."""
    own_files = {os.path.realpath(p) for p in (own, importlib.util.cache_from_source(str(own)))}
    files, opened = _solution_files(own_files), []

    def hook(event: str, args: tuple) -> None:
        if event == "open" and (found := _opened_solution(args[0], files, own_files)):
            opened.append(found)

    sys.addaudithook(hook)
    return lambda: f"{MARK}: it opens a shipped solution, {opened[0]}" if opened else None
