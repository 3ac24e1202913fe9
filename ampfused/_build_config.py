"""How the extension is compiled: sources, flags, toolkit, arch list and the build record.

One definition for both ways ampfused gets its kernels: ahead of time by setup.py (``pip install
--no-build-isolation .``) and just in time at first import (:mod:`ampfused._extension`, for
``pip install .`` in an isolated build environment, which has no torch).  Each build leaves a
record (``_C.build.json``) beside the shared object: which torch, CUDA and archs it was built
for, so that an import after a torch upgrade can tell a stale build from a good one.

Pure Python: imports neither torch nor ampfused (setup.py loads it by file path, possibly where
torch is not installed).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
from typing import Any

# -ffp-contract=off: no FMA contraction (GCC contracts by default in C++), so the grad_stats sums
# round as ampfused.reference computes them (csrc/unscale_math.h, stat_mul/stat_add).
CXX_FLAGS = ["-O3", "-fopenmp", "-Wall", "-Wno-unused-function", "-ffp-contract=off"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]  # never --use_fast_math
CUDA_DEFINE = "-DAMPFUSED_WITH_CUDA"
LINK_FLAGS = ["-fopenmp"]
# With no GPU to ask, the wheel is built for the common datacenter parts, 9.0 (Hopper) included,
# plus PTX for newer ones.
DEFAULT_ARCH_LIST = "7.5;8.0;9.0+PTX"
# The kernels take up to 32,764 bytes of parameters (csrc/launch_table.h), which CUDA allows from
# compute capability 7.0; older archs fail in ptxas with an obscure message.
MIN_ARCH = 7.0

# Every C++ file of csrc/ and csrc/cpu/ is built; csrc/cuda/ only with the CUDA kernels.
# csrc/host_cuda/ is the test-only host execution layer (tests/host_cuda.py), never built here.
_CPU_SOURCES = ("*.cpp", "cpu/*.cpp")
_CUDA_SOURCES = ("cuda/*.cu", "cuda/*.cpp")
_ALL_FILES = ("*.cpp", "*.h", "cpu/*", "cuda/*")

RECORD_NAME = "_C.build.json"
# AMPFUSED_BUILD: how import ampfused finds its kernels (and, for setup.py, whether to build).
BUILD_MODES = ("auto", "aot", "jit", "off")


def build_mode() -> str:
    mode = os.environ.get("AMPFUSED_BUILD", "auto").strip().lower() or "auto"
    if mode not in BUILD_MODES:
        raise ValueError(
            f"AMPFUSED_BUILD={os.environ['AMPFUSED_BUILD']!r} is not one of "
            f"{', '.join(BUILD_MODES)}: auto (the installed build, else compile at import), aot "
            "(only the installed build), jit (compile at import), off (no kernels: torch's scaler)"
        )
    return mode


def sources(csrc: str, with_cuda: bool) -> list[str]:
    """The translation units to compile, as absolute paths, in a fixed order."""
    patterns = _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())
    return sorted(p for pat in patterns for p in glob.glob(os.path.join(csrc, pat)))


def source_files(csrc: str) -> list[str]:
    """Every file a build reads from ``csrc`` (sources and headers), relative, sorted."""
    paths = (p for pat in _ALL_FILES for p in glob.glob(os.path.join(csrc, pat)))
    found = {os.path.relpath(p, csrc) for p in paths}
    return sorted(f for f in found if os.path.isfile(os.path.join(csrc, f)))


def source_digest(csrc: str) -> str:
    """sha256 over the names and contents of :func:`source_files`: any source change rebuilds."""
    h = hashlib.sha256()
    for rel in source_files(csrc):
        h.update(rel.encode() + b"\0")
        with open(os.path.join(csrc, rel), "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()


def find_cuda_home() -> str | None:
    """The CUDA toolkit root, or None.

    torch's own guess walks up from ``which nvcc``; a wrapper script in /usr/local/bin makes it
    answer /usr/local, which has no CUDA headers.  Look for a real toolkit instead.
    """
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(key):
            return os.environ[key]
    candidates = ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for c in candidates:
        if os.path.exists(os.path.join(c, "include", "cuda_runtime.h")) and os.path.exists(
            os.path.join(c, "bin", "nvcc")
        ):
            return c
    return None


def pip_cuda_includes(paths: list[str] | None = None) -> list[str]:
    """Include folders of torch's pip CUDA dependencies (e.g. site-packages/nvidia/cu13/include):
    some headers torch's CUDA headers include (cusparse.h, cublas_v2.h) come only from there."""
    found = []
    for p in sys.path if paths is None else paths:
        found += glob.glob(os.path.join(p, "nvidia", "cu*", "include"))
        found += glob.glob(os.path.join(p, "nvidia", "*", "include"))
    return sorted(set(d for d in found if os.path.isdir(d)))


def arch_list_problem(arch_list: str) -> str | None:
    """Why ``arch_list`` (TORCH_CUDA_ARCH_LIST's syntax) cannot build the kernels, or None."""
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        name = arch.split("+")[0].strip()
        if not name:
            continue
        try:
            major = float(name)
        except ValueError:
            continue  # names such as "Hopper" are torch's to resolve
        if major < MIN_ARCH:
            return (
                f"TORCH_CUDA_ARCH_LIST={arch_list!r} includes {name}; the CUDA kernels need "
                f"compute capability {MIN_ARCH} or newer (Volta+). Remove the older archs, or "
                "build the CPU kernels only with AMPFUSED_NO_CUDA=1."
            )
    return None


def find_compiler() -> str | None:
    """The C++ compiler torch's build would run ($CXX, else c++), if it exists."""
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx.split()[0]) if cxx.split() else None


def record(torch: Any, with_cuda: bool, arch_list: str | None, digest: str) -> dict[str, Any]:
    """What a build was made for; written beside the shared object (:data:`RECORD_NAME`)."""
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "with_cuda": with_cuda,
        "arch_list": arch_list if with_cuda else None,
        "python": sys.implementation.cache_tag,
        "sources": digest,
    }


def write_record(path: str, data: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a record."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def read_record(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
