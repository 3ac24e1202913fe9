"""How ``import ampfused`` finds its compiled kernels (``ampfused._C``), or goes on without them.

In this order, as ``AMPFUSED_BUILD`` allows (auto by default; ampfused/_build_config.py):

1. the build installed with the package (``pip install --no-build-isolation .``), when its record
   says it was made for the running torch and it loads;
2. a build in the cache (``AMPFUSED_CACHE_DIR``, else ``$XDG_CACHE_HOME/ampfused``, else
   ``~/.cache/ampfused``), one folder per key: sources, torch, its CUDA, the arch list, Python.
   On a miss it is compiled there with torch's ninja build, one process at a time (a file lock:
   DDP ranks started together wait for the one that builds); a hit loads the shared object
   without running any tool;
3. none: ``ampfused.GradScaler`` is torch's scaler (ampfused/_no_kernels.py), with one
   :class:`KernelsUnavailableWarning` naming what is missing and the command that fixes it.

:func:`info` says which of these happened, for what, and where (``python -m ampfused``).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from ampfused import _build_check
from ampfused import _build_config as config

__all__ = ["KernelsUnavailableError", "KernelsUnavailableWarning", "load", "info", "require"]

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# The compilers' CPU time on a 2-core AMD EPYC (g++ 12, nvcc 13.0, torch 2.14.1): the CPU
# sources, and the CUDA sources per architecture.  Measured: 7 CPU-minutes for CPU + three archs
# at a first import; 4.4 to 7 for CPU + one arch by `make install`; for the CPU kernels alone
# 2.4 at a first import beside a load of 3.5 to 6.7, and 5.6 reported by a user whose load
# passed the cores (contention stretches CPU time too).  The note printed while a build runs
# divides them by the cores the build gets now (_compile_estimate); the build's record keeps
# what it took (compile_seconds, compile_cpu_seconds).
_CPU_CORE_MINUTES, _CUDA_CORE_MINUTES_PER_ARCH = 3.5, 1.5


@dataclass(frozen=True)
class _Estimate:
    """How long a build should take here, from the CPU time it needs and the cores it gets."""

    minutes: float  # wall time
    cpu_minutes: float  # the compilers' CPU time, measured on an idle machine
    share: float  # the cores' worth of CPU time the build gets
    cores: int
    load: float  # the 1-minute load average before the build

    def text(self) -> str:
        """The announcement's estimate: "about 2 min (3.5 CPU-minutes over 2 cores)", or under load
        "about 4 min (3.5 CPU-minutes; beside a load average of 4.0 on 2 cores it gets 0.9 of a
        core)"."""
        minutes = f"about {max(1, round(self.minutes))} min ({self.cpu_minutes:g} CPU-minutes"
        if self.load < 0.5:
            return f"{minutes} over {_cores_text(self.share)})"
        cores = f"{self.cores} core{'s' * (self.cores != 1)}"
        return (
            f"{minutes}; beside a load average of {self.load:.1f} on {cores} it gets "
            f"{_cores_text(self.share)})"
        )


def _cores_text(share: float) -> str:
    """0.86 -> "0.9 of a core", 1.0 -> "1 core", 1.5 -> "1.5 cores", 2.0 -> "2 cores"."""
    rounded = round(share, 1)
    if rounded < 1:
        return f"{max(rounded, 0.1):g} of a core"
    return "1 core" if rounded == 1 else f"{rounded:g} cores"


def _ninja_jobs(cores: int) -> int:
    """How many compilers torch's ninja build runs at once: MAX_JOBS, else ninja's default (the
    cores + 2; 3 on two cores, 2 on one)."""
    try:
        jobs = int(os.environ.get("MAX_JOBS") or 0)
    except ValueError:  # (ninja's own parse fails later, with its message)
        jobs = 0
    if jobs > 0:
        return jobs
    return 2 if cores <= 1 else 3 if cores == 2 else cores + 2


def _build_share(jobs: int, cores: int, load: float) -> float:
    """The cores' worth of CPU time ``jobs`` compilers get while ``load`` other processes want the
    CPU: all they ask for (at most the cores) while there are cores to go round, else their fair
    share of the cores, cores * jobs / (jobs + load), under 1 when the load passes the cores."""
    if jobs + load <= cores:
        return float(jobs)
    return min(float(jobs), cores * jobs / (jobs + load))


