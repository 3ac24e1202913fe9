"""results.jsonl, and ``python -m benchmarks.compare OLD NEW``: which rows got slower.

results.jsonl: a ``{"run": ...}`` line (environment, command, durations, errors, targets), one
line per record with its measured fields only (floats to 4 significant digits; the ratios are
recomputed on loading), then an ``{"e2e": ...}`` line, a ``{"policy": ...}`` line (the policy
question's runs, benchmarks/policy.py) and an ``{"islands": ...}`` line (benchmarks/islands.py):
a diff of two commits' results shows the rows that moved.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import fmt_time, tabulate
from benchmarks.suite import Record, derive

NAME = "results.jsonl"
DESCRIPTION = """\
OLD and NEW are results.jsonl files or folders holding one.  For every (question, workload,
dtype, method) measured in both, lists both medians and NEW / OLD, and flags a row slower
beyond noise: NEW's median above OLD's by more than --threshold and NEW's first quartile above
OLD's third (the IQRs do not overlap), or one that ran in OLD and errors in NEW.  Exits 1 when
an ampfused row is flagged.  torch's rows run the same code in both runs: their median ratio is
the machine's drift; --relative-to torch cancels it."""
# Recomputed by suite.derive from the medians of one workload's records.
DERIVED = {"x_floor", "x_copy", "speedup_vs_torch", "device_x_copy", "device_speedup_vs_torch"}
DERIVED.add("host_speedup_vs_torch")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Record)}
# The questions whose results are a line of their own, in the file's order.
LINES = ("e2e", "policy", "islands")


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(_round(obj), separators=(",", ":"), default=str)


def write(
    out: Path,
    run: dict[str, Any],
    records: list[Record],
    e2e: Any,
    policy: Any = None,
    islands: Any = None,
) -> Path:
    """``out``/results.jsonl; a record keeps its measured fields (no ratios, no defaults)."""
    lines = [_line({"run": run})]
    for r in records:
        d = dataclasses.asdict(r)
        lines.append(_line({k: v for k, v in d.items() if k not in DERIVED and v != _DEFAULTS[k]}))
    for key, value in zip(LINES, (e2e, policy, islands), strict=True):
        if value:
            lines.append(_line({key: value}))
    (out / NAME).write_text("\n".join(lines) + "\n")
    return out / NAME


def load(path: Path) -> dict[str, Any]:
    """A results file or its folder as ``{"run": {...}, "records": [Record], "e2e": ...,
    "policy": ..., "islands": ...}``."""
    path = path / NAME if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such results file")
    run: dict[str, Any] = {}
    own: dict[str, Any] = dict.fromkeys(LINES)
    recs, groups = [], {}
    try:
        for line in filter(str.strip, path.read_text().splitlines()):
            obj = json.loads(line)
            key = next((k for k in ("run", *LINES) if k in obj), None)
            if key == "run":
                run = obj["run"]
            elif key is not None:
                own[key] = obj[key]
            else:
                recs.append(Record(**{k: v for k, v in obj.items() if k in _DEFAULTS}))
                r = recs[-1]
                key = (r.question, r.workload, r.dtype, r.inject_inf, r.realloc)
                groups.setdefault(key, []).append(r)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a benchmarks results file ({type(e).__name__}: {e})") from e
    for group in groups.values():
        derive(group)
    return {"run": run, "records": recs, **own}


# --------------------------------------------------------------------------- comparison
Timing = namedtuple("Timing", "status median_s q1_s q3_s")


@dataclass
class Row:
    key: tuple[str, str, str, str]  # question, workload (with +inf / realloc), dtype, method
    old: Timing
    new: Timing
    ratio: float | None = None
    flag: str = ""

    @property
    def ampfused(self) -> bool:
        return self.key[3].startswith("ampfused")


def timings(results: dict[str, Any], e2e: bool = True) -> dict[tuple[str, str, str, str], Timing]:
    out = {}
    for r in results["records"]:
        key = (r.question, r.workload + r.variant, r.dtype, r.method)
        out[key] = Timing(r.status, r.median_s, r.q1_s, r.q3_s)
    for name, run in ((results.get("e2e") if e2e else None) or {}).get("runs", {}).items():
        t = Timing("ok", run["median_step_s"], run["q1_s"], run["q3_s"])
        out[("e2e", "small GPT", "fp16 autocast", name)] = t
    return out


