"""The package's shape: chapter 9's service in a package of its own, and no circle among the modules' imports."""

import ast
from pathlib import Path

import minillm

ROOT = Path(minillm.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path, typing: bool = True) -> set[str]:
    """The minillm modules `path` imports while it loads (not inside a function), and with `typing` those it
    imports for type checking only."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING" and not typing:
            continue
        if isinstance(node, (ast.If, ast.Try)):
            body += node.body + getattr(node, "orelse", []) + [s for h in getattr(node, "handlers", []) for s in h.body]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if module_path(full) else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("minillm") and module_path(m)}


def module_path(name: str) -> Path | None:
    path = ROOT.parent.joinpath(*name.split("."))
    for p in (path.with_suffix(".py"), path / "__init__.py"):
        if p.exists():
            return p
    return None


def test_chapter_9_service_is_a_package():
    service = {p.stem for p in (ROOT / "service").glob("*.py")} - {"__init__"}
    assert {"ray_app", "replica", "remote_llm", "routers", "routing_policies", "gateway"} <= service
    assert not service & {p.stem for p in (ROOT / "serving").glob("*.py")}
    for p in (ROOT / "service").glob("*.py"):
        assert ast.get_docstring(ast.parse(p.read_text())).startswith("Chapter 9"), p


def test_the_core_imports_no_chapter_9_type():
    """The core (modules directly in minillm/, the command line aside) carries a prefilled request's handle without
    importing disagg/ for it; the engine's one use of disagg/ is the connector it drives."""
    for p in set(ROOT.glob("*.py")) - {ROOT / "__main__.py"}:
        outward = {m for m in top_level_imports(p) if m.split(".")[1] in ("disagg", "serving", "service")}
        assert outward <= ({"minillm.disagg.connector"} if p.stem == "engine" else set()), (p.name, outward)


def test_no_import_cycles():
    """No module needs, while it loads, a module that needs it back (type-checking imports aside)."""
    graph = {module_name(p): top_level_imports(p, typing=False) for p in ROOT.rglob("*.py")}
    cycles = []

    def visit(m, stack):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in done:
            return
        for n in sorted(graph.get(m, ())):
            visit(n, stack + [m])
        done.add(m)

    done: set[str] = set()
    for m in sorted(graph):
        visit(m, [])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
