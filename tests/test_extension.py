"""How ``import ampfused`` gets its kernels, and what it does without them (ampfused/_extension.py,
ampfused/_no_kernels.py).

Each scenario runs in a child interpreter over a copy of the package (``python -S``, so the
editable install of this tree cannot supply ``ampfused._C``), with the compiler hidden where the
scenario says so.  The end-to-end builds (``pip install .`` compiling at first import, two
processes at once, a cache hit with no tools) are .ci/install-forms, which CI runs; here the
build cache's protocol is driven with a stand-in for the compiler.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time

import pytest
import torch

import ampfused
from ampfused import _build_config, _extension, _no_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = sysconfig.get_paths()["purelib"]


def package_copy(tmp_path, with_installed_build: bool) -> str:
    """tmp_path/pkg holding ampfused/ (Python files, and the installed _C if asked) and csrc/."""
    dest = tmp_path / "pkg"
    shutil.copytree(
        os.path.join(ROOT, "ampfused"),
        dest / "ampfused",
        ignore=shutil.ignore_patterns("__pycache__", "_C*.so", "_C.build.json"),
    )
    shutil.copytree(os.path.join(ROOT, "csrc"), dest / "csrc")
    if with_installed_build:
        shutil.copy(ampfused._C.__file__, dest / "ampfused")
    return str(dest)


def run_child(tmp_path, code: str, *, pkg: str, hide_compiler: bool = True, **env: str):
    empty = tmp_path / "no-tools"
    empty.mkdir(exist_ok=True)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("AMPFUSED_")}
    child_env.update(PYTHONPATH=os.pathsep.join([pkg, SITE]))
    child_env.update({"AMPFUSED_CACHE_DIR": str(tmp_path / "cache"), **env})
    if hide_compiler:
        child_env.update(PATH=str(empty), CXX=str(empty / "c++"))
    return subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_env,
        cwd=str(tmp_path),
        timeout=300,
    )


def assert_ok(proc) -> None:
    assert proc.returncode == 0 and "CHILD OK" in proc.stdout, proc.stdout + proc.stderr


# --------------------------------------------------------------------------------------------
# No kernels at all: torch's scaler, the same results, clear refusals


NO_KERNELS_CHILD = """
import warnings

import torch

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import ampfused
mine = [w for w in caught if issubclass(w.category, ampfused.KernelsUnavailableWarning)]
assert len(mine) == 1, [str(w.message) for w in caught]
assert "no C++ compiler" in str(mine[0].message) and "install one" in str(mine[0].message)
assert not ampfused.KERNELS and not ampfused.WITH_CUDA
assert ampfused.info().origin == "none" and "no C++ compiler" in str(ampfused.info())


def train(scaler_cls, clip):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
    history = []
    for i in range(8):
        x = torch.randn(8, 16)
        loss = model(x).float().pow(2).mean()
        if i in (3, 4):
            loss = loss * float("inf")  # two skipped steps: the scale backs off twice
        opt.zero_grad()
        scaler.scale(loss).backward()
        if clip:
            if scaler_cls is torch.amp.GradScaler:
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            else:
                norm = scaler.clip_grad_norm_(opt, 0.5)
            history.append(norm.clone())
        scaler.step(opt)
        scaler.update()
        history += [p.detach().clone() for p in model.parameters()] + [scaler.get_scale()]
    return history, scaler.state_dict()


for clip in (False, True):
    ours, ours_state = train(ampfused.GradScaler, clip)
    theirs, theirs_state = train(torch.amp.GradScaler, clip)
    assert ours_state == theirs_state, (ours_state, theirs_state)
    for a, b in zip(ours, theirs, strict=True):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        else:
            assert a == b, (a, b)

