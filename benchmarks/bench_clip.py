"""Question: what does unscale + clip cost?  ``ampfused.GradScaler.clip_grad_norm_`` reads every
gradient once (inf/NaN check and norm together) and writes it once (times ``inv_scale *
clip_coef``): 12 bytes per fp32 element, where torch's ``unscale_`` + ``clip_grad_norm_``
(foreach) move 20.  The issue asks for 1.5x over torch's pair on GPT-2 124M shapes on the CPU;
the floor (one in-place multiply pass, 8 bytes) and the plain unscale step run beside them, so
the table shows how close the clip comes to its 1.5x-the-floor ideal.
"""

from __future__ import annotations

from tabulate import tabulate

from benchmarks.fmt import by_workload, fmt_cell, fmt_ratio
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


def run_question(
    ctx: Context, question: str, sets: list[Workload], names: tuple[str, ...]
) -> list[Record]:
    """Each workload with the named methods present on the device, ticking the progress bar."""
    records: list[Record] = []
    for w in sets:
        methods = [METHODS[n] for n in names if METHODS[n].present(ctx.device)]
        records += run_workload(ctx, question, w, methods)
        ctx.tick()
    return records


def run(ctx: Context) -> list[Record]:
    return run_question(ctx, QUESTION, workloads(ctx), METHOD_NAMES)


def _gbs(r: Record | None) -> str:
    return "-" if r is None or not r.ok or r.gbps is None else f"{r.gbps:.1f}"


def comparison(
    records: list[Record], names: tuple[str, ...], ratio_headers: list[str], tablefmt: str
) -> str:
    """One row per workload: each method's median step (names: the fused method, torch's way,
    the plain ampfused step, the floor), torch's way over the fused one, the fused one over the
    floor and over the plain step, and both GB/s (the bytes each moves)."""
    rows = []
    for cells, by, ok in by_workload(records):
        fused, torch_way, plain, floor = (ok.get(m) for m in names)
        rows.append(
            [
                *cells,
                *(fmt_cell(by.get(m)) for m in names),
                fmt_ratio(torch_way, fused),
                fmt_ratio(fused, floor),
                fmt_ratio(fused, plain),
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
