"""Number formats shared by the console tables, results.md and the comparison."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.suite import Record


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us" if s < 1e-5 else f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_x(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def fmt_gbps(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def fmt_bytes(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} kB"
    return f"{n} B"


def fmt_ratio(x: Record | None, y: Record | None) -> str:
    """x's median over y's, or "-" when either is missing."""
    if x is None or y is None:
        return "-"
    return f"{x.median_s / y.median_s:.2f}x"  # type: ignore[operator]


def fmt_cell(r: Record | None) -> str:
    """A record's median step, or its status when it did not run."""
    if r is None:
        return "-"
    return fmt_time(r.median_s) if r.ok else r.status


def by_workload(records: list[Record]) -> list[tuple[list[str], dict[str, Record], dict]]:
    """The records of each workload, in run order: (its first three table cells: label, tensor
    count, MB of gradients; its records by method; those that ran, by method)."""
    groups: dict[tuple, dict[str, Record]] = {}
    for r in records:
        groups.setdefault((r.workload, r.dtype, r.realloc), {})[r.method] = r
    out = []
    for by in groups.values():
        r = next(iter(by.values()))
        cells = [r.label, str(r.n_tensors), f"{r.grad_bytes / 1e6:.1f}"]
        out.append((cells, by, {m: x for m, x in by.items() if x.ok}))
    return out
