"""The diagnostics question: its methods log what they claim, the Python bytecode count sees
per-parameter host work, the targets judge the right rows, and the suite prints its table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import benchmarks.__main__ as suite_main
from benchmarks import questions as qs
from benchmarks import targets
from benchmarks.methods import METHODS, Runner, select
from benchmarks.suite import Context, derive, python_bytecodes, run_workload
from benchmarks.tests import rec
from benchmarks.timing import TimingConfig
from benchmarks.workloads import Workload, build, uniform

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", ["fp32", "mixed"])
def test_watched_norms_match_the_per_layer_loop(dtype: str) -> None:
    """ampfused-norms and torch-norms log the same keys and norms (within fp32 rounding) of the
    same unscaled gradients; the watched pass unscales as the plain one does."""
    gs = build(Workload("24 x 300", tuple(uniform(24, 300)), dtype), CPU)
    logged = {}
    for name in ("ampfused-norms", "torch-norms", "ampfused-watch"):
        r = METHODS[name].factory(gs)
        gs.restore()
        r.run()
        logged[name] = r.logged
        if name != "ampfused-watch":
            unscaled = [g.clone() for g in gs.grads]
    ours, theirs = logged["ampfused-norms"], logged["torch-norms"]
    assert list(ours) == list(theirs) and len(ours) == 25 and ours["grad_2.0_norm_total"] > 0
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert all(torch.equal(g, u) for g, u in zip(gs.grads, unscaled, strict=True))
    # Like the clip, masters and collective methods, they run only in their question.
    assert {"ampfused-watch", "torch-norms"}.isdisjoint(m.name for m in select(None, CPU))


class Loop(Runner):
    def __init__(self, gs, per_tensor: bool) -> None:  # noqa: ANN001
        self.grads, self.per_tensor = gs.grads, per_tensor

    def run(self) -> None:
        if not self.per_tensor:
            return torch._foreach_mul_(self.grads, 0.5)
        for g in self.grads:
            g.mul_(0.5)


def test_python_bytecodes_see_per_parameter_work() -> None:
    counts = {}
    for n in (10, 100):
        gs = build(Workload("n x 16", tuple(uniform(n, 16))), CPU)
        runners = {"loop": Loop(gs, True), "one": Loop(gs, False)}
        counts[n] = python_bytecodes(gs, runners)
        assert python_bytecodes(gs, runners) == counts[n]  # no timing noise
    assert counts[10]["one"] == counts[100]["one"] > 0
    assert (counts[100]["loop"] - counts[10]["loop"]) / 90 >= 5
    # The real methods: the watched pass's Python work is flat, the per-layer loop's is not.
    timing = TimingConfig(min_rounds=1, enough_rounds=1, max_wall_s=1)
    ctx = Context(device=CPU, timing=timing, methods=[], profile=False)
    code: dict[str, list[int]] = {}
    for n in (20, 200):
        methods = [METHODS[m] for m in qs.DIAG_COUNT_METHODS]
        for r in run_workload(ctx, "diagnostics", qs.diag_count_workload(n), methods, True):
            assert r.ok, r.note
            code.setdefault(r.method, []).append(r.py_bytecodes)
    assert code["ampfused-watch"][0] == code["ampfused-watch"][1]
    assert code["ampfused"][0] == code["ampfused"][1]
    assert code["torch-norms"][1] - code["torch-norms"][0] >= 180 * 5


def records(watch_ms: float, watch_code: list[int]) -> list:
    # The mixed set of the same model first: not what the bound is stated on.
    out = [rec("ampfused", 1e4, 1, workload="gpt2-124m", dtype="mixed", question="diagnostics")]
    for w in ("gpt2-124m", "4 x 16M"):
        for m, ms in (("ampfused", 20.0), ("ampfused-watch", watch_ms), ("torch-norms", 40.0)):
            out.append(rec(m, ms * 1e3, ms * 20, workload=w, question="diagnostics"))
        out.append(rec("ampfused-norms", watch_ms * 1e3 + 500, workload=w, question="diagnostics"))
    for n, code in zip(qs.DIAG_COUNTS, watch_code, strict=True):
        w = qs.diag_count_workload(n).name
        out.append(rec("ampfused", n, workload=w, question="diagnostics"))
        out.append(
            rec("ampfused-watch", 1.1 * n, workload=w, question="diagnostics", py_bytecodes=code)
        )
    derive(out)
    return out


@pytest.mark.parametrize(
    ("watch_ms", "code", "passed"),
    [
        (22.0, [900, 900, 900], [True, True, True]),
        (23.0, [900, 901, 950], [True, True, True]),  # a handful more, not one per parameter
        (23.2, [1000, 1900, 3900], [False, False, False]),  # one bytecode per tensor
        (22.0, [900, 1100, 1500], [True, True, False]),  # one per five tensors
    ],
)
def test_targets(watch_ms: float, code: list[int], passed: list[bool]) -> None:
    results = targets.diagnostics_targets(records(watch_ms, code))
    assert [t.passed for t in results] == passed
    names = ["diagnostics gpt2-124m fp32", "diagnostics 4 x 16M fp32", "diagnostics host cost"]
    assert [t.name for t in results] == names
    assert results[0].value == f"{watch_ms / 20:.3f}x"
    assert f"torch + per-layer norms / watched {40 / watch_ms:.2f}x" in results[0].detail
    assert f"/ watched + grad_norms() {40 / (watch_ms + 0.5):.2f}x" in results[0].detail
    assert results[2].value == " / ".join(map(str, code))
    assert "watched / plain time 1.10x / 1.10x / 1.10x" in results[2].detail
    assert [t.passed for t in targets.diagnostics_targets(records(21.0, code)[:2])] == [None] * 3


def test_16_bit_targets_where_measured() -> None:
    """GPT-2's 16-bit sets get the same bound, on their own dtype's rows, when they ran."""
    recs = records(22.0, [900] * 3)
    for dtype, watch_ms in (("bf16", 11.4), ("fp16", 11.6)):
        for m, ms in (("ampfused", 10.0), ("ampfused-watch", watch_ms)):
            recs.append(rec(m, ms * 1e3, workload="gpt2-124m", dtype=dtype, question="diagnostics"))
    derive(recs)
    results = targets.diagnostics_targets(recs)
    got = {t.name: (t.value, t.passed) for t in results}
    assert got["diagnostics gpt2-124m bf16"] == ("1.140x", True)
    assert got["diagnostics gpt2-124m fp16"] == ("1.160x", False)
    assert got["diagnostics gpt2-124m fp32"] == ("1.100x", True)  # its own rows, not bf16's


def test_suite_prints_the_question(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        suite_main, "run_question", lambda run, q: run.records.extend(records(21.0, [900] * 3))
    )
    argv = ["--only", "diagnostics", "--device", "cpu", "--no-progress", "--no-plots"]
    assert suite_main.main([*argv, "--out", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    for name in ("gpt2-124m fp32", "4 x 16M fp32", "host cost"):
        line = next(x for x in md.splitlines() if x.startswith(f"| diagnostics {name} "))
        assert "| met " in line, line
    assert "## Diagnostics: the pass with per-gradient statistics" in md
    row = next(line for line in md.splitlines() if line.startswith("| gpt2-124m fp32 "))
    assert "1.05x" in row and "1.90x" in row  # watch / ampfused, torch-norms / watch
    assert "**torch-norms**" in md  # the method list
