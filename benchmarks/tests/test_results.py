"""The results files and their readers: the compact form keeps what the full one measured,
``python -m benchmarks.compare`` flags (and fails on) ampfused rows slower beyond noise, and
``python -m benchmarks`` writes both forms through its named steps.

    python -m pytest benchmarks/tests -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.__main__ as suite_main
from benchmarks import compare
from benchmarks.suite import Record, derive

US = 1e-6


def rec(method: str, median_us: float, iqr_us: float = 2.0, **kw) -> Record:  # noqa: ANN003
    """A counts-question record of ``method``, median and IQR in microseconds."""
    r = Record(
        question=kw.pop("question", "counts"),
        workload=kw.pop("workload", "10 x 16"),
        family="count",
        dtype=kw.pop("dtype", "fp32"),
        inject_inf=kw.pop("inject_inf", False),
        n_tensors=10,
        numel=160,
        grad_bytes=640,
        method=method,
        kind={"torch": "scaler", "floor-mul": "floor"}.get(method, "scaler"),
        samples=11,
        **kw,
    )
    if r.status == "ok":
        r.median_s = median_us * US
        r.q1_s, r.q3_s = r.median_s - iqr_us / 2 * US, r.median_s + iqr_us / 2 * US
        r.bytes_moved, r.gbps = 1280, 1280 / r.median_s / 1e9
    return r


def payload(records: list[Record], e2e: dict | None = None) -> dict:
    """A results.json payload as the suite writes it (only what the readers use)."""
    return {
        "header": {"git_commit": "abc123", "device_name": "test CPU", "torch": "2.x"},
        "command": "python -m benchmarks",
        "quick": False,
        "notes": ["a note only the full form keeps"],
        "records": [r.to_json() for r in records],
        "e2e": e2e,
    }


def e2e_result(ampfused_ms: float, steps: int = 30) -> dict:
    """The e2e question's result: torch's step 10 ms, ampfused's as given, IQRs 1 ms."""

    def one(scaler: str, ms: float) -> dict:
        s = ms * 1e-3
        return {"scaler": scaler, "median_step_s": s, "q1_s": s - 5e-4, "q3_s": s + 5e-4}

    runs = {"torch/adamw": one("torch", 10.0), "ampfused/adamw": one("ampfused", ampfused_ms)}
    return {"config": {"steps": steps}, "runs": runs, "comparisons": {}}


def save(tmp_path: Path, name: str, records: list[Record], form: str, **kw) -> Path:  # noqa: ANN003
    """Writes a run in the full ("json") or compact ("jsonl") form; returns the file."""
    folder = tmp_path / name
    folder.mkdir()
    compare.write(folder, payload(records, **kw))
    keep = folder / f"results.{form}"
    for other in folder.iterdir():
        if other != keep:
            other.unlink()
    return keep


# --------------------------------------------------------------------------- compact form
def test_compact_form_keeps_the_measurements(tmp_path: Path) -> None:
    recs = [
        rec("ampfused", 123.456789),
        rec("torch", 400.0),
        rec("floor-mul", 200.0),
        rec("naive", 0.0, status="error", note="RuntimeError: boom"),
        rec("ampfused", 50.0, workload="1 x 16", realloc=True, pointer_change_rate=0.25),
    ]
    derive(recs[:4])
    e2e = e2e_result(10.2)
    full = compare.load(save(tmp_path, "full", recs, "json", e2e=e2e))
    compact_path = save(tmp_path, "compact", recs, "jsonl", e2e=e2e)
    compact = compare.load(compact_path)
    lines = compact_path.read_text().splitlines()
    assert len(lines) == 1 + len(recs) + 1  # run line, one per record, e2e line
    assert "a note only the full form keeps" not in compact_path.read_text()
    assert compact["run"]["header"]["git_commit"] == "abc123"
    assert compact["e2e"]["config"] == e2e["config"]
    for name, run in e2e["runs"].items():
        assert compact["e2e"]["runs"][name]["scaler"] == run["scaler"]
        assert compact["e2e"]["runs"][name]["q1_s"] == pytest.approx(run["q1_s"], rel=1e-3)
    for a, b, orig in zip(full["records"], compact["records"], recs, strict=True):
        for f in ("question", "workload", "dtype", "method", "status", "note", "realloc"):
            assert getattr(a, f) == getattr(b, f) == getattr(orig, f), f
        for f in ("median_s", "q1_s", "q3_s", "x_floor", "speedup_vs_torch", "gbps"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) is (y is None) is (getattr(orig, f) is None), f
            if x is not None:
                assert y == pytest.approx(x, rel=1e-3), f  # 4 significant digits
    # The ratios are not stored but recomputed on loading: 400 / 123.5 us.
    assert '"speedup_vs_torch"' not in lines[1]
    assert compact["records"][0].speedup_vs_torch == pytest.approx(400 / 123.456789, rel=1e-3)
    assert compact["records"][4].pointer_change_rate == 0.25