scaler = ampfused.GradScaler("cpu")
assert isinstance(scaler, torch.amp.GradScaler)
assert scaler.min_scale is None and scaler.hysteresis == 1
refusals = {
    "watch": lambda: scaler.watch(torch.nn.Linear(2, 2)),
    "report": scaler.report,
    "grad_norms": scaler.grad_norms,
    "counters": scaler.counters,
    "step_skipped": scaler.step_skipped,
    "MasterWeights": lambda: ampfused.MasterWeights(torch.optim.SGD([torch.zeros(2)], lr=1)),
    "min_scale": lambda: ampfused.GradScaler("cpu", min_scale=1.0),
    "hysteresis": lambda: ampfused.GradScaler("cpu", hysteresis=2),
    "islands": lambda: ampfused.GradScaler("cpu", policy="torch", islands="auto"),
    "island_factors": scaler.island_factors,
    "ampfused_islands": lambda: ampfused.GradScaler("cpu").load_state_dict(
        dict(scaler.state_dict(), ampfused_islands={"names": [], "states": []})
    ),
    "ampfused.ops": lambda: ampfused.ops,
    "ampfused.ops ": lambda: __import__("ampfused.grad_scaler"),  # the modules over the ops
}
for name, call in refusals.items():
    try:
        call()
    except ampfused.KernelsUnavailableError as e:
        assert isinstance(e, RuntimeError) and isinstance(e, ImportError)
        assert "compiled kernels" in str(e) and "no C++ compiler" in str(e), str(e)
        assert name.strip() in str(e), (name, str(e))
    else:
        raise AssertionError(f"{name} did not refuse")
# clip_grad_norm_ after unscale_ only clips, as ampfused's does
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler.scale(model(torch.ones(3, 4)).sum()).backward()
scaler.unscale_(opt)
before = [p.grad.clone() for p in model.parameters()]
norm = scaler.clip_grad_norm_(opt, 1e9)
assert torch.equal(norm, torch.nn.utils.get_total_norm(before))
# torch's clip_grad_norm_ signature (the parameters) is refused as with the kernels
try:
    scaler.clip_grad_norm_(model.parameters(), 1.0)
except TypeError as e:
    assert "got a generator (model.parameters()?)" in str(e), str(e)
    assert str(e).endswith("scaler.clip_grad_norm_(optimizer, 1.0)"), str(e)
else:
    raise AssertionError("clip_grad_norm_ took the parameters")
# a checkpoint holding a scale policy is refused, one with torch's rule loads
state = dict(scaler.state_dict(), ampfused={"min_scale": 1.0, "hysteresis": 1})
try:
    ampfused.GradScaler("cpu").load_state_dict(state)
except ampfused.KernelsUnavailableError as e:
    assert "min_scale=1.0" in str(e)
else:
    raise AssertionError("a checkpoint's policy was dropped")
ampfused.GradScaler("cpu").load_state_dict(dict(state, ampfused={"min_scale": None}))
sharded = ampfused.ShardedGradScaler("cpu", hysteresis=1)
for call in (sharded.watch, lambda: ampfused.ShardedGradScaler("cpu", max_scale=2.0**20)):
    try:
        call()
    except ampfused.KernelsUnavailableError:
        pass
    else:
        raise AssertionError("the fallback ShardedGradScaler took a kernel-only feature")
import ampfused._C  # the stand-in, not an installed build the loader turned down
assert isinstance(ampfused._C, ampfused._extension.Missing)
try:
    ampfused.GradScaler("cpu", bogus=1)
except TypeError as e:
    assert "bogus" in str(e)
else:
    raise AssertionError("an unknown keyword was taken")
assert ampfused.GradScaler("cpu", hysteresis=1, scaling=True).get_scale() == 65536.0
print("CHILD OK")
"""


def test_without_a_compiler_import_works_and_trains_as_torch(tmp_path):
    """A package with no installed build and no compiler: one warning naming what is missing,
    training bit for bit torch's (skipped steps and clipping included), and every kernel-only
    feature refusing with KernelsUnavailableError."""
    assert_ok(run_child(tmp_path, NO_KERNELS_CHILD, pkg=package_copy(tmp_path, False)))


@pytest.mark.parametrize("name", ["GradScaler", "ShardedGradScaler"])
def test_fallback_scalers_cover_every_public_method(name):
    """Each public name ampfused's scalers add to torch's is answered by the fallback: taken
    over, or refused, never an AttributeError."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    ours = getattr(ampfused, name)
    fallback = _no_kernels.GradScaler if name == "GradScaler" else _no_kernels.sharded_grad_scaler()
    torchs = torch.amp.GradScaler if name == "GradScaler" else ShardedGradScaler
    added = {n for n in dir(ours) if not n.startswith("_")} - set(dir(torchs))
    own = {
        n
        for klass in fallback.__mro__
        if klass.__module__ == _no_kernels.__name__
        for n in vars(klass)
    }
    assert added <= own, added - own
    assert issubclass(fallback, torchs)


