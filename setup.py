"""Build ampfused: its kernels now where torch is importable, or at first import where it is not.

- ``pip install --no-build-isolation .`` (torch in the build environment): the extension is
  compiled now, CPU kernels always, CUDA kernels when torch and a toolkit allow.
- ``pip install .`` (pip's isolated build environment has no torch), or no C++ compiler: a package
  whose extension is compiled at first import against the torch that is running
  (ampfused/_extension.py).  The C++ sources travel in the package either way (ampfused/_csrc), so
  an import after a torch upgrade can rebuild.

Environment knobs (all optional):
  AMPFUSED_BUILD=auto|aot|jit|off  aot: build now or fail; jit/off: build nothing now (at import,
                           AMPFUSED_BUILD picks again); auto (default): aot where possible
  AMPFUSED_NO_CUDA=1       build the CPU kernels only
  TORCH_CUDA_ARCH_LIST     arch list; with no GPU visible the default is "7.5;8.0;9.0+PTX"
  MAX_JOBS                 parallel compile jobs (ninja)
  CUDA_HOME                toolkit root; otherwise found from /usr/local/cuda or nvcc on PATH
"""

import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import LinkError

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")


def _load(name):
    # By file path: the ampfused package imports its compiled extension, which does not exist yet.
    path = os.path.join(ROOT, "ampfused", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_ampfused{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_build_check = _load("_build_check")
_config = _load("_build_config")


def _note(message):
    print(f"ampfused: {message}", file=sys.stderr)


def _torch_or_reason():
    """(torch, None) when the extension can be built now, else (None, why not)."""
    mode = _config.build_mode()
    if mode in ("jit", "off"):
        return None, f"AMPFUSED_BUILD={mode}"
    cuda_home = _config.find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # must be set before cpp_extension is imported
    try:
        import torch
    except ImportError:
        why = (
            "torch is not importable in this build environment (pip's isolated build); "
            "`pip install --no-build-isolation .` builds the kernels now"
        )
    else:
        if _config.find_compiler():
            return torch, None
        why = f"no C++ compiler ({os.environ.get('CXX') or 'c++'}) on PATH"
    if mode == "aot":
        sys.exit(f"ampfused: AMPFUSED_BUILD=aot, but {why}.")
    return None, why


def _want_cuda(torch) -> bool:
    if os.environ.get("AMPFUSED_NO_CUDA") == "1":
        return False
    if torch.version.cuda is None:
        _note("torch is a CPU build; building CPU kernels only")
        return False
    if not os.environ.get("CUDA_HOME"):
        _note("no CUDA toolkit found; building CPU kernels only")
        return False
    return True


def extensions(torch):
    from torch.utils import cpp_extension

    with_cuda = _want_cuda(torch)
    # The shared libstdc++ torch runs on, named on the link line so that the driver's implicit
    # -lstdc++ has nothing left to resolve: a toolchain whose library path holds only a static
    # libstdc++.a (e.g. a wrapper adding -B<prefix>/) then cannot link a private copy into _C.
    libstdcxx = _build_check.loaded_libstdcxx()
    link = _config.LINK_FLAGS + ([libstdcxx] if libstdcxx else [])
    sources = [os.path.relpath(p, ROOT) for p in _config.sources(CSRC, with_cuda)]
    if not with_cuda:
        ext = cpp_extension.CppExtension(
            "ampfused._C",
            sources,
            include_dirs=[CSRC],
            extra_compile_args={"cxx": _config.CXX_FLAGS},
            extra_link_args=link,
        )
        return [ext], with_cuda, None
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = _config.DEFAULT_ARCH_LIST
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    problem = _config.arch_list_problem(arch_list)
    if problem:
        sys.exit(f"ampfused: {problem}")
    ext = cpp_extension.CUDAExtension(
        "ampfused._C",
        sources,
        include_dirs=[CSRC] + _config.pip_cuda_includes(),
        extra_compile_args={
            "cxx": _config.CXX_FLAGS + [_config.CUDA_DEFINE],
            "nvcc": _config.NVCC_FLAGS + [_config.CUDA_DEFINE],
        },
        extra_link_args=link,
    )
    return [ext], with_cuda, arch_list or "the visible GPUs"


class BuildPy(build_py):
    """Ship the C++ sources inside the package (ampfused/_csrc), for builds at import."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install compiles from the checkout's csrc/
        target = os.path.join(self.build_lib, "ampfused", "_csrc")
        shutil.rmtree(target, ignore_errors=True)  # a source removed since the last build goes
        for rel in _config.source_files(CSRC):
            self.mkpath(os.path.dirname(os.path.join(target, rel)))
            self.copy_file(os.path.join(CSRC, rel), os.path.join(target, rel))


def _cmdclass(torch, with_cuda, arch_list):
    if torch is None:
        return {"build_py": BuildPy}
    from torch.utils import cpp_extension

    class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        """torch's build_ext, a check that the linked extension carries no libstdc++ of its own,
        and the build record beside it."""

        def build_extension(self, ext):
            super().build_extension(ext)
            built = self.get_ext_fullpath(ext.name)
            libstdcxx = _build_check.loaded_libstdcxx()
            problems = _build_check.libstdcxx_problems(built, libstdcxx)
            if problems:
                # Never leave a crashing extension behind: neither the one just linked nor the
                # copy an in-place build would have replaced.
                self.inplace, inplace = True, self.inplace
                in_tree = self.get_ext_fullpath(ext.name)
                self.inplace = inplace
                for path in {built, in_tree}:
                    if os.path.exists(path):
                        os.remove(path)
                raise LinkError(_build_check.failure_message(built, problems, libstdcxx))
            digest = _config.source_digest(CSRC)
            _config.write_record(
                os.path.join(os.path.dirname(built), _config.RECORD_NAME),
                _config.record(torch, with_cuda, arch_list, digest),
            )

        def copy_extensions_to_source(self):
            # in-place and editable builds: the record goes with the extension into the tree
            super().copy_extensions_to_source()
            for ext in self.extensions:
                in_tree = self.get_ext_fullpath(ext.name)
                self.inplace, inplace = False, self.inplace
                built = self.get_ext_fullpath(ext.name)
                self.inplace = inplace
                record = os.path.join(os.path.dirname(built), _config.RECORD_NAME)
                if os.path.exists(record) and built != in_tree:
                    self.copy_file(
                        record, os.path.join(os.path.dirname(in_tree), _config.RECORD_NAME)
                    )

    return {"build_py": BuildPy, "build_ext": BuildExtension}


_torch, _why_not = _torch_or_reason()
if _torch is None:
    _note(f"building no kernels now ({_why_not}); they are compiled at first import")
    _ext_modules, _with_cuda, _arch_list = [], False, None
else:
    _ext_modules, _with_cuda, _arch_list = extensions(_torch)

setup(ext_modules=_ext_modules, cmdclass=_cmdclass(_torch, _with_cuda, _arch_list))
