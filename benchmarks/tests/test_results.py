"""results.jsonl round trip, ``python -m benchmarks.compare`` flagging (and failing on)
ampfused rows slower beyond noise, and ``python -m benchmarks`` writing its files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import benchmarks.__main__ as suite_main
from benchmarks import compare
from benchmarks.suite import derive
from benchmarks.tests import rec

RUN = {"header": {"git_commit": "abc123", "device_name": "test CPU"}, "command": "x"}


def e2e_result(ampfused_ms: float, steps: int = 30) -> dict:
    """torch's step 10 ms, ampfused's as given, IQRs 1 ms."""

    def one(scaler: str, ms: float) -> dict:
        return {
            "scaler": scaler,
            "median_step_s": ms / 1e3,
            "q1_s": ms / 1e3 - 5e-4,
            "q3_s": ms / 1e3 + 5e-4,
        }

    runs = {"torch/adamw": one("torch", 10.0), "ampfused/adamw": one("ampfused", ampfused_ms)}
    return {"config": {"steps": steps}, "runs": runs, "comparisons": {}}


def save(tmp_path: Path, name: str, records: list, e2e: dict | None = None) -> Path:
    (tmp_path / name).mkdir()
    return compare.write(tmp_path / name, RUN, records, e2e)


def test_round_trip_keeps_the_measurements(tmp_path: Path) -> None:
    recs = [
        rec("ampfused", 123.456789),
        rec("torch", 400.0),
        rec("floor-mul", 200.0),
        rec("naive", 0.0, status="error", note="RuntimeError: boom"),
        rec("ampfused", 50.0, workload="1 x 16", realloc=True, pointer_change_rate=0.25),
    ]
    derive(recs[:4])
    path = save(tmp_path, "run", recs, e2e_result(10.2))
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(recs) + 1  # run line, one per record, e2e line
    assert '"speedup_vs_torch"' not in lines[1]  # ratios are recomputed on loading
    back = compare.load(tmp_path / "run")
    assert back["run"]["header"]["git_commit"] == "abc123"
    assert back["e2e"]["runs"]["torch/adamw"]["q1_s"] == pytest.approx(0.0095)
    for a, b in zip(back["records"], recs, strict=True):
        for f in ("question", "workload", "dtype", "method", "status", "note", "realloc"):
            assert getattr(a, f) == getattr(b, f), f
        for f in ("median_s", "q1_s", "q3_s", "x_floor", "speedup_vs_torch", "gbps"):
            x, y = getattr(a, f), getattr(b, f)
            assert x == pytest.approx(y, rel=1e-3) if y is not None else x is None, f
    assert back["records"][4].pointer_change_rate == 0.25


def test_bad_paths_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        compare.main([str(tmp_path), str(tmp_path)])
    assert e.value.code == 2 and "no such results file" in capsys.readouterr().err
    (tmp_path / "results.jsonl").write_text('{"question": "counts"}\n')
    with pytest.raises(ValueError, match="not a benchmarks results file"):
        compare.load(tmp_path)
    save(tmp_path, "ok", [rec("ampfused", 10.0)])
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path / "ok"), str(tmp_path / "ok"), "--relative-to", "torch"])
    assert "--relative-to torch: OLD has no such method" in capsys.readouterr().err


def run_compare(tmp_path: Path, old: list, new: list, *argv: str, e2e=(None, None)) -> int:  # noqa: ANN001
    for name in ("old", "new"):
        shutil.rmtree(tmp_path / name, ignore_errors=True)
    save(tmp_path, "old", old, e2e[0])
    return compare.main([str(tmp_path / "old"), str(save(tmp_path, "new", new, e2e[1])), *argv])


@pytest.mark.parametrize(
    ("new_us", "iqr_us", "slower"),
    [
        (100.0, 2.0, False),  # the same
        (120.0, 2.0, True),  # 20% slower, quartiles far apart
        (104.0, 2.0, False),  # apart, but within 5%
        (120.0, 30.0, False),  # 20% slower, NEW's Q1 below OLD's Q3: within the noise
        (80.0, 2.0, False),  # faster
    ],
)
def test_ampfused_slower_beyond_noise_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], new_us: float, iqr_us: float, slower: bool
) -> None:
    old = [rec("ampfused", 100.0, iqr_us), rec("torch", 300.0)]
    new = [rec("ampfused", new_us, iqr_us), rec("torch", 300.0)]
    assert run_compare(tmp_path, old, new) == int(slower)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "ampfused" in line and "10 x 16" in line)
    assert ("SLOWER" in row) is slower and f"{new_us / 100:.3f}" in row
    assert "2 rows in both runs" in out
    summary = "1 slower beyond noise, 1 of them ampfused (counts 10 x 16 fp32 ampfused)"
    assert (summary in out) is slower


def test_torch_drift_and_relative_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = [rec("ampfused", 100.0), rec("torch", 300.0)]
    assert run_compare(tmp_path, old, [rec("ampfused", 100.0), rec("torch", 400.0)]) == 0
    out = capsys.readouterr().out
    assert "1 slower beyond noise, 0 of them ampfused" in out
    assert "torch rows' median new/old 1.333" in out
    old += [rec("ampfused", 100.0, workload="1 x 16"), rec("torch", 300.0, workload="1 x 16")]
    # A machine twice as slow, and ampfused 1.5x slower still on 1 x 16.
    new = [rec("ampfused", 200.0), rec("torch", 600.0), rec("ampfused", 300.0, workload="1 x 16")]
    new.append(rec("torch", 600.0, workload="1 x 16"))
    assert run_compare(tmp_path, old, new) == 1
    assert "4 slower beyond noise, 2 of them ampfused" in capsys.readouterr().out
    assert run_compare(tmp_path, old, new, "--relative-to", "torch") == 1
    out = capsys.readouterr().out
    assert "2 rows in both runs" in out  # torch's own rows are the yardstick
    assert "1 slower beyond noise, 1 of them ampfused (counts 1 x 16 fp32 ampfused)" in out
    row = next(line for line in out.splitlines() if "1 x 16" in line)
    assert "0.333x" in row and "0.500x" in row and "1.500" in row


def test_keys_status_and_e2e(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = [
        rec("ampfused-op", 100.0),
        rec("ampfused", 100.0, workload="1 x 16"),
        rec("ampfused", 100.0, inject_inf=True),  # a different row from the finite one
    ]
    new = [
        rec("ampfused-op", 1.0, status="error", note="RuntimeError: boom"),
        rec("ampfused", 1.0, workload="1 x 16", status="n/a", note="below resolution"),
        rec("ampfused", 300.0),  # not in OLD: no row, whatever its time
        rec("ampfused", 100.0, inject_inf=True),
    ]
    assert run_compare(tmp_path, old, new, e2e=(e2e_result(10.0), e2e_result(12.0))) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "5 rows in both runs (0 only in OLD, 1 only in NEW)" in out
    assert "now error" in next(line for line in lines if "ampfused-op" in line)
    assert "SLOWER" not in next(line for line in lines if "1 x 16" in line)
    assert "SLOWER" in next(line for line in lines if "ampfused/adamw" in line)
    assert "SLOWER" not in next(line for line in lines if "+inf" in line)
    # A --quick run trains another e2e configuration: its rows are left out.
    assert run_compare(tmp_path, old, new, e2e=(e2e_result(10.0, 8), e2e_result(12.0))) == 1
    out = capsys.readouterr().out
    assert "e2e not compared" in out and "ampfused/adamw" not in out


def test_suite_writes_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """main's steps end to end, the questions replaced by fakes (no timing)."""

    def fake(run: suite_main.Run, q: str) -> None:
        if q == "sizes":
            raise RuntimeError("sizes broke")
        run.records += [rec("ampfused", 100.0), rec("torch", 300.0), rec("floor-mul", 200.0)]

    monkeypatch.setattr(suite_main, "run_question", fake)
    argv = ["--only", "counts,sizes", "--device", "cpu", "--no-progress", "--out", str(tmp_path)]
    assert suite_main.main(argv) == 1  # the broken question is an error, the other still ran
    back = compare.load(tmp_path)
    assert back["run"]["errors"] == ["sizes: RuntimeError: sizes broke"]
    assert back["run"]["command"] == "python -m benchmarks " + " ".join(argv)
    assert set(back["run"]["durations_s"]) == {"counts", "sizes"}
    assert [r.method for r in back["records"]] == ["ampfused", "torch", "floor-mul"]
    assert "## Tensor-count sweep" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "counts.png").is_file()
    assert compare.main([str(tmp_path), str(tmp_path / "results.jsonl")]) == 0