def test_build_off_and_bad_mode(tmp_path):
    pkg = package_copy(tmp_path, True)
    off = run_child(
        tmp_path,
        """
        import warnings
        warnings.simplefilter("error")
        import ampfused
        assert not ampfused.KERNELS and "AMPFUSED_BUILD=off" in str(ampfused.info())
        print("CHILD OK")
        """,
        pkg=pkg,
        AMPFUSED_BUILD="off",
    )
    assert_ok(off)
    bad = run_child(tmp_path, "import ampfused", pkg=pkg, AMPFUSED_BUILD="sometimes")
    assert bad.returncode != 0 and "ValueError: AMPFUSED_BUILD='sometimes'" in bad.stderr


# --------------------------------------------------------------------------------------------
# The installed build: used when it is for this torch, named when it is not


def test_installed_build_carries_its_record():
    info = ampfused.info()
    assert info.origin == "installed", str(info)
    assert info.built_for is not None, "setup.py wrote no _C.build.json beside the extension"
    assert info.built_for["torch"] == torch.__version__
    assert info.built_for["with_cuda"] == ampfused.WITH_CUDA
    assert info.built_for["sources"] == _build_config.source_digest(os.path.join(ROOT, "csrc"))
    out = subprocess.run(
        [sys.executable, "-m", "ampfused"], capture_output=True, text=True, check=True
    ).stdout
    assert "installed with the package" in out
    assert f"built for       torch {torch.__version__}" in out


def test_stale_installed_build_is_named_and_aot_refuses(tmp_path):
    pkg = package_copy(tmp_path, True)
    record = dict(_build_config.record(torch, False, None, "x"), torch="2.0.0")
    with open(os.path.join(pkg, "ampfused", _build_config.RECORD_NAME), "w") as f:
        json.dump(record, f)
    auto = run_child(
        tmp_path, "import ampfused; assert not ampfused.KERNELS; print('CHILD OK')", pkg=pkg
    )
    assert_ok(auto)
    assert (
        f"were built for torch 2.0.0 (CUDA {torch.version.cuda}); this is torch {torch.__version__}"
        in auto.stderr
    )
    assert "no C++ compiler" in auto.stderr
    aot = run_child(tmp_path, "import ampfused", pkg=pkg, AMPFUSED_BUILD="aot")
    assert aot.returncode != 0
    assert "were built for torch 2.0.0" in aot.stderr and "--no-build-isolation" in aot.stderr


# --------------------------------------------------------------------------------------------
# The build cache: one builder per key, hits run no tool, a failure is kept with its log

CACHE_CHILD = """
import os, sys, time
import ampfused
from ampfused import _extension

mode, peers = sys.argv[1], int(sys.argv[2])
cache = os.environ["AMPFUSED_CACHE_DIR"]
calls = os.path.join(cache, "compiles")
os.makedirs(cache, exist_ok=True)
open(os.path.join(cache, f"arrived-{os.getpid()}"), "w").close()


def fake_compile(csrc, build_dir, with_cuda, arch_list):
    with open(calls, "a") as f:
        f.write("x")
    open(os.path.join(build_dir, "one.o"), "w").close()  # a step done: the progress says so
    # hold the lock until every peer has arrived (and had a moment to reach the lock)
    deadline = time.time() + 60
    while len([n for n in os.listdir(cache) if n.startswith("arrived-")]) < peers:
        assert time.time() < deadline, "a peer never arrived"
        time.sleep(0.05)
    time.sleep(2.0)
    if mode == "fail":
        raise RuntimeError("Error building extension '_C': a compiler error")
    open(os.path.join(build_dir, "_C.so"), "w").close()
    return "built"


_extension._compile = fake_compile
_extension._toolchain_problem = lambda with_cuda: None


def fake_import(path):
    if mode == "broken":
        raise ImportError(f"{path}: invalid ELF header")
    return "loaded " + path


_extension._import = fake_import
try:
    print("RESULT", _extension._cached(), _extension.STATUS.origin)
except _extension._BuildProblem as e:
    print("RESULT failed:", e)
"""


