"""A submission that runs a shipped solution by its file earns nothing, whichever way it opens the file and
whenever it does: beyond selfcheck's importlib, runpy and exec at load, an old-style loader, a symbolic link, and
a read inside a graded call each fail every test as not the student's own code."""

from pathlib import Path

import pytest

from exercises.grade import run_grader
from exercises.own_code import MARK

EXERCISE = Path(__file__).resolve().parents[1] / "exercises" / "ch09_routing"
SOLUTION = EXERCISE / "solution" / "routing.py"

LOADER = '''
import importlib.machinery

answer = importlib.machinery.SourceFileLoader("answer", {path!r}).load_module()
globals().update((k, v) for k, v in vars(answer).items() if not k.startswith("__"))
'''

LINKED = '''
import os
import tempfile

link = os.path.join(tempfile.mkdtemp(), "routing.py")
os.symlink({path!r}, link)
exec(open(link).read())
'''

AT_CALL = '''
def _answer(name):
    names = {{"__name__": __name__}}
    exec(open({path!r}).read(), names)
    return names[name]


def prefix_block_hashes(token_ids, block_size):
    return _answer("prefix_block_hashes")(token_ids, block_size)


class PrefixAffinity:
    def __new__(cls, *args, **kwargs):
        return _answer("PrefixAffinity")(*args, **kwargs)
'''


@pytest.mark.parametrize("source", [LOADER, LINKED, AT_CALL], ids=["source-file-loader", "symlink", "read-at-call"])
def test_grader_refuses_the_solution_run_by_its_path(tmp_path, source):
    submission = tmp_path / "routing.py"
    submission.write_text(source.format(path=str(SOLUTION)))
    results = run_grader(EXERCISE, str(submission))
    assert results and all(not r.passed and MARK in r.reason for r in results), [(r.name, r.reason) for r in results]
