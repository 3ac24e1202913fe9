"""The environment header every result carries, and device helpers."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

import ampfused

try:  # NVIDIA apex, when installed with its CUDA extensions.
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier
except Exception:  # noqa: BLE001 - any failure means "not available"
    amp_C = None
    multi_tensor_applier = None

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"  # committed: written only with --out
RUNS = Path(__file__).resolve().parent / "runs"  # each run's own folder by default; git-ignored


def run_folder(label: str) -> Path:
    """A new folder for one run's output: ``benchmarks/runs/<UTC date>-<time>-<label>``
    (``20261127-213800-cpu-quick``), git-ignored, so a run changes no file of the checkout."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path, n = RUNS / f"{stamp}-{label}", 1
    while path.exists():  # two runs in one second
        n += 1
        path = RUNS / f"{stamp}-{label}-{n}"
    return path


def shown(path: Path) -> str:
    """``path`` as the output names it: relative to the current folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# A CPU-bound process as a dataloader worker is: a Python loop, which ends itself when the
# benchmark that started it is gone.
_BUSY = """
import os
parent = os.getppid()
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


@contextlib.contextmanager
def busy_cores() -> Iterator[int]:
    """A busy process per core this process may run on, for the block; yields how many."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(n)]
    try:
        yield n
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def is_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def device_name(device: torch.device) -> str:
    if is_gpu(device):
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), name)
    return name


def device_slug(device: torch.device) -> str:
    """``cpu``, or the GPU name's first two words: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100``."""
    if not is_gpu(device):
        return "cpu"
    words = torch.cuda.get_device_name(device).split()[:2]
    return re.sub(r"[^a-z0-9]+", "-", " ".join(words).lower()).strip("-") or "cuda"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_commit() -> str:
    commit = _git("rev-parse", "--short=12", "HEAD")
    if commit is None:
        return "unknown"
    # Uncommitted changes outside benchmarks/results make the numbers belong to no commit.
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return commit + ("-dirty" if dirty else "")


def _built() -> str:
    """When the loaded extension was built (it may predate the checked-out sources)."""
    try:
        path = Path(ampfused._C.__file__)
        t = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    except (AttributeError, OSError, TypeError):
        return "unknown"
    return t.strftime("%Y-%m-%d %H:%M UTC")


def header(device: torch.device) -> dict[str, object]:
    """Device, versions, commit and host facts for the top of every report."""
    h: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda or "none",
        "cuda_runtime": "no GPU",
        "ampfused": ampfused.__version__,
        "ampfused_cuda_kernels": ampfused.WITH_CUDA,
        "ampfused_C_built": _built(),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "apex": "available" if amp_C is not None else "not importable (apex column skipped)",
    }
    if is_gpu(device):
        props = torch.cuda.get_device_properties(device)
        h["cuda_runtime"] = torch.version.cuda or "unknown"
        h["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        h["gpu_sm_count"] = props.multi_processor_count
        h["driver_capability"] = f"sm_{props.major}{props.minor}"
    with contextlib.suppress(OSError):
        h["load_average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return h


class CpuShare:
    """Share of the machine's CPU time used by *other* processes (and hypervisor steal) between
    ``start()`` and ``stop()``: /proc/stat less this process's and its ended children's time."""

    def __init__(self) -> None:
        self._t0: tuple[float, float, float] | None = None

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except (OSError, IndexError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        v = [int(x) for x in fields[:8]]
        user, nice, system, idle, iowait, irq, softirq, steal = v + [0] * (8 - len(v))
        busy = (user + nice + system + irq + softirq + steal) / hz
        total = (user + nice + system + idle + iowait + irq + softirq + steal) / hz
        t = os.times()
        return busy, total, t.user + t.system + t.children_user + t.children_system

    def start(self) -> CpuShare:
        self._t0 = self._sample()
        return self

    def stop(self) -> float | None:
        t1 = self._sample()
        if self._t0 is None or t1 is None:
            return None
        busy, total, own = (b - a for a, b in zip(self._t0, t1, strict=True))
        if total <= 0:
            return None
        return max(0.0, (busy - own) / total)