def cache_children(tmp_path, mode: str, count: int) -> list[subprocess.CompletedProcess]:
    env = dict(os.environ, AMPFUSED_CACHE_DIR=str(tmp_path / "cache"), AMPFUSED_NO_CUDA="1")
    code = textwrap.dedent(CACHE_CHILD)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, mode, str(count)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(count)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def compiles(tmp_path) -> int:
    path = tmp_path / "cache" / "compiles"
    return len(path.read_text()) if path.exists() else 0


def test_cache_one_process_builds_the_others_wait_then_hits(tmp_path):
    results = cache_children(tmp_path, "ok", 2)
    text = "".join(r.stdout + r.stderr for r in results)
    assert compiles(tmp_path) == 1, text
    assert text.count("compiling the kernels") == 1 and text.count("waiting for another") == 1
    origins = sorted(r.stdout.split("RESULT ")[1].split()[-1] for r in results)
    assert origins == ["cache", "compiled"], text
    (builder,) = [r.stderr for r in results if r.stdout.endswith("compiled\n")]
    assert "ampfused: compiling, 1 of " in builder and "ampfused: compiled in 0:0" in builder
    (record,) = (tmp_path / "cache").glob(f"*/{_build_config.RECORD_NAME}")
    assert json.loads(record.read_text())["compile_cpu_seconds"] >= 0
    # a later import: a hit, without the lock or any tool
    (hit,) = cache_children(tmp_path, "fail", 1)
    assert compiles(tmp_path) == 1 and "RESULT loaded" in hit.stdout, hit.stdout + hit.stderr
    assert "ampfused:" not in hit.stderr


def test_cache_failed_build_keeps_its_log_and_is_not_retried_by_waiters(tmp_path):
    results = cache_children(tmp_path, "fail", 2)
    text = "".join(r.stdout + r.stderr for r in results)
    assert compiles(tmp_path) == 1, text  # the waiter takes the failure it waited for
    assert text.count("RESULT failed: compiling them failed") == 2, text
    (log,) = (tmp_path / "cache").glob("*/build.log")
    assert "a compiler error" in log.read_text()
    assert not list((tmp_path / "cache").glob(f"*/{_build_config.RECORD_NAME}"))
    # a fresh import tries again
    cache_children(tmp_path, "fail", 1)
    assert compiles(tmp_path) == 2


def test_cache_build_that_does_not_load_is_compiled_again(tmp_path):
    cache_children(tmp_path, "ok", 1)
    (broken,) = cache_children(tmp_path, "broken", 1)
    assert compiles(tmp_path) == 2, broken.stdout + broken.stderr
    assert "do not load" in broken.stderr and "invalid ELF header" in broken.stderr
    assert "RESULT built compiled" in broken.stdout


def test_unusable_cache_falls_back_with_the_reason(tmp_path):
    """A cache folder that cannot be made (read-only home, a bad AMPFUSED_CACHE_DIR): import
    still works, on torch's scaler, and says why."""
    proc = run_child(
        tmp_path,
        """
        import ampfused
        assert not ampfused.KERNELS
        text = str(ampfused.info())
        assert "is not usable" in text and "AMPFUSED_CACHE_DIR" in text
        print("CHILD OK")
        """,
        pkg=package_copy(tmp_path, False),
        hide_compiler=False,
        AMPFUSED_CACHE_DIR="/proc/ampfused-cache",
        AMPFUSED_NO_CUDA="1",
    )
    assert_ok(proc)
    assert "KernelsUnavailableWarning" in proc.stderr