def relative(times: dict[tuple[str, str, str, str], Timing], ref: str) -> dict:
    """Each row's times over the median of method ``ref`` on the same workload in the same run
    (an e2e run over ``ref``'s with the same optimizer); rows without it, and its own, left out."""
    out = {}
    for (q, w, d, m), t in times.items():
        ref_m = ref + m[m.index("/") :] if "/" in m else ref
        base = times.get((q, w, d, ref_m))
        if m == ref_m or base is None or base.status != "ok" or not base.median_s:
            continue
        b = base.median_s
        q1, q3 = (None if x is None else x / b for x in (t.q1_s, t.q3_s))
        out[(q, w, d, m)] = Timing(t.status, None if t.median_s is None else t.median_s / b, q1, q3)
    return out


def judge(old: Timing, new: Timing, threshold: float) -> tuple[float | None, str]:
    """NEW / OLD and the flag: '' (not slower beyond noise), 'SLOWER' or 'now <status>'."""
    if old.status != "ok" or old.median_s is None:
        return None, ""
    if new.status != "ok" or new.median_s is None:
        return None, "" if new.status in ("n/a", "skipped") else f"now {new.status}"
    ratio = new.median_s / old.median_s
    apart = new.q1_s is None or old.q3_s is None or new.q1_s > old.q3_s
    return ratio, "SLOWER" if ratio > 1 + threshold and apart else ""


def _config(results: dict[str, Any]) -> Any:
    return (results.get("e2e") or {}).get("config")


def compare(
    old: dict[str, Any],
    new: dict[str, Any],
    threshold: float = 0.05,
    relative_to: str | None = None,
) -> tuple[list[Row], int, int]:
    """The rows in both runs, and how many only OLD and only NEW have; the e2e runs only when
    both trained the same configuration (--quick trains a smaller one)."""
    same_e2e = _config(old) == _config(new)
    a, b = timings(old, same_e2e), timings(new, same_e2e)
    if relative_to:
        a, b = relative(a, relative_to), relative(b, relative_to)
    rows = [Row(key, a[key], b[key]) for key in a if key in b]
    for row in rows:
        row.ratio, row.flag = judge(row.old, row.new, threshold)
    return rows, len(a.keys() - b.keys()), len(b.keys() - a.keys())


def summary(rows: list[Row], only_old: int, only_new: int) -> str:
    flagged = [r for r in rows if r.flag]
    ours = [r for r in flagged if r.ampfused]
    drift = [r.ratio for r in rows if r.key[3] == "torch" and r.ratio is not None]
    text = (
        f"{len(rows)} rows in both runs ({only_old} only in OLD, {only_new} only in NEW): "
        f"{len(flagged)} slower beyond noise, {len(ours)} of them ampfused"
    )
    if ours:
        text += " (" + "; ".join(" ".join(r.key) for r in ours[:5])
        text += ", ...)" if len(ours) > 5 else ")"
    if drift:
        text += f"; torch rows' median new/old {statistics.median(drift):.3f} (machine drift)"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=DESCRIPTION)
    p.add_argument("old", type=Path, help="the earlier run: results.jsonl or its folder")
    p.add_argument("new", type=Path, help="the later run: results.jsonl or its folder")
    p.add_argument("--threshold", type=float, default=0.05, help="default 0.05 (5%%)")
    p.add_argument(
        "--relative-to",
        metavar="METHOD",
        help="compare each row's time over this method's on the same workload and run (e.g. "
        "torch, floor-mul): cancels the machine's drift between the runs",
    )
    p.add_argument("--flagged", action="store_true", help="list only the flagged rows")
    args = p.parse_args(argv)
    try:
        old, new = load(args.old), load(args.new)
    except (OSError, ValueError) as e:
        p.error(str(e))
    measured = {r.method for r in old["records"]}
    if args.relative_to and args.relative_to not in measured:
        p.error(f"--relative-to {args.relative_to}: OLD has no such method ({sorted(measured)})")
    for name, res in (("OLD", old), ("NEW", new)):
        run, h = res["run"], res["run"].get("header") or {}
        print(
            f"{name}: commit {h.get('git_commit')}, {h.get('device_name')}, torch "
            f"{h.get('torch')}, {h.get('date')}, `{run.get('command')}`"
        )
    if _config(old) != _config(new):
        print("e2e not compared: the two runs trained different configurations")
    rows, only_old, only_new = compare(old, new, args.threshold, args.relative_to)
    shown = [r for r in rows if r.flag] if args.flagged else rows
    if shown:

        def cell(t: Timing) -> str:
            if t.status != "ok":
                return t.status
            return f"{t.median_s:.3f}x" if args.relative_to else fmt_time(t.median_s)

        body = [
            [*r.key, cell(r.old), cell(r.new), "-" if r.ratio is None else f"{r.ratio:.3f}", r.flag]
            for r in shown
        ]
        headers = ["question", "workload", "dtype", "method", "old", "new", "new/old", ""]
        print(tabulate(body, headers=headers))
    print(summary(rows, only_old, only_new))
    return 1 if any(r.flag and r.ampfused for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
