"""The results files, and ``python -m benchmarks.compare OLD NEW``: which rows of two runs got
slower.

A run writes two forms.  ``results.jsonl`` (compact, committed): JSON Lines, first a ``{"run":
...}`` line (environment, command, durations, errors, targets), then one line per record with
only its measured fields (floats to 4 significant digits; the ratios between methods are
recomputed on loading), then one ``{"e2e": ...}`` line; one record per line keeps a diff of two
commits' results to the rows that moved.  ``results.json`` (git-ignored): every field, the e2e
loss curves, notes and method descriptions.

OLD and NEW are results files (either form) or folders holding one.  For every (question,
workload, dtype, method) measured in both, it lists both medians and NEW / OLD, and flags a row
slower beyond noise: NEW's median above OLD's by more than ``--threshold`` (5%) and NEW's first
quartile above OLD's third, so that the two runs' interquartile ranges do not overlap.  A row
measured in OLD that errors in NEW is flagged too.  The exit status is 1 when an ampfused row
(the scaler, its raw op, its e2e runs) is flagged, else 0.  torch's rows run the same code in
both runs: their median ratio, printed last, is the drift between the machines or moments of
the two runs; ``--relative-to torch`` compares times over torch's in the same run instead,
which cancels it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from benchmarks.report import fmt_time
from benchmarks.suite import Record, derive

FULL_NAME = "results.json"
COMPACT_NAME = "results.jsonl"
SIGNIFICANT = 4
# Recomputed by suite.derive from the medians of one workload's records.
DERIVED = frozenset(
    {
        "x_floor",
        "x_copy",
        "speedup_vs_torch",
        "device_x_copy",
        "device_speedup_vs_torch",
        "host_speedup_vs_torch",
    }
)
RUN_KEYS = ("header", "command", "quick", "elapsed_s", "durations_s", "cpu_used_by_others")
RUN_KEYS += ("errors", "targets")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Record)}


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return float(f"{x:.{SIGNIFICANT}g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)


def compact_record(rec: dict[str, Any]) -> dict[str, Any]:
    """A record's measured fields: no ratios, nothing left at its default."""
    return {
        k: _round(v)
        for k, v in rec.items()
        if k in _DEFAULTS and k not in DERIVED and v != _DEFAULTS[k]
    }


def compact_lines(payload: dict[str, Any]) -> list[str]:
    """The compact form of a full payload (as written to ``results.json``)."""
    lines = [_line({"run": {k: _round(payload.get(k)) for k in RUN_KEYS}})]
    lines += [_line(compact_record(r)) for r in payload["records"]]
    if payload.get("e2e"):
        lines.append(_line({"e2e": _round(payload["e2e"])}))
    return lines


def write(out: Path, payload: dict[str, Any]) -> list[Path]:
    """Writes both forms into ``out``; returns their paths."""
    full, compact = out / FULL_NAME, out / COMPACT_NAME
    full.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    compact.write_text("\n".join(compact_lines(payload)) + "\n")
    return [full, compact]


def resolve(path: Path) -> Path:
    """A results file, or a folder holding one (the full form when both are there)."""
    if path.is_dir():
        for name in (FULL_NAME, COMPACT_NAME):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path}: no {FULL_NAME} or {COMPACT_NAME} in this folder")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such results file or folder")
    return path


def _records(dicts: Iterable[dict[str, Any]]) -> list[Record]:
    recs = [Record(**{k: v for k, v in d.items() if k in _DEFAULTS}) for d in dicts]
    groups: dict[tuple, list[Record]] = {}
    for r in recs:
        key = (r.question, r.workload, r.dtype, r.inject_inf, r.realloc)
        groups.setdefault(key, []).append(r)
    for group in groups.values():
        derive(group)
    return recs


def load(path: Path) -> dict[str, Any]:
    """Either form as ``{"run": {...}, "records": [Record], "e2e": {...} | None}``."""
    path = resolve(path)
    text = path.read_text()
    try:
        if path.suffix == ".jsonl":
            run: dict[str, Any] = {}
            e2e, recs = None, []
            for line in filter(str.strip, text.splitlines()):
                obj = json.loads(line)
                if "run" in obj:
                    run = obj["run"]
                elif "e2e" in obj:
                    e2e = obj["e2e"]
                else:
                    recs.append(obj)
        else:
            payload = json.loads(text)
            run = {k: payload.get(k) for k in RUN_KEYS}
            recs, e2e = payload["records"], payload.get("e2e")
        return {"run": run, "records": _records(recs), "e2e": e2e}
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a benchmarks results file ({type(e).__name__}: {e})") from e


