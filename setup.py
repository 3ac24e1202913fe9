"""Build the ampfused extension: CPU kernels always, CUDA kernels when torch and a toolkit allow.

Environment knobs (all optional):
  AMPFUSED_NO_CUDA=1       build the CPU kernels only
  TORCH_CUDA_ARCH_LIST     arch list; with no GPU visible the default is "7.5;8.0;9.0+PTX"
  MAX_JOBS                 parallel compile jobs (ninja)
  CUDA_HOME                toolkit root; otherwise found from /usr/local/cuda or nvcc on PATH
"""

import glob
import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.errors import LinkError

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_check():
    # By file path: the ampfused package imports its compiled extension, which does not exist yet.
    path = os.path.join(ROOT, "ampfused", "_build_check.py")
    spec = importlib.util.spec_from_file_location("_ampfused_build_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build_check = _load_build_check()


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

# The shared libstdc++ torch runs on, named on the link line so that the driver's implicit
# -lstdc++ has nothing left to resolve: a toolchain whose library path holds only a static
# libstdc++.a (e.g. a wrapper adding -B<prefix>/) then cannot link a private copy into _C.
_TORCH_LIBSTDCXX = _build_check.loaded_libstdcxx()


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


def _check_arch_list(arch_list: str) -> None:
    # The kernels take up to 32,764 bytes of parameters (csrc/launch_table.h), which CUDA allows
    # from compute capability 7.0; older archs fail in ptxas with an obscure message.
    for arch in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        name = arch.split("+")[0].strip()
        if not name:
            continue
        try:
            major = float(name)
        except ValueError:
            continue  # names such as "Hopper" are torch's to resolve
        if major < 7.0:
            sys.exit(
                f"ampfused: TORCH_CUDA_ARCH_LIST={arch_list!r} includes {name}; the CUDA kernels "
                "need compute capability 7.0 or newer (Volta+). Remove the older archs, or "
                "build the CPU kernels only with AMPFUSED_NO_CUDA=1."
            )


def extensions():
    with_cuda = _want_cuda()
    # Every C++ file of csrc/ and csrc/cpu/ is built; csrc/cuda/ only with the CUDA kernels.
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # -ffp-contract=off: no FMA contraction (GCC contracts by default in C++), so the grad_stats
    # sums round as ampfused.reference computes them (csrc/unscale_math.h, stat_mul/stat_add).
    cxx = ["-O3", "-fopenmp", "-Wall", "-Wno-unused-function", "-ffp-contract=off"]
    extra_link = ["-fopenmp"] + ([_TORCH_LIBSTDCXX] if _TORCH_LIBSTDCXX else [])
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
    _check_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    sources += sorted(glob.glob("csrc/cuda/*.cu") + glob.glob("csrc/cuda/*.cpp"))
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


class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's build_ext, then a check that the linked extension carries no libstdc++ of its own."""

    def build_extension(self, ext):
        super().build_extension(ext)
        built = self.get_ext_fullpath(ext.name)
        problems = _build_check.libstdcxx_problems(built, _TORCH_LIBSTDCXX)
        if not problems:
            return
        # Never leave a crashing extension behind: neither the one just linked nor the copy an
        # in-place build would have replaced.
        self.inplace, inplace = True, self.inplace
        in_tree = self.get_ext_fullpath(ext.name)
        self.inplace = inplace
        for path in {built, in_tree}:
            if os.path.exists(path):
                os.remove(path)
        raise LinkError(_build_check.failure_message(built, problems, _TORCH_LIBSTDCXX))


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension},
)