def test_cache_key_follows_sources_torch_and_archs(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(ROOT, "csrc"), csrc)
    key = _extension._key(str(csrc), True, "9.0")
    assert _extension._key(str(csrc), True, "9.0") == key
    assert _extension._key(str(csrc), True, "8.0;9.0") != key
    assert _extension._key(str(csrc), False, None) != key
    (csrc / "unscale_math.h").write_text((csrc / "unscale_math.h").read_text() + "\n// edit\n")
    assert _extension._key(str(csrc), True, "9.0") != key
    # host_cuda/ is the tests' layer, not part of the extension
    (csrc / "host_cuda" / "runtime.h").write_text("// edit\n")
    edited = _extension._key(str(csrc), True, "9.0")
    assert _extension._key(str(csrc), True, "9.0") == edited


@pytest.mark.parametrize(
    "arch_list, ok", [("9.0", True), ("7.0;8.0+PTX", True), ("6.1;9.0", False), ("Hopper", True)]
)
def test_arch_list_check(arch_list, ok):
    problem = _build_config.arch_list_problem(arch_list)
    assert (problem is None) == ok, problem
    if not ok:
        assert "6.1" in problem and "AMPFUSED_NO_CUDA=1" in problem


# --------------------------------------------------------------------------------------------
# The first import's compile: the estimate it announces, the progress it shows


def estimate(monkeypatch, cores: int, load: float, max_jobs: str | None = None, cuda_archs=0):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    if max_jobs is None:
        monkeypatch.delenv("MAX_JOBS", raising=False)
    else:
        monkeypatch.setenv("MAX_JOBS", max_jobs)
    return _extension._compile_estimate(cuda_archs > 0, cuda_archs, steps=16)


def test_compile_estimate_shares_the_cores_with_the_load(monkeypatch):
    """Idle, the compilers get the cores (ninja runs 3 at once on 2); beside other work, their
    fair share of them, under one core once the load passes the cores, so the estimate keeps
    growing with the load and never says "1 cores"."""
    idle = estimate(monkeypatch, cores=2, load=0.0)
    assert idle.share == 2 and idle.minutes == pytest.approx(_extension._CPU_CORE_MINUTES / 2)
    assert idle.text() == f"about 2 min ({_extension._CPU_CORE_MINUTES:g} CPU-minutes over 2 cores)"
    half = estimate(monkeypatch, cores=2, load=1.0)
    assert half.share == pytest.approx(1.5)  # 3 compilers and 1 other process on 2 cores
    loaded = [estimate(monkeypatch, cores=2, load=load) for load in (3.0, 4.0, 6.0)]
    assert [e.share for e in loaded] == pytest.approx([1.0, 6 / 7, 2 / 3])
    assert loaded[0].minutes < loaded[1].minutes < loaded[2].minutes
    text = loaded[1].text()
    assert text.startswith("about 4 min (3.5 CPU-minutes; beside a load average of 4.0 on 2 ")
    assert text.endswith("it gets 0.9 of a core)"), text
    assert "1 cores" not in loaded[0].text() and "it gets 1 core)" in loaded[0].text()
    # MAX_JOBS caps the compilers; a bad value is ninja's to refuse, the default stands here
    assert estimate(monkeypatch, cores=8, load=0.0, max_jobs="1").text().endswith("over 1 core)")
    assert estimate(monkeypatch, cores=2, load=0.0, max_jobs="many").share == 2
    assert estimate(monkeypatch, cores=2, load=0.0, cuda_archs=2).cpu_minutes == pytest.approx(
        _extension._CPU_CORE_MINUTES + 2 * _extension._CUDA_CORE_MINUTES_PER_ARCH
    )


def test_install_md_quotes_the_estimates_figures():
    text = " ".join(open(os.path.join(ROOT, "docs", "install.md")).read().split())
    quoted = (
        f"{_extension._CPU_CORE_MINUTES:g} CPU-minutes for the CPU kernels and "
        f"{_extension._CUDA_CORE_MINUTES_PER_ARCH:g} per CUDA arch"
    )
    assert quoted in text, quoted


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def touch(path, age: float = 0.0) -> None:
    path.write_text("")
    if age:
        os.utime(path, (time.time() - age, time.time() - age))


