"""Question: what does unscale + clip cost?  ``ampfused.GradScaler.clip_grad_norm_`` reads every
gradient once (inf/NaN check and norm together) and writes it once (times ``inv_scale *
clip_coef``): 12 bytes per fp32 element, where torch's ``unscale_`` + ``clip_grad_norm_``
(foreach) move 20.  The issue asks for 1.5x over torch's pair on GPT-2 124M shapes on the CPU;
the floor (one in-place multiply pass, 8 bytes) and the plain unscale step run beside them, so
the table shows how close the clip comes to its 1.5x-the-floor ideal.
"""

from __future__ import annotations

from tabulate import tabulate

from benchmarks.fmt import fmt_time
from benchmarks.methods import METHODS
from benchmarks.suite import Context, Record, run_workload
from benchmarks.workloads import Workload, gpt2_124m, uniform

QUESTION = "clip"

METHOD_NAMES = ("ampfused-clip", "torch-clip", "ampfused", "floor-mul")
TARGET = Workload("gpt2-124m", tuple(gpt2_124m()), family="target")
SPEEDUP_BOUND = 1.5
OTHERS = (
    Workload("4 x 16M", tuple(uniform(4, 1 << 24)), family="target"),
    Workload("1000 x 1K", tuple(uniform(1000, 1024)), family="count"),
)
MIXED = Workload("gpt2-124m", tuple(gpt2_124m()), "mixed", family="model")


def workloads(ctx: Context) -> list[Workload]:
    """In the order they run; --quick leaves out the mixed set."""
    return [TARGET, *OTHERS] + ([] if ctx.quick else [MIXED])


def run(ctx: Context) -> list[Record]:
    records: list[Record] = []
    for w in workloads(ctx):
        methods = [METHODS[n] for n in METHOD_NAMES if METHODS[n].present(ctx.device)]
        records += run_workload(ctx, QUESTION, w, methods)
        ctx.tick()
    return records


def _ratio(x: Record | None, y: Record | None) -> str:
    if x is None or y is None:
        return "-"
    return f"{x.median_s / y.median_s:.2f}x"  # type: ignore[operator]


def _cell(r: Record | None) -> str:
    if r is None:
        return "-"
    return fmt_time(r.median_s) if r.ok else r.status


def _gbs(r: Record | None) -> str:
    return "-" if r is None or not r.ok or r.gbps is None else f"{r.gbps:.1f}"


def comparison(
    records: list[Record], names: tuple[str, ...], ratio_headers: list[str], tablefmt: str
) -> str:
    """One row per workload: each method's median step (names: the fused method, torch's way,
    the plain ampfused step, the floor), torch's way over the fused one, the fused one over the
    floor and over the plain step, and both GB/s (the bytes each moves)."""
    groups: dict[tuple, dict[str, Record]] = {}
    for r in records:
        groups.setdefault((r.workload, r.dtype, r.realloc), {})[r.method] = r
    rows = []
    for by in groups.values():
        any_r = next(iter(by.values()))
        ok = {m: r for m, r in by.items() if r.ok}
        fused, torch_way, plain, floor = (ok.get(m) for m in names)
        rows.append(
            [
                any_r.label,
                any_r.n_tensors,
                f"{any_r.grad_bytes / 1e6:.1f}",
                *(_cell(by.get(m)) for m in names),
                _ratio(torch_way, fused),
                _ratio(fused, floor),
                _ratio(fused, plain),
                f"{_gbs(fused)} / {_gbs(torch_way)}",
            ]
        )
    headers = ["gradients", "tensors", "MB", *names, *ratio_headers]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def table(records: list[Record], tablefmt: str = "simple") -> str:
    """The clip comparison; GB/s from 12 and 20 bytes per fp32 element."""
    headers = [
        "torch pair / fused clip",
        "fused clip / floor",
        "fused clip / unscale step",
        "GB/s fused / pair",
    ]
    return comparison(records, METHOD_NAMES, headers, tablefmt)