def _compile_estimate(with_cuda: bool, archs: int, steps: int) -> _Estimate:
    """This build's estimate here now: its CPU minutes over :func:`_build_share` of the cores,
    for ``steps`` compiles (no more run at once than there are)."""
    cpu_minutes = _CPU_CORE_MINUTES + (_CUDA_CORE_MINUTES_PER_ARCH * archs if with_cuda else 0)
    cores = os.cpu_count() or 1
    try:
        load = max(0.0, os.getloadavg()[0])
    except OSError:  # (no load average on this platform)
        load = 0.0
    share = _build_share(min(_ninja_jobs(cores), max(1, steps)), cores, load)
    return _Estimate(cpu_minutes / share, cpu_minutes, share, cores, load)


def _children_cpu_seconds() -> float:
    """CPU time (user + system) of this process's finished child processes: the compilers, as
    ninja waits for each and torch for ninja."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return 0.0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


class _Progress:
    """Lines on stderr while the compilers run, so that a long first import does not look hung:
    the compile steps done (an object file, or the shared object, written since the build began)
    of the total, the time so far and the estimate.  On a terminal one line, rewritten each
    ``interval`` seconds; elsewhere (a log, CI, a notebook) a line when a step finishes, and every
    ``heartbeat`` seconds while none does.  :meth:`tick` is one look; the thread calls it."""

    def __init__(
        self,
        build_dir: str,
        steps: int,
        estimate_s: float,
        stream: Any = None,
        interval: float = 1.0,
        heartbeat: float = 30.0,
    ) -> None:
        self.build_dir, self.steps, self.estimate_s = build_dir, steps, estimate_s
        self.stream = sys.stderr if stream is None else stream
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):  # a stream without isatty, or a closed one
            self.tty = False
        self.interval, self.heartbeat = interval, heartbeat
        self.began = time.time()
        self.last_done, self.last_line = -1, float("-inf")
        self.wrote = False  # on a terminal: a line is open, to end at the exit
        self._write_failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def done(self) -> int:
        """Compile steps finished: object files and the shared object written since the start."""
        count = 0
        try:
            entries = list(os.scandir(self.build_dir))
        except OSError:
            return 0
        for entry in entries:
            if entry.name.endswith(".o") or entry.name == "_C.so":
                try:
                    count += entry.stat().st_mtime >= self.began - 1.0
                except OSError:  # (removed meanwhile)
                    pass
        return min(count, self.steps)

    def line(self, done: int, elapsed: float) -> str:
        expected = max(1, round(self.estimate_s / 60))
        return (
            f"ampfused: compiling, {done} of {self.steps} steps done, {_clock(elapsed)} so far "
            f"(about {expected} min expected)"
        )

    def tick(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        done = self.done()
        if self.tty:
            self._write("\r" + self.line(done, now - self.began) + "\033[K")
            self.wrote = True
        elif done != self.last_done or now - self.last_line >= self.heartbeat:
            self._write(self.line(done, now - self.began) + "\n")
            self.last_line = now
        self.last_done = done

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stderr: no progress, the build goes on
            self._write_failed = True
            self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def __enter__(self) -> _Progress:
        self.began = time.time()
        self.last_done, self.last_line = 0, self.began  # the announcement was the first line
        self._thread = threading.Thread(target=self._run, name="ampfused-compile", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None and not self._write_failed:
            self.tick()  # the last steps, finished since the last look
        if self.wrote:
            self._write("\n")


class KernelsUnavailableError(ImportError, RuntimeError):
    """A feature needs ampfused's compiled kernels, and this process has none (see ``info()``)."""


class KernelsUnavailableWarning(UserWarning):
    """``import ampfused`` goes on without its kernels: GradScaler is torch's own scaler."""


class _BuildProblem(Exception):
    """Why no kernels could be built or loaded here; the message names the fix."""


@dataclass
class Status:
    """What :func:`load` did; :func:`info` reports it."""

    mode: str
    origin: str = "none"  # "installed", "cache" (a hit), "compiled" (built by this process)
    path: str | None = None
    record: dict[str, Any] | None = None
    reason: str | None = None  # why there are no kernels
    notes: list[str] = field(default_factory=list)  # what was tried before, e.g. a stale build

    @property
    def available(self) -> bool:
        return self.origin != "none"


