"""Build the ampfused extension: CPU kernels always, CUDA kernels when torch and a toolkit allow.

Environment knobs (all optional):
  AMPFUSED_NO_CUDA=1       build the CPU kernels only
  TORCH_CUDA_ARCH_LIST     arch list; with no GPU visible the default is "7.5;8.0;9.0+PTX"
  MAX_JOBS                 parallel compile jobs (ninja)
  CUDA_HOME                toolkit root; otherwise found from /usr/local/cuda or nvcc on PATH
"""

import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _find_cuda_home() -> str | None:
    # torch's own guess walks up from `which nvcc`; a wrapper script in /usr/local/bin makes it
    # answer /usr/local, which has no CUDA headers.  Look for a real toolkit instead.
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(key):
            return os.environ[key]
    candidates = ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for c in candidates:
        if os.path.exists(os.path.join(c, "include", "cuda_runtime.h")):
            return c
    return None


_cuda_home = _find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home  # must be set before cpp_extension is imported

import torch  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402


def _want_cuda() -> bool:
    if os.environ.get("AMPFUSED_NO_CUDA") == "1":
        return False
    if torch.version.cuda is None:
        print("ampfused: torch is a CPU build; building CPU kernels only", file=sys.stderr)
        return False
    if _cuda_home is None:
        print("ampfused: no CUDA toolkit found; building CPU kernels only", file=sys.stderr)
        return False
    return True


def _pip_cuda_includes() -> list[str]:
    # Some headers torch's CUDA headers include (cusparse.h, cublas_v2.h) come only from torch's
    # pip dependencies, e.g. site-packages/nvidia/cu13/include.
    found = []
    for p in sys.path:
        found += glob.glob(os.path.join(p, "nvidia", "cu*", "include"))
        found += glob.glob(os.path.join(p, "nvidia", "*", "include"))
    return sorted(set(d for d in found if os.path.isdir(d)))


def extensions():
    with_cuda = _want_cuda()
    sources = [
        "csrc/ampfused.cpp",
        "csrc/unscale.cpp",
        "csrc/grad_gather.cpp",
        "csrc/cpu/unscale_cpu.cpp",
    ]
    cxx = ["-O3", "-fopenmp", "-Wall", "-Wno-unused-function"]
    extra_link = ["-fopenmp"]
    if not with_cuda:
        return [
            cpp_extension.CppExtension(
                "ampfused._C",
                sources,
                include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={"cxx": cxx},
                extra_link_args=extra_link,
            )
        ]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to ask: build for the common datacenter parts, 9.0 (Hopper) included, plus PTX.
        os.environ["TORCH_CUDA_ARCH_LIST"] = "7.5;8.0;9.0+PTX"
    sources.append("csrc/cuda/unscale_cuda.cu")
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]  # never --use_fast_math
    return [
        cpp_extension.CUDAExtension(
            "ampfused._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")] + _pip_cuda_includes(),
            extra_compile_args={
                "cxx": cxx + ["-DAMPFUSED_WITH_CUDA"],
                "nvcc": nvcc + ["-DAMPFUSED_WITH_CUDA"],
            },
            extra_link_args=extra_link,
        )
    ]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
