"""Packaging: a wheel of minillm, installed into a fresh virtual environment, carries everything it reads at run time
(the C kernels' sources, the shipped text), builds and uses its C kernels, and reads no file outside itself."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tiny_models import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
COMPILER = os.environ.get("CC", "cc")

# Run by the fresh environment's python: argv = the environment, the repository, the dependencies' prefix, a
# tokenizer directory, the kernel cache. Every file opened from the first import on is recorded by an audit hook.
CHECK = r"""
import importlib, os, pkgutil, sys
from pathlib import Path

venv, repo, deps, tokenizer_dir, cache = (Path(p).resolve() for p in sys.argv[1:])
opened = []
sys.addaudithook(lambda event, args: opened.append(os.fsdecode(args[0]))
                 if event == "open" and isinstance(args[0], (str, bytes)) else None)

import torch
from transformers import AutoTokenizer

import minillm
from minillm.bench import WORKLOADS, corpus_ids, make_workload
from minillm.kernels import reference, use_cpu_kernel
from minillm.kernels.cpu import SOURCE as DECODE_SOURCE, paged_decode_attention
from minillm.kernels.int4_cpu import SOURCE as INT4_SOURCE, int4_cpu_available, int4_matmul_cpu, pack_int4_cpu
from minillm.kernels.small_ops import SOURCE as SMALL_SOURCE, small_ops_available
from minillm.quant_formats import dequantize_int4, quantize_int4

# the installed copy, with no trace of the repository's editable install
package = Path(minillm.__file__).resolve().parent
assert package.is_relative_to(venv), f"minillm imported from {package}, not from {venv}"
assert str(repo) not in sys.path, sys.path
assert not any("editable" in repr(finder) for finder in sys.meta_path), sys.meta_path

# the C sources ship beside the kernels, compile into the cache, and are chosen and correct
for source in (DECODE_SOURCE, INT4_SOURCE, SMALL_SOURCE):
    assert source.parent == package / "kernels" and source.is_file(), source
assert use_cpu_kernel("cpu", torch.float32), "the C decode kernel did not build"
assert int4_cpu_available(), "the C int4 kernel did not build"
assert small_ops_available(), "the C small operations did not build"
built = {lib.name.rsplit("_", 1)[0] for lib in (cache / "kernels").glob("*.so")}
assert built == {"paged_decode", "int4_matmul", "small_ops"}, built

gen = torch.Generator().manual_seed(0)
q = torch.randn(2, 4, 16, generator=gen)
k_cache, v_cache = torch.randn(2, 3, 4, 2, 16, generator=gen)
tables, lens = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32), torch.tensor([5, 3], dtype=torch.int32)
expected = reference.flash_attn_with_kvcache(q[:, None], k_cache, v_cache, lens, tables, softmax_scale=0.25)[:, 0]
torch.testing.assert_close(paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25), expected)

w, x = torch.randn(32, 64, generator=gen), torch.randn(3, 64, generator=gen)
codes, scale, zero = quantize_int4(w, 32)
expected = x @ dequantize_int4(codes, scale, zero).T
error = (int4_matmul_cpu(x, pack_int4_cpu(codes, scale, zero, 32)) - expected).norm() / expected.norm()
assert error < 1e-2, f"int4 product off by {error:.2%}"  # x is rounded to int8 inside: about 0.5 %

# the benchmark corpus comes from inside the package
tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
assert len(corpus_ids(tokenizer)) > WORKLOADS["rag"][0][1]
assert len(make_workload("rag", 4, tokenizer)) == 4

# every module imports (those whose optional dependencies are missing here aside)
for module in pkgutil.walk_packages(minillm.__path__, "minillm."):
    if not module.name.endswith("__main__"):
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as e:
            if (e.name or "").startswith("minillm"):
                raise

outside = sorted({p for p in map(lambda p: Path(os.path.abspath(p)).resolve(), opened)
                  if p.is_relative_to(repo) and not p.is_relative_to(deps)})
assert not outside, f"read outside the package: {outside}"
print(f"checked {len(opened)} opened files")
"""


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd`, failing the test with its output when it fails."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{done.stdout}\n{done.stderr}"
    return done


def build_wheel(tmp: Path) -> Path:
    """A wheel built offline from a copy of the project's packaging inputs (so no build/ lands in the repository)."""
    src = tmp / "src"
    shutil.copytree(ROOT / "minillm", src / "minillm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--disable-pip-version-check", "-q", "--wheel-dir", tmp / "dist", src])
    (wheel,) = (tmp / "dist").glob("minillm-*.whl")
    return wheel


def fresh_venv(venv: Path, wheel: Path) -> Path:
    """A new environment from the base interpreter with `wheel` installed, and this process's site-packages (the
    user's and the system's too) named in a .pth file: the dependencies import from there, while the .pth files
    inside them (among them the editable install of minillm) are not processed. The new environment's python."""
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", venv])
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q", wheel])
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    deps = [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages")]
    (Path(site) / "dependencies.pth").write_text("".join(f"{path}\n" for path in deps))
    return python


@pytest.mark.slow
def test_installed_wheel_builds_its_kernels_and_reads_only_itself():
    if shutil.which(COMPILER) is None:
        pytest.skip(f"no C compiler ({COMPILER}) to build the kernels with")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed: the wheel cannot be built offline")
    with tempfile.TemporaryDirectory(prefix="minillm-wheel-") as tmp:
        tmp = Path(tmp)
        wheel = build_wheel(tmp)
        names = zipfile.ZipFile(wheel).namelist()
        for data in ("minillm/kernels/paged_decode.c", "minillm/kernels/int4_matmul.c", "minillm/kernels/decode_step.c",
                     "minillm/kernels/small_ops.c", "minillm/kernels/int8_peak.c", "minillm/kernels/amx_tiles.h",
                     "minillm/data/eval_text.md"):
            assert data in names, f"{data} is not in the wheel"
        python = fresh_venv(tmp / "venv", wheel)
        build_tokenizer(tmp / "tokenizer")
        env = {k: v for k, v in os.environ.items() if k not in ("MINILLM_ATTENTION", "MINILLM_QUANT_KERNEL")}
        env |= {"MINILLM_CACHE": str(tmp / "cache"), "HF_HUB_OFFLINE": "1"}
        # -I: no PYTHON* variables, no user site, no current directory on the path
        _run([python, "-I", "-c", CHECK, tmp / "venv", ROOT, sys.prefix, tmp / "tokenizer", tmp / "cache"],
             cwd=tmp, env=env)
