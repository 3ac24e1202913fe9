"""Where ``python -m benchmarks`` writes: a default run into a git-ignored folder of its own that
its output names, ``--out`` exactly where told, gpu-targets.md only from a GPU run."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import benchmarks.__main__ as suite_main
from benchmarks import compare, env, report
from benchmarks import targets as tg
from benchmarks.suite import Context
from benchmarks.tests import rec
from benchmarks.timing import QUICK_TIMING

ARGV = ["--quick", "--only", "counts", "--device", "cpu", "--no-progress"]
RUNS = env.REPO / "benchmarks" / "runs"  # where benchmarks/README.md says a run writes


def fake_question(run: suite_main.Run, q: str) -> None:
    run.records += [rec("ampfused", 100.0), rec("torch", 300.0), rec("floor-mul", 200.0)]


def files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=env.REPO, capture_output=True, text=True)


def tracked_state() -> dict[str, int]:
    """Every file git tracks under benchmarks/, by its modification time."""
    names = git("ls-files", "-z", "benchmarks").stdout.split("\0")
    return {n: (env.REPO / n).stat().st_mtime_ns for n in names if (env.REPO / n).is_file()}


def test_a_default_run_writes_a_folder_of_its_own_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("git") is None or git("rev-parse", "--git-dir").returncode:
        pytest.skip("not a git checkout")
    monkeypatch.setattr(suite_main, "run_question", fake_question)
    # Where a run that went back to writing into benchmarks/results writes, here, instead of
    # over the committed files.
    monkeypatch.setattr(suite_main, "RESULTS", tmp_path / "results")
    tracked, runs_existed = tracked_state(), RUNS.exists()
    status = git("status", "--porcelain", "--untracked-files=all", "--", "benchmarks").stdout
    assert suite_main.main(ARGV) == 0
    out = capsys.readouterr().out
    named = re.search(r"^output folder: (.+)$", out, re.M)
    assert named, out
    folder = (Path.cwd() / named[1]).resolve()
    try:
        assert folder.parent == RUNS and folder.name.endswith("-cpu-quick")
        assert {"results.jsonl", "results.md", "counts.png"} <= files(folder)
        assert named[1] in out.splitlines()[-1]  # the last line names it too
        ignored = git("check-ignore", "-q", str(folder / "results.jsonl"))
        assert ignored.returncode == 0, "the run's folder is not git-ignored"
        assert tracked_state() == tracked
        after = git("status", "--porcelain", "--untracked-files=all", "--", "benchmarks").stdout
        assert after == status
        assert not (tmp_path / "results").exists()
    finally:
        if folder.is_relative_to(RUNS):
            shutil.rmtree(folder, ignore_errors=True)
            if not runs_existed and not any(RUNS.iterdir()):
                RUNS.rmdir()


@pytest.mark.parametrize("where", ["results/cpu/quick", "elsewhere/new/folder"])
def test_b_out_writes_where_told_and_nowhere_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """A CPU run into benchmarks/results (as results are committed) or anywhere else writes its
    three files there and nothing beside them: no gpu-targets.md, no folder under runs/."""
    monkeypatch.setattr(suite_main, "run_question", fake_question)
    monkeypatch.setattr(suite_main, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(env, "RUNS", tmp_path / "runs", raising=False)
    monkeypatch.chdir(tmp_path)
    assert suite_main.main([*ARGV, "--out", where]) == 0
    assert files(tmp_path) == {
        f"{where}/{n}" for n in ("results.jsonl", "results.md", "counts.png")
    }
    out = capsys.readouterr().out
    assert f"output folder: {where}\n" in out and where in out.splitlines()[-1]
    md = (tmp_path / where / "results.md").read_text()
    assert "GPU targets: see " in md and "## Tensor-count sweep" in md


def gpu_run(tmp_path: Path, out: str, device: str = "cuda", quick: bool = False) -> suite_main.Run:
    """A finished run on ``device`` (no GPU needed: nothing runs), with two GPU targets."""
    dev = torch.device(device)
    args = argparse.Namespace(quick=quick, no_plots=True)
    ctx = Context(device=dev, timing=QUICK_TIMING, methods=[], quick=quick)
    hdr = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda_runtime": "13.0"}
    hdr |= {"git_commit": "abc123", "date": "2026-11-27 12:00 UTC"}
    run = suite_main.Run(args, dev, tmp_path / out, ["step_cost"], "python -m benchmarks", ctx, hdr)
    run.out.mkdir(parents=True, exist_ok=True)  # as environment() makes it
    run.gpu_t = [
        tg.TargetResult("bandwidth", tg.BANDWIDTH, "93%", True, "worst: sizes:8 x 2^28 fp32"),
        tg.TargetResult("many tensors", tg.MANY, "1.88x", False, "worst: step_cost:3000 x 16"),
    ]
    return run


def test_gpu_targets_only_from_a_gpu_run_inside_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(suite_main, "RESULTS", tmp_path / "results")
    path = tmp_path / "results" / "gpu-targets.md"
    for device, out in (("cpu", "results/cpu"), ("cuda", "runs/x"), ("cuda", "elsewhere")):
        run = gpu_run(tmp_path, out, device)
        if device == "cpu":
            run.cpu_t, run.gpu_t = run.gpu_t, None
        suite_main.write_gpu_targets(run)
        assert not path.exists(), (device, out)
    suite_main.write_gpu_targets(gpu_run(tmp_path, "results/nvidia-h100"))
    text = path.read_text()
    # It reads on its own: nothing "above" it, every column named, the run's figures linked.
    assert "above" not in text
    assert "| target | verdict | measured | requirement | detail |" in re.sub(r" +", " ", text)
    assert "1 of 2 met on NVIDIA H100 80GB HBM3" in text
    assert "[nvidia-h100/results.md](nvidia-h100/results.md)" in text
    assert "| not met " in text and "FAIL" not in text
    # A --quick run does not replace a measurement; it does replace the placeholder.
    suite_main.write_gpu_targets(gpu_run(tmp_path, "results/nvidia-h100/quick", quick=True))
    assert path.read_text() == text
    path.write_text("# GPU targets\n\nNot yet measured: no GPU run so far.\n")
    suite_main.write_gpu_targets(gpu_run(tmp_path, "results/nvidia-h100/quick", quick=True))
    assert "(nvidia-h100/quick/results.md)" in path.read_text()


# --------------------------------------------------------------------------- what it prints
def committed_run(folder: str) -> suite_main.Run:
    """A run rebuilt from committed results (benchmarks/results/<folder>), its targets
    recomputed: what the console printed for it, as the code prints it now."""
    back = compare.load(env.RESULTS / folder)
    hdr = back["run"]["header"]
    dev = torch.device("cuda" if hdr["device"].startswith("cuda") else "cpu")
    args = argparse.Namespace(quick=True, no_plots=True)
    ctx = Context(device=dev, timing=QUICK_TIMING, methods=[], quick=True)
    questions = list(dict.fromkeys(r.question for r in back["records"]))
    run = suite_main.Run(args, dev, env.RESULTS / folder, questions, "x", ctx, hdr)
    run.records, run.e2e = back["records"], back["e2e"]
    run.errors = ["sizes: RuntimeError: a long error message " + "word " * 30]
    if run.gpu:
        run.gpu_t = tg.gpu_targets(run.records, run.e2e)
    else:
        run.cpu_t = tg.cpu_targets(run.records, run.questions)
    return run


RULE = re.compile(r"^-+(  +-+)*$")
PIPE_RULE = re.compile(r"^\|(:?-+:?\|)+$")
# A word of one letter, or of single letters joined by slashes ("n", "a/t", "x floor"): a code
# the reader has to guess, not a name.
CODE = re.compile(r"^[a-z](/[a-z])*$")


def console_headers(text: str) -> list[str]:
    """Each console table's column headers: the text above each run of dashes in the rule, on
    the lines between the rule and the blank line or title above it."""
    lines, out = text.split("\n"), []
    for i, rule in enumerate(lines):
        if not RULE.match(rule):
            continue
        top = i
        while top > 0 and lines[top - 1].strip() and not lines[top - 1].startswith("=="):
            top -= 1
        for m in re.finditer(r"-+", rule):
            out.append(" ".join(x[m.start() : m.end()].strip() for x in lines[top:i]).strip())
    return out


def markdown_headers(text: str) -> list[str]:
    lines = text.split("\n")
    return [
        cell.strip()
        for head, rule in zip(lines, lines[1:], strict=False)
        if PIPE_RULE.match(rule.replace(" ", ""))
        for cell in head.strip().strip("|").split("|")
    ]


def unnamed(headers: list[str]) -> list[str]:
    """The headers without a name in words: empty, no word of two letters, or with a code."""
    return [
        h
        for h in headers
        if not re.search("[A-Za-z]{2}", h) or any(CODE.match(w) for w in h.split())
    ]


@pytest.mark.parametrize("folder", ["cpu", "cpu/quick", "nvidia-h100/quick"])
def test_d_every_column_named_and_no_console_line_wider_than_100(folder: str) -> None:
    run = committed_run(folder)
    console = "\n".join(
        f"== {t} ==\n{b}\n" if t else b for t, b in suite_main.sections(run, "simple")
    )
    headers = console_headers(console)
    assert len(headers) > 50 and "gradients" in headers and "verdict" in headers
    assert unnamed(headers) == []
    wide = [line for line in console.split("\n") if len(line) > 100]
    assert wide == [], f"{len(wide)} console lines wider than 100 columns, first: {wide[0]}"
    markdown = "\n".join(b for _, b in suite_main.sections(run, "github"))
    headers = markdown_headers(markdown)
    assert len(headers) > 50 and "samples" in headers
    assert unnamed(headers) == []


def test_d_the_checks_see_an_unnamed_column() -> None:
    text = report.grid([["a", "1", "2"]], ["gradients", "", "ops a/t"], "simple")
    assert unnamed(console_headers("== t ==\n" + text)) == ["", "ops a/t"]
    text = report.grid([["a", "1", "2"]], ["gradients", "n", "ampfused x floor"], "github")
    assert unnamed(markdown_headers(text)) == ["n", "ampfused x floor"]


def test_comparison_lines_do_not_contradict_themselves() -> None:
    """Slower within noise is counted as slower, and a ratio below 1 does not print as 1.00x."""
    recs = [rec("ampfused", 100.0, 40.0), rec("torch", 99.9, 40.0)]  # slower, within noise
    recs += [rec(m, us, workload="1 x 16") for m, us in (("ampfused", 10.0), ("torch", 30.0))]
    (line,) = report.comparisons(recs, None)
    assert "faster than torch on 1 of 2 gradient sets, slower on 1 (0 of them beyond noise)" in line
    assert "torch takes 0.999x to 3.00x the time of ampfused" in line