STATUS = Status(mode="auto")


def _note(message: str) -> None:
    STATUS.notes.append(message)
    print(f"ampfused: {message}", file=sys.stderr, flush=True)


def unavailable(feature: str) -> KernelsUnavailableError:
    """The error a kernel-only feature raises here."""
    return KernelsUnavailableError(
        f"{feature} needs ampfused's compiled kernels, which this process does not have: "
        f"{STATUS.reason}. Without them ampfused.GradScaler is torch's own scaler "
        "(`python -m ampfused` shows the build status)."
    )


def require(feature: str) -> None:
    if not STATUS.available:
        raise unavailable(feature)


class Missing(ModuleType):
    """Stands in for ``ampfused._C`` when there are no kernels: any use raises the clear error."""

    with_cuda = False

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise unavailable(f"ampfused._C.{name}")


# --------------------------------------------------------------------------------------------
# Where builds live


def cache_root() -> str:
    if os.environ.get("AMPFUSED_CACHE_DIR"):
        return os.path.abspath(os.environ["AMPFUSED_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG spec: a relative value is to be ignored
        return os.path.join(xdg, "ampfused")
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        return os.path.join(home, ".cache", "ampfused")
    # no home directory (no HOME, no passwd entry): one folder per user in the temp folder
    return os.path.join(tempfile.gettempdir(), f"ampfused-{os.getuid()}")


def _sources_dir() -> str | None:
    """The C++ sources: shipped in the package (a wheel), or the checkout's (editable)."""
    for path in (os.path.join(PACKAGE_DIR, "_csrc"), os.path.join(PACKAGE_DIR, "..", "csrc")):
        if os.path.isfile(os.path.join(path, "python_module.cpp")):
            return os.path.abspath(path)
    return None


def _gpu_archs() -> list[str]:
    """Compute capabilities of this machine's GPUs, read through NVML: unlike asking the CUDA
    runtime, this leaves CUDA uninitialized, so a process that forks later can still use it."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        nvml.nvmlDeviceGetCudaComputeCapability  # noqa: B018  (absent from very old drivers)
    except (OSError, AttributeError):
        return []
    if nvml.nvmlInit_v2() != 0:
        return []
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        archs = set()
        for i in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                continue
            if nvml.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.byref(major), ctypes.byref(minor)
            ):
                continue
            archs.add(f"{major.value}.{minor.value}")
        return sorted(archs, key=float)
    finally:
        nvml.nvmlShutdown()


def _cuda_plan() -> tuple[bool, str | None, str | None]:
    """(with CUDA kernels, arch list, why not) for a build here."""
    if os.environ.get("AMPFUSED_NO_CUDA") == "1":
        return False, None, "AMPFUSED_NO_CUDA=1"
    if torch.version.cuda is None:
        return False, None, f"torch {torch.__version__} is a CPU build"
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if arch_list:
        problem = config.arch_list_problem(arch_list)
        if problem:
            raise _BuildProblem(problem)
        return True, arch_list, None
    # The GPUs' own archs; one older than the kernels allow (a display GPU beside a datacenter
    # one) is left out rather than failing the build.
    archs = [a for a in _gpu_archs() if float(a) >= config.MIN_ARCH]
    if not archs:
        why = (
            f"no GPU of compute capability {config.MIN_ARCH}+ visible and TORCH_CUDA_ARCH_LIST "
            "unset (set it, e.g. to 9.0, to compile the CUDA kernels too)"
        )
        return False, None, why
    return True, ";".join(archs), None


def _key(csrc: str, with_cuda: bool, arch_list: str | None) -> str:
    parts = [
        config.source_digest(csrc),
        torch.__version__,
        str(torch.version.cuda),
        str(torch.version.git_version if hasattr(torch.version, "git_version") else ""),
        sys.implementation.cache_tag,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        platform.machine(),
        arch_list if with_cuda else "cpu",
        " ".join(config.CXX_FLAGS + config.NVCC_FLAGS),
    ]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cuda = f"cu{torch.version.cuda.replace('.', '')}" if with_cuda else "cpu"
    return f"torch{torch.__version__.split('+')[0]}-{cuda}-{sys.implementation.cache_tag}-{digest}"


# --------------------------------------------------------------------------------------------
# Loading


def _import(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("ampfused._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["ampfused._C"] = module
    return module


def _installed() -> ModuleType | None:
    """The build installed with the package, if it is one for this torch; else None (noted)."""
    spec = importlib.util.find_spec("ampfused._C")
    if spec is None or not spec.origin:
        return None
    record = config.read_record(os.path.join(os.path.dirname(spec.origin), config.RECORD_NAME))
    if record and (record.get("torch"), record.get("torch_cuda")) != (
        torch.__version__,
        torch.version.cuda,
    ):
        problem = (
            f"were built for torch {record.get('torch')} (CUDA {record.get('torch_cuda')}); "
            f"this is torch {torch.__version__} (CUDA {torch.version.cuda})"
        )
    else:
        try:
            module = importlib.import_module("ampfused._C")
        except ImportError as e:
            problem = f"do not load ({e})"
        else:
            STATUS.origin, STATUS.path, STATUS.record = "installed", spec.origin, record
            return module
    message = f"the installed kernels ({spec.origin}) {problem}"
    if STATUS.mode == "aot":
        raise ImportError(
            f"ampfused: {message}. Rebuild them: `pip install --no-build-isolation .` from the "
            "ampfused sources, or let import compile them (AMPFUSED_BUILD=auto, the default)."
        )
    _note(f"{message}; compiling them for this torch")
    return None


class _Lock:
    """An exclusive lock on a file: one process builds a key, the others wait for it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> _Lock:
        import fcntl

        self.file = open(self.path, "a")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _note(f"waiting for another process building the same kernels (lock: {self.path})")
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.close()  # releases the lock


def _ninja_dir() -> str:
    try:
        import ninja

        return ninja.BIN_DIR
    except (ImportError, AttributeError):
        return os.path.dirname(sys.executable)


def _toolchain_problem(with_cuda: bool) -> str | None:
    """What is missing to compile here, checked before any note says a build is running."""
    if with_cuda and config.find_cuda_home() is None:
        # Building the CPU kernels alone here would leave the GPU's scaler refusing at its first
        # step; without kernels GradScaler is torch's, which runs.
        return (
            "no CUDA toolkit found to compile the CUDA kernels (nvcc: set CUDA_HOME to a toolkit "
            "matching torch's CUDA " + str(torch.version.cuda) + "), or AMPFUSED_NO_CUDA=1 to "
            "compile the CPU kernels only"
        )
    if config.find_compiler() is None:
        return (
            f"no C++ compiler ({os.environ.get('CXX') or 'c++'}) found on PATH to compile them; "
            "install one (e.g. `apt install g++`, or `conda install gxx`) and import again"
        )
    if not shutil.which("ninja") and not shutil.which("ninja", path=_ninja_dir()):
        return "ninja is not installed to compile them; `pip install ninja`, and import again"
    return None


def _compile(csrc: str, build_dir: str, with_cuda: bool, arch_list: str | None) -> ModuleType:
    saved = {k: os.environ.get(k) for k in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "PATH")}
    cuda_home = config.find_cuda_home()
    if cuda_home:  # cpp_extension reads it once, at import, and guesses wrong without it
        os.environ["CUDA_HOME"] = cuda_home
    # (and logs that it found no GPU, which is no news here)
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    cpp_extension.CUDA_HOME = cuda_home or cpp_extension.CUDA_HOME
    try:
        return _compile_with(cpp_extension, csrc, build_dir, with_cuda, arch_list)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _compile_with(
    cpp_extension: Any, csrc: str, build_dir: str, with_cuda: bool, arch_list: str | None
) -> ModuleType:
    if not cpp_extension.is_ninja_available():
        # pip's ninja package puts the tool beside the interpreter, which a venv used without
        # activating it does not have on PATH
        os.environ["PATH"] = _ninja_dir() + os.pathsep + os.environ.get("PATH", "")
    libstdcxx = _build_check.loaded_libstdcxx()
    extra: dict[str, Any] = {}
    includes = [csrc]
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        extra = dict(extra_cuda_cflags=config.NVCC_FLAGS + [config.CUDA_DEFINE])
        includes += config.pip_cuda_includes()
    return cpp_extension.load(
        name="_C",
        sources=config.sources(csrc, with_cuda),
        extra_cflags=config.CXX_FLAGS + ([config.CUDA_DEFINE] if with_cuda else []),
        extra_ldflags=config.LINK_FLAGS + ([libstdcxx] if libstdcxx else []),
        extra_include_paths=includes,
        build_directory=build_dir,
        with_cuda=with_cuda,
        is_python_module=True,
        verbose=False,
        **extra,
    )


def _load_cached(so_path: str, record_path: str) -> tuple[ModuleType | None, str | None]:
    """(the cache's complete build, None) when there is one (its record is written last);
    (None, None) when there is none; (None, why) when it does not load here."""
    record = config.read_record(record_path)
    if not record or not os.path.exists(so_path):
        return None, None
    try:
        module = _import(so_path)
    except (ImportError, OSError) as e:
        return None, str(e)
    STATUS.origin, STATUS.path, STATUS.record = "cache", so_path, record
    return module, None


def _cached() -> ModuleType:
    """The cache's build for this key, compiled first on a miss."""
    csrc = _sources_dir()
    if csrc is None:
        raise _BuildProblem(
            "its C++ sources are not installed, so they cannot be compiled here; reinstall "
            "ampfused (`pip install --no-build-isolation .` from its sources)"
        )
    with_cuda, arch_list, no_cuda = _cuda_plan()
    key = _key(csrc, with_cuda, arch_list)
    root = cache_root()
    build_dir = os.path.join(root, key)
    so_path = os.path.join(build_dir, "_C.so")
    record_path = os.path.join(build_dir, config.RECORD_NAME)
    failed_path = os.path.join(build_dir, "failed")
    log_path = os.path.join(build_dir, "build.log")
    module, broken = _load_cached(so_path, record_path)  # a hit: no lock, no tool run
    if module is not None:
        return module
    os.makedirs(build_dir, exist_ok=True)
    waited_since = time.time()
    with _Lock(os.path.join(root, f"{key}.lock")):
        if broken is None:  # perhaps built by the process we waited for
            module, broken = _load_cached(so_path, record_path)
            if module is not None:
                return module
        if broken is not None:
            _note(f"the cached kernels ({so_path}) do not load ({broken}); compiling them again")
        if os.path.exists(failed_path) and os.path.getmtime(failed_path) >= waited_since:
            # the process we waited for failed on this very key: do not fail again at length
            raise _BuildProblem(f"compiling them failed; the compiler's output is in {log_path}")
        problem = _toolchain_problem(with_cuda)
        if problem:
            raise _BuildProblem(problem)
        if os.path.exists(record_path):
            os.remove(record_path)  # no reader may take the shared object while it is rewritten
        archs = len(arch_list.split(";")) if with_cuda else 0
        steps = len(config.sources(csrc, with_cuda)) + 1  # the objects, then the link
        estimate = _compile_estimate(with_cuda, archs, steps)
        what = f"CPU + CUDA ({arch_list})" if with_cuda else f"CPU only: {no_cuda}"
        _note(
            f"compiling the kernels for torch {torch.__version__} [{what}] into {build_dir}; "
            f"{estimate.text()}, once (later imports load them from there)"
        )
        start, cpu_start = time.time(), _children_cpu_seconds()
        try:
            with _Progress(build_dir, steps, estimate.minutes * 60):
                module = _compile(csrc, build_dir, with_cuda, arch_list)
            problems = _build_check.libstdcxx_problems(so_path, _build_check.loaded_libstdcxx())
            if problems:
                os.remove(so_path)
                raise RuntimeError(
                    _build_check.failure_message(so_path, problems, _build_check.loaded_libstdcxx())
                )
        except _BuildProblem:
            raise
        except Exception as e:
            with open(log_path, "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
            with open(failed_path, "w") as f:
                f.write(f"{time.ctime()}\n")
            raise _BuildProblem(
                f"compiling them failed; the compiler's output is in {log_path}"
            ) from e
        seconds, cpu_seconds = time.time() - start, _children_cpu_seconds() - cpu_start
        _note(f"compiled in {_clock(seconds)} ({cpu_seconds / 60:.1f} CPU-minutes)")
        record = config.record(torch, with_cuda, arch_list, config.source_digest(csrc))
        record["compile_seconds"] = round(seconds, 1)
        record["compile_cpu_seconds"] = round(cpu_seconds, 1)  # the compilers' (child processes)
        config.write_record(record_path, record)  # last: its presence means a complete build
        if os.path.exists(failed_path):
            os.remove(failed_path)
        sys.modules["ampfused._C"] = module
        STATUS.origin, STATUS.path, STATUS.record = "compiled", so_path, record
        return module


def _missing() -> Missing:
    # in sys.modules too: `import ampfused._C` must not load a build this module turned down
    sys.modules["ampfused._C"] = Missing("ampfused._C")
    return sys.modules["ampfused._C"]


def load() -> ModuleType:
    """``ampfused._C``: the kernels, or a :class:`Missing` stand-in after one warning."""
    STATUS.mode = config.build_mode()
    if STATUS.mode == "off":
        STATUS.reason = "AMPFUSED_BUILD=off; unset it to use them"
        return _missing()
    if STATUS.mode in ("auto", "aot"):
        module = _installed()
        if module is not None:
            return module
        if STATUS.mode == "aot":
            raise ImportError(
                "ampfused: AMPFUSED_BUILD=aot, and no kernels were installed with the package. "
                "Build them: `pip install --no-build-isolation .` from the ampfused sources, "
                "where torch is installed."
            )
    try:
        return _cached()
    except _BuildProblem as e:
        STATUS.reason = str(e)
    except OSError as e:  # an unwritable or unlockable cache folder, a full disk
        STATUS.reason = (
            f"the build cache {cache_root()} is not usable ({e}); set AMPFUSED_CACHE_DIR to a "
            "writable local folder"
        )
    if STATUS.mode == "jit":
        raise ImportError(f"ampfused: AMPFUSED_BUILD=jit, but {STATUS.reason}")
    warnings.warn(
        f"ampfused runs without its compiled kernels: {STATUS.reason}. Until then "
        "ampfused.GradScaler is torch's own scaler (same results), and watch(), MasterWeights "
        "and the scale policy options raise. `python -m ampfused` shows the build status.",
        KernelsUnavailableWarning,
        stacklevel=2,
    )
    return _missing()


# --------------------------------------------------------------------------------------------
# Reporting


@dataclass(frozen=True)
class BuildInfo:
    """What ``python -m ampfused`` prints: the first thing a bug report needs."""

    version: str
    torch: str
    torch_cuda: str | None
    mode: str
    origin: str
    path: str | None
    built_for: dict[str, Any] | None
    with_cuda: bool
    cache_dir: str
    reason: str | None
    notes: tuple[str, ...]

    def __str__(self) -> str:
        rec = self.built_for or {}
        kernels = {
            "installed": "installed with the package",
            "cache": "from the build cache",
            "compiled": "compiled by this process into the build cache",
        }.get(self.origin, f"none ({self.reason})")
        lines = [
            f"ampfused {self.version}",
            f"  running torch   {self.torch} (CUDA {self.torch_cuda or 'none: a CPU build'}), "
            f"Python {sys.version.split()[0]}",
            f"  kernels         {kernels}",
        ]
        if self.path:
            lines.append(f"  shared object   {self.path}")
        if self.origin != "none":
            built = rec.get("torch", "unknown (no build record)")
            archs = f" for {rec['arch_list']}" if rec.get("arch_list") else ""
            cuda = f"CPU and CUDA kernels{archs}" if self.with_cuda else "CPU kernels only"
            lines.append(f"  built for       torch {built}; {cuda}")
        lines += [
            f"  AMPFUSED_BUILD  {self.mode}",
            f"  build cache     {self.cache_dir}",
        ]
        lines += [f"  note            {n}" for n in self.notes]
        return "\n".join(lines)


def info(version: str, with_cuda: bool) -> BuildInfo:
    return BuildInfo(
        version=version,
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        mode=STATUS.mode,
        origin=STATUS.origin,
        path=STATUS.path,
        built_for=STATUS.record,
        with_cuda=with_cuda,
        cache_dir=cache_root(),
        reason=STATUS.reason,
        notes=tuple(STATUS.notes),
    )