def test_compile_progress_counts_the_steps_written(tmp_path):
    """Without a compiler: object files appear in the build folder and the reporter's thread
    says so, a line per finished step (not a terminal), each counting the steps written since
    the build began; an object left from an earlier build does not count."""
    touch(tmp_path / "stale.o", age=3600)
    out = io.StringIO()
    with _extension._Progress(str(tmp_path), 4, 240.0, stream=out, interval=0.01):
        for name in ("a.o", "b.cuda.o", "_C.so"):
            before = out.getvalue().count("\n")
            touch(tmp_path / name)
            deadline = time.time() + 10
            while out.getvalue().count("\n") == before and time.time() < deadline:
                time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert [int(line.split(", ")[1].split()[0]) for line in lines] == [1, 2, 3], lines
    assert lines[0].startswith("ampfused: compiling, 1 of 4 steps done, 0:0"), lines
    assert lines[0].endswith("so far (about 4 min expected)"), lines


def test_compile_progress_heartbeat_and_terminal(tmp_path):
    """With no step finishing, a line every heartbeat (a log shows the build alive); on a
    terminal, one line rewritten in place and ended when the build ends."""
    log = _extension._Progress(str(tmp_path), 3, 60.0, stream=io.StringIO(), heartbeat=30.0)
    log.last_done, log.last_line = 0, log.began
    log.tick(now=log.began + 10)
    assert log.stream.getvalue() == ""
    log.tick(now=log.began + 31)
    assert log.stream.getvalue() == "ampfused: compiling, 0 of 3 steps done, 0:31 so far " + (
        "(about 1 min expected)\n"
    )
    with _extension._Progress(str(tmp_path), 3, 60.0, stream=Terminal(), interval=3600) as tty:
        tty.tick(now=tty.began + 65)
        touch(tmp_path / "a.o")
        tty.tick(now=tty.began + 66)
    text = tty.stream.getvalue()
    assert text.startswith("\rampfused: compiling, 0 of 3 steps done, 1:05 so far"), repr(text)
    assert "\rampfused: compiling, 1 of 3 steps done, 1:06" in text and text.endswith("\x1b[K\n")
    assert text.count("\n") == 1


# --------------------------------------------------------------------------------------------
# Without torch: the error says what to install

HIDE_TORCH = """
import sys


class HideTorch:
    # A Python where torch is not installed: the import system's own error for a missing module.
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, HideTorch())
"""


@pytest.mark.parametrize("command", [["-c", "import ampfused"], ["-m", "ampfused"]])
def test_without_torch_import_says_what_to_install(tmp_path, command):
    (tmp_path / "sitecustomize.py").write_text(HIDE_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    proc = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, env=env, cwd=str(tmp_path)
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ampfused needs PyTorch"), proc.stderr
    assert "install torch (2.11 to 2.14) first, with `pip install torch`" in last, last
    assert "pytorch.org/get-started" in last and sys.executable in last, last


def test_cuda_build_of_torch_without_a_gpu_compiles_the_cpu_kernels(monkeypatch):
    """The README's common case: a CUDA build of torch (PyPI's Linux wheels), a toolkit perhaps,
    no GPU and no TORCH_CUDA_ARCH_LIST: the CPU kernels only, saying how to get the CUDA ones."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(_extension, "_gpu_archs", lambda: [])
    for name in ("TORCH_CUDA_ARCH_LIST", "AMPFUSED_NO_CUDA"):
        monkeypatch.delenv(name, raising=False)
    with_cuda, arch_list, why = _extension._cuda_plan()
    assert (with_cuda, arch_list) == (False, None)
    assert why.startswith(
        "no GPU of compute capability 7.0+ visible and TORCH_CUDA_ARCH_LIST unset"
    )
    assert "set it, e.g. to 9.0" in why
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert _extension._cuda_plan() == (True, "9.0", None)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(_extension, "_gpu_archs", lambda: ["6.1", "8.0"])  # a display GPU too
    assert _extension._cuda_plan() == (True, "8.0", None)
