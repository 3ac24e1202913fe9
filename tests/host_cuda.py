"""The host execution layer: ampfused's CUDA kernels built by the C++ compiler, run on the CPU.

``load()`` compiles csrc/host_cuda/ (which includes the kernel and launcher sources of
csrc/cuda/ as they are) with the C++ compiler, links it against the ampfused extension that is
imported (the ops' shared checks and the launch planner come from there), and returns
``torch.ops.ampfused_host``: the seven ops of ``torch.ops.ampfused`` with the same schemas,
taking CPU tensors and running the CUDA launchers and kernels on the host execution layer
(csrc/host_cuda/runtime.h says which CUDA semantics it keeps), plus ``configure`` (seed, blocks
in flight, resident blocks, graph capture) and ``counters`` (launches, blocks, barrier phases,
shuffles since the last configure).

The build is cached under build/host_cuda/, keyed by every source and header of csrc/, the
extension it links against and torch's version: a change to a kernel rebuilds it; pytest-xdist
workers share one build (torch's build lock).  About 30 s on 2 cores the first time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

import torch

import ampfused

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


def _has_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return True  # aarch64 and the others: FMA is part of the base instruction set
    try:
        return " fma" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# nvcc contracts a * b + c into an FMA by default (--fmad=true), where the CPU build of the same
# per-element code is compiled with -ffp-contract=off: the layer contracts where GCC does (an
# approximation of nvcc, which may fuse more), so plain arithmetic in the kernels that the _rn
# intrinsics should hold apart shows as a mismatch with the CPU kernels.  x86 CPUs without FMA
# contract nothing (CONTRACTS_FMA is False); other architectures (aarch64, ...) have FMA.
CONTRACTS_FMA = _has_fma()
CONTRACTION_FLAGS = ["-ffp-contract=fast"] + (
    ["-mfma"] if CONTRACTS_FMA and platform.machine() in ("x86_64", "AMD64") else []
)


def _key(extension: Path) -> str:
    h = hashlib.sha256()
    h.update(" ".join(CONTRACTION_FLAGS).encode())
    for path in sorted(CSRC.rglob("*")):
        if path.is_file() and path.suffix in (".h", ".cuh", ".cu", ".cpp"):
            h.update(str(path.relative_to(CSRC)).encode())
            h.update(path.read_bytes())
    h.update(str(extension).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:16]


@functools.cache
def load():  # noqa: ANN201  (torch.ops namespace objects have no public type)
    """Builds (or reuses) the host layer and returns ``torch.ops.ampfused_host``."""
    from torch.utils import cpp_extension

    from ampfused import _build_check

    extension = Path(ampfused._C.__file__).resolve()
    name = f"ampfused_host_cuda_{_key(extension)}"
    build = ROOT / "build" / "host_cuda" / name
    build.mkdir(parents=True, exist_ok=True)
    sources = sorted(str(p) for p in (CSRC / "host_cuda").glob("*.cpp"))
    cflags = [
        "-O2",
        "-DAMPFUSED_HOST_CUDA",
        "-DAMPFUSED_WITH_CUDA",  # the headers' declarations of the CUDA launchers
        *CONTRACTION_FLAGS,
        # The layer's copies of the kernels' inline code and of the launchers bind within it,
        # never to the ampfused extension's own (a CUDA build exports launch_pass_cuda too).
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        "-Wall",
        "-Wno-unused-function",
        "-Wno-unknown-pragmas",  # the kernels' #pragma unroll
    ]
    # As setup.py links the extension: the shared libstdc++ torch runs on, named on the link
    # line, so a toolchain that offers only a static one (the GPU image's) links no copy of it.
    ldflags = [str(extension), f"-Wl,-rpath,{extension.parent}"]
    ldflags += [lib] if (lib := _build_check.loaded_libstdcxx()) else []
    if not list(build.glob(f"{name}*.so")):
        print(f"ampfused: building the host CUDA layer in {build} (about 30 s)", file=sys.stderr)
    cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=cflags,
        extra_include_paths=[str(CSRC)],
        extra_ldflags=ldflags,
        build_directory=str(build),
        is_python_module=False,
        verbose=os.environ.get("AMPFUSED_HOST_CUDA_VERBOSE") == "1",
    )
    return torch.ops.ampfused_host
