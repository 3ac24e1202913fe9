"""The two forms of a run's results, and one loader for both.

``results.json`` (full): every field of every record, the e2e loss curves, notes and method
descriptions; an artifact of each run, git-ignored.  ``results.jsonl`` (compact, committed):
JSON Lines, first a ``{"run": ...}`` line (environment, command, durations, errors, targets),
then one line per record with only its measured fields (floats to 4 significant digits; the
ratios between methods are recomputed on loading), then one ``{"e2e": ...}`` line.  One
record per line keeps a diff of two commits' results to the rows that moved.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