# --------------------------------------------------------------------------- comparison

E2E_WORKLOAD = "small GPT"
E2E_DTYPE = "fp16 autocast"


@dataclass
class Timing:
    status: str
    median_s: float | None
    q1_s: float | None
    q3_s: float | None


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
    """One entry per record and (with ``e2e``) per e2e run of a loaded results file."""
    out = {}
    for r in results["records"]:
        key = (r.question, r.workload + r.variant, r.dtype, r.method)
        out[key] = Timing(r.status, r.median_s, r.q1_s, r.q3_s)
    for name, run in ((results.get("e2e") if e2e else None) or {}).get("runs", {}).items():
        t = Timing("ok", run["median_step_s"], run["q1_s"], run["q3_s"])
        out[("e2e", E2E_WORKLOAD, E2E_DTYPE, name)] = t
    return out


def relative(times: dict[tuple[str, str, str, str], Timing], ref: str) -> dict:
    """Each row's times over the median of method ``ref`` on the same workload in the same run
    (an e2e run over ``ref``'s run with the same optimizer): that cancels a drift of the machine
    between the two runs.  Rows without a measured reference, and the reference's, are left out."""
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
    """The rows in both runs, and how many rows only OLD and only NEW have.  The e2e runs are
    compared only when both trained the same configuration (--quick trains a smaller one)."""
    same_e2e = _config(old) == _config(new)
    a, b = timings(old, same_e2e), timings(new, same_e2e)
    if relative_to:
        a, b = relative(a, relative_to), relative(b, relative_to)
    rows = []
    for key in (k for k in a if k in b):
        row = Row(key, a[key], b[key])
        row.ratio, row.flag = judge(row.old, row.new, threshold)
        rows.append(row)
    return rows, len(a.keys() - b.keys()), len(b.keys() - a.keys())


def describe(name: str, results: dict[str, Any]) -> str:
    """Which run a results file holds: commit, device, torch, date, command."""
    run = results["run"]
    h = run.get("header") or {}
    return (
        f"{name}: commit {h.get('git_commit')}, {h.get('device_name')}, torch {h.get('torch')}, "
        f"{h.get('date')}, `{run.get('command')}`"
    )


def _cell(t: Timing, relative: bool) -> str:
    if t.status != "ok":
        return t.status
    return f"{t.median_s:.3f}x" if relative else fmt_time(t.median_s)


def table(rows: list[Row], relative: bool = False, tablefmt: str = "simple") -> str:
    body = [
        [*r.key, _cell(r.old, relative), _cell(r.new, relative)]
        + ["-" if r.ratio is None else f"{r.ratio:.3f}", r.flag]
        for r in rows
    ]
    headers = ["question", "workload", "dtype", "method", "old", "new", "new/old", ""]
    return tabulate(body, headers=headers, tablefmt=tablefmt, disable_numparse=True)


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
        text += ", ..." if len(ours) > 5 else ""
        text += ")"
    if drift:
        text += f"; torch rows' median new/old {statistics.median(drift):.3f} (machine drift)"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        description=__doc__.split("\n\n")[2],
    )
    p.add_argument("old", type=Path, help="the earlier run: results.json[l] or its folder")
    p.add_argument("new", type=Path, help="the later run: results.json[l] or its folder")
    p.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="slower means NEW/OLD above 1 + this, IQRs apart (default 0.05)",
    )
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
        p.error(
            f"--relative-to {args.relative_to}: OLD has no such method (it has "
            f"{', '.join(sorted(measured))})"
        )
    print(describe("OLD", old))
    print(describe("NEW", new))
    if _config(old) != _config(new):
        print("e2e not compared: the two runs trained different configurations")
    rows, only_old, only_new = compare(old, new, args.threshold, args.relative_to)
    shown = [r for r in rows if r.flag] if args.flagged else rows
    if shown:
        print(table(shown, relative=bool(args.relative_to)))
    print(summary(rows, only_old, only_new))
    return 1 if any(r.flag and r.ampfused for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
