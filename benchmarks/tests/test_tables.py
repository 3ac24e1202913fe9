"""The suite without its optional packages: tables drawn by report.tabulate (the same text as
the tabulate package's), no plots without matplotlib, a line per question without tqdm, the
transformers models skipped without transformers; each said at the start and in the notes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.report import tabulate

REPO = Path(__file__).resolve().parents[2]
ATOMS = ["a", "bb", "µs", "1.25x", "-", "3,000", "GPT-2 124M", "|", "x"]


def _text(rng: random.Random, newlines: bool) -> str:
    words = [rng.choice(ATOMS) for _ in range(rng.randint(0, 4))]
    seps = [" ", "  ", "\n" if newlines else " "]
    text = "".join(
        w + (rng.choice(seps) if i < len(words) - 1 else "") for i, w in enumerate(words)
    )
    return (" " if rng.random() < 0.1 else "") + text + (" " if rng.random() < 0.1 else "")


def _cell(rng: random.Random, newlines: bool) -> object:
    r = rng.random()
    if r < 0.05:
        return None
    if r < 0.15:
        return rng.choice([0, 858, 3000, 0.5, 2.25, 1e-6])
    return _text(rng, newlines)


@pytest.mark.parametrize("tablefmt", ["github", "simple"])
def test_tables_are_tabulates_text(tablefmt: str) -> None:
    """report.tabulate against the tabulate package, on random tables of the suite's kinds of
    cells: words, numbers, None, runs of spaces, multiline cells and headers, empty rows."""
    real = pytest.importorskip("tabulate").tabulate
    rng = random.Random(0)
    for _ in range(400):
        newlines = rng.random() < 0.5
        ncol = rng.randint(1, 5)
        headers = [_text(rng, newlines) or "h" for _ in range(ncol)]
        rows = [[_cell(rng, newlines) for _ in range(ncol)] for _ in range(rng.randint(0, 5))]
        expected = real(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)
        assert tabulate(rows, headers, tablefmt) == expected, (headers, rows)
    with pytest.raises(ValueError, match="tablefmt='grid'"):
        tabulate([["a"]], ["h"], "grid")


HIDDEN = ("tabulate", "matplotlib", "tqdm", "transformers")

WITHOUT_CHILD = """
import sys
from pathlib import Path

import torch

import benchmarks.__main__ as suite_main
from benchmarks import policy
from benchmarks.suite import Context
from benchmarks.tests import rec
from benchmarks.timing import QUICK_TIMING

out = Path(sys.argv[1])


def fake(run, q):
    run.records += [rec("ampfused", 100.0), rec("torch", 300.0), rec("floor-mul", 200.0)]


suite_main.run_question = fake
assert suite_main.main(["--only", "counts", "--device", "cpu", "--out", str(out)]) == 0

form = policy.Form({"gpt2-tiny": 8, "mlp-teacher": 12}, 6, 4, 3, 3, ())
ctx = Context(device=torch.device("cpu"), timing=QUICK_TIMING, methods=[], quick=True)
result = policy.run(ctx, form, policies=policy.POLICIES[:2])
assert list(result["tasks"]) == ["mlp-teacher"], result["tasks"]
assert ctx.notes == ["policy: gpt2-tiny skipped (transformers is not installed)"], ctx.notes
print(policy.text(result, "simple"))
print("CHILD OK")
"""


def test_suite_runs_without_its_optional_packages(tmp_path: Path) -> None:
    """With tabulate, matplotlib, tqdm and transformers hidden, `python -m benchmarks` (its
    questions faked) prints and writes its tables, says what each missing package costs, and
    the policy question trains the model it can."""
    hide = f"""
import sys
from importlib.machinery import PathFinder

HIDDEN = {HIDDEN!r}


class Hide:  # the path finder, blind to these packages: as in a Python without them
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return PathFinder.find_spec(name, path, target)

    @classmethod
    def invalidate_caches(cls):
        PathFinder.invalidate_caches()


sys.meta_path[:] = [Hide if finder is PathFinder else finder for finder in sys.meta_path]
"""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(hide))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_CHILD, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO),
        timeout=600,
    )
    assert proc.returncode == 0 and "CHILD OK" in proc.stdout, proc.stdout + proc.stderr
    for line in (
        "python -m benchmarks: matplotlib is not installed: no plots (the tables only) "
        "(pip install matplotlib)",
        "python -m benchmarks: tqdm is not installed: no progress bar (a line per question "
        "instead) (pip install tqdm)",
        "counts (0 of ",
    ):
        assert line in proc.stderr, proc.stderr
    assert "transformers" not in proc.stderr.split("counts (0 of")[0]  # counts needs none
    md = (tmp_path / "run" / "results.md").read_text()
    assert "| field " in md and "## Tensor-count sweep" in md
    assert "matplotlib is not installed: no plots" in md  # a note of the run
    assert not list((tmp_path / "run").glob("*.png"))
    assert "mlp-teacher" in proc.stdout and "torch default" in proc.stdout  # policy's table
