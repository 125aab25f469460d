"""llama.cpp and ik_llama.cpp programs built from source, once, for the benchmarks that compare minillm with them.

Both sources come from the package index, so no other network is needed: mainline llama.cpp is vendored in the
llama-cpp-python 0.3.36 sdist, ik_llama.cpp (the fork with CPU-tuned kernels) in the ik_llama_cpp_python 0.1.5
sdist. Each program is compiled at the lowest CPU priority for this machine's instruction set (`GGML_NATIVE`) and
kept under minillm's cache directory, keyed by the package and its version; every program a benchmark asks for
is built in one cmake run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from minillm.cache_dir import cache_dir

COMMON_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF")


@dataclass(frozen=True)
class Source:
    """Where one llama.cpp tree comes from: an sdist on the package index, the tree's folder inside it, and the
    cmake options that build its programs (and no more)."""

    name: str
    package: str
    version: str
    folder: str
    options: tuple[str, ...]


LLAMA_CPP = Source("llama.cpp", "llama-cpp-python", "0.3.36", "vendor/llama.cpp",
                   COMMON_OPTIONS + ("-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                                     "-DLLAMA_BUILD_EXAMPLES=OFF"))
IK_LLAMA_CPP = Source("ik_llama.cpp", "ik_llama_cpp_python", "0.1.5", "vendor/ik_llama.cpp",
                      COMMON_OPTIONS + ("-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=OFF"))


@contextlib.contextmanager
def started(cmd: Sequence[str], log: Path, low_priority: bool = False) -> Iterator[subprocess.Popen]:
    """`cmd` running with its output in `log` (nice 19 if `low_priority`); on exit, if it still runs, its whole
    process group gets SIGTERM, then SIGKILL after 30 s. Its own group keeps Ctrl-C here from reaching it first."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=(lambda: os.nice(19)) if low_priority else None)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def tail(log: Path, lines: int = 15) -> str:
    """The last lines of a log, for an error message."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def binary_path(program: str, source: Source = LLAMA_CPP) -> Path:
    """Where a built program is kept: minillm's cache, keyed by the package that vendors its source."""
    return cache_dir() / source.name / f"{source.package}-{source.version}" / program


def build(programs: Sequence[str], source: Source = LLAMA_CPP, jobs: int = 2) -> dict[str, Path]:
    """Each of `programs` from the cache, or else built (download the sdist, cmake, only those targets) at nice 19
    and cached; a RuntimeError says in one line why they could not be built."""
    paths = {program: binary_path(program, source) for program in programs}
    missing = [program for program, path in paths.items() if not path.is_file()]
    if not missing:
        return paths
    tools = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if tools:
        raise RuntimeError(f"building {source.name} needs {' and '.join(tools)}; not found on PATH")
    folder = binary_path("", source)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    log.unlink(missing_ok=True)
    print(f"building {', '.join(missing)} from {source.package} {source.version} at low priority "
          f"(minutes; log: {log})", flush=True)

    def step(what: str, cmd: Sequence[str]) -> None:
        with started(cmd, log, low_priority=True) as proc:
            if proc.wait() != 0:
                raise RuntimeError(f"{what} failed (see {log})")

    with tempfile.TemporaryDirectory(prefix=f"{source.name}-") as tmp:
        work = Path(tmp)
        step(f"downloading the {source.package} {source.version} sdist (is the package index reachable?)",
             [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"{source.package}=={source.version}", "-d", str(work)])
        with tarfile.open(next(work.glob("*.tar.gz"))) as sdist:
            inside = f"/{source.folder}/"
            sdist.extractall(work, members=[m for m in sdist if inside in m.name], filter="data")
        tree = next(work.glob(f"*/{source.folder}"))
        info = tree / "common" / "build-info.cpp"
        if not info.exists() and not (tree / "common" / "cmake" / "build-info-gen-cpp.cmake").exists():
            # the ik_llama_cpp_python sdist leaves out the script that writes this file from git; write it here
            info.write_text(f'int LLAMA_BUILD_NUMBER = 0;\n'
                            f'char const *LLAMA_COMMIT = "{source.package}-{source.version}";\n'
                            'char const *LLAMA_COMPILER = "cc";\nchar const *LLAMA_BUILD_TARGET = "native";\n')
        step(f"configuring {source.name} with cmake", ["cmake", "-S", str(tree), "-B", str(work / "build"),
                                                      *source.options])
        targets = [arg for program in missing for arg in ("--target", program)]
        step(f"compiling {', '.join(missing)}", ["cmake", "--build", str(work / "build"), *targets, "-j", str(jobs)])
        for program in missing:
            partial = paths[program].with_name(program + ".partial")
            shutil.copy2(work / "build" / "bin" / program, partial)
            partial.replace(paths[program])
    return paths