def test_folder_prefers_the_full_form_and_names_what_is_missing(tmp_path: Path) -> None:
    compare.write(tmp_path, payload([rec("ampfused", 10.0)]))
    assert compare.resolve(tmp_path).name == "results.json"
    (tmp_path / "results.json").unlink()
    assert compare.resolve(tmp_path).name == "results.jsonl"
    (tmp_path / "results.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="no results.json or results.jsonl"):
        compare.resolve(tmp_path)
    (tmp_path / "results.jsonl").write_text('{"question": "counts"}\n')
    with pytest.raises(ValueError, match="not a benchmarks results file"):
        compare.load(tmp_path)


# --------------------------------------------------------------------------- compare
def run_compare(
    tmp_path: Path,
    old: list[Record],
    new: list[Record],
    old_e2e: dict | None = None,
    new_e2e: dict | None = None,
    argv: tuple[str, ...] = (),
) -> int:
    """compare's exit status on OLD (a folder, full form) vs NEW (a compact file)."""
    a = save(tmp_path, "old", old, "json", e2e=old_e2e)
    b = save(tmp_path, "new", new, "jsonl", e2e=new_e2e)
    return compare.main([str(a.parent), str(b), *argv])


def test_same_run_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [rec("ampfused", 100.0), rec("torch", 300.0)]
    assert run_compare(tmp_path, recs, recs) == 0
    out = capsys.readouterr().out
    assert "2 rows in both runs" in out and "0 slower beyond noise" in out
    assert "SLOWER" not in out


@pytest.mark.parametrize(
    ("new_us", "iqr_us", "slower"),
    [
        (120.0, 2.0, True),  # 20% slower, quartiles far apart
        (104.0, 2.0, False),  # apart, but within 5%
        (120.0, 60.0, False),  # 20% slower, within the noise of both runs
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
    assert ("SLOWER" in row) is slower
    assert f"{new_us / 100:.3f}" in row
    summary = "1 slower beyond noise, 1 of them ampfused (counts 10 x 16 fp32 ampfused)"
    assert (summary in out) is slower


def test_only_torch_slower_is_flagged_but_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = [rec("ampfused", 100.0), rec("torch", 300.0)]
    new = [rec("ampfused", 100.0), rec("torch", 400.0)]
    assert run_compare(tmp_path, old, new) == 0
    out = capsys.readouterr().out
    assert "1 slower beyond noise, 0 of them ampfused" in out
    assert "torch rows' median new/old 1.333" in out


def test_relative_to_torch_cancels_drift(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = [rec("ampfused", 100.0), rec("torch", 300.0), rec("ampfused", 100.0, workload="1 x 16")]
    old.append(rec("torch", 300.0, workload="1 x 16"))
    # A machine twice as slow, and ampfused 1.5x slower still on 1 x 16.
    new = [rec("ampfused", 200.0), rec("torch", 600.0), rec("ampfused", 300.0, workload="1 x 16")]
    new.append(rec("torch", 600.0, workload="1 x 16"))
    assert run_compare(tmp_path, old, new) == 1
    assert "4 slower beyond noise, 2 of them ampfused" in capsys.readouterr().out
    for name in ("old", "new"):
        (tmp_path / name).rename(tmp_path / f"{name}-absolute")
    assert run_compare(tmp_path, old, new, argv=("--relative-to", "torch")) == 1
    out = capsys.readouterr().out
    assert "2 rows in both runs" in out  # torch's own rows are the yardstick, not rows
    assert "1 slower beyond noise, 1 of them ampfused (counts 1 x 16 fp32 ampfused)" in out
    row = next(line for line in out.splitlines() if "1 x 16" in line)
    assert "0.333x" in row and "0.500x" in row and "1.500" in row


def test_keys_status_and_e2e(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = [
        rec("ampfused-op", 100.0),
        rec("ampfused", 100.0, workload="1 x 16"),
        rec("ampfused", 100.0, inject_inf=True),  # a different row from the finite one
        rec("torch", 100.0, dtype="bf16"),
    ]
    new = [
        rec("ampfused-op", 1.0, status="error", note="RuntimeError: boom"),
        rec("ampfused", 1.0, workload="1 x 16", status="n/a", note="below resolution"),
        rec("ampfused", 300.0),  # not in OLD: no row, whatever its time
        rec("ampfused", 100.0, inject_inf=True),
        rec("torch", 100.0, dtype="bf16"),
    ]
    assert run_compare(tmp_path, old, new, e2e_result(10.0), e2e_result(12.0)) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "6 rows in both runs (0 only in OLD, 1 only in NEW)" in out
    assert "now error" in next(line for line in lines if "ampfused-op" in line)
    assert "SLOWER" not in next(line for line in lines if "1 x 16" in line)
    assert "SLOWER" in next(line for line in lines if "ampfused/adamw" in line)
    assert "SLOWER" not in next(line for line in lines if "+inf" in line)
    assert "2 slower beyond noise, 2 of them ampfused" in out
    # A --quick run trains another e2e configuration: its rows are left out.
    (tmp_path / "old").rename(tmp_path / "old1")
    (tmp_path / "new").rename(tmp_path / "new1")
    assert run_compare(tmp_path, old, new, e2e_result(10.0, steps=8), e2e_result(12.0)) == 1
    out = capsys.readouterr().out
    assert "e2e not compared" in out and "ampfused/adamw" not in out


def test_bad_paths_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        compare.main([str(tmp_path / "nowhere"), str(tmp_path)])
    assert e.value.code == 2
    assert "no such results file or folder" in capsys.readouterr().err
    compare.write(tmp_path, payload([rec("ampfused", 10.0)]))
    with pytest.raises(SystemExit):
        compare.main([str(tmp_path), str(tmp_path), "--relative-to", "torch"])
    assert "--relative-to torch: OLD has no such method" in capsys.readouterr().err


# --------------------------------------------------------------------------- the suite's steps
def test_suite_writes_both_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """main's steps end to end, the questions replaced by fakes (no timing)."""

    def fake(run: suite_main.Run, q: str) -> None:
        if q == "sizes":
            raise RuntimeError("sizes broke")
        run.records += [rec("ampfused", 100.0), rec("torch", 300.0), rec("floor-mul", 200.0)]

    monkeypatch.setattr(suite_main, "run_question", fake)
    argv = ["--only", "counts,sizes", "--device", "cpu", "--no-progress", "--out", str(tmp_path)]
    assert suite_main.main(argv) == 1  # the broken question is an error, the other still ran
    full = json.loads((tmp_path / "results.json").read_text())
    assert full["errors"] == ["sizes: RuntimeError: sizes broke"]
    assert [r["method"] for r in full["records"]] == ["ampfused", "torch", "floor-mul"]
    assert full["command"] == "python -m benchmarks " + " ".join(argv)
    assert set(full["durations_s"]) == {"counts", "sizes"}
    compact = compare.load(tmp_path / "results.jsonl")
    assert [r.method for r in compact["records"]] == ["ampfused", "torch", "floor-mul"]
    assert compact["run"]["errors"] == full["errors"]
    assert "## Tensor-count sweep" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "counts.png").is_file()
    assert compare.main([str(tmp_path), str(tmp_path / "results.jsonl")]) == 0
