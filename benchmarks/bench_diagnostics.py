"""Question: what do the scaler's diagnostics cost?  ``ampfused.GradScaler.watch()`` makes the
pass that unscales also record every gradient's L2 norm, abs-max and inf/NaN/zero counts; the
issue bounds that at 1.15x the plain pass on the CPU for GPT-2 124M and 4 x 16M, beside what
users run today for per-layer norms (torch's scaler, a ``torch._foreach_norm`` pass and one
``.item()`` per layer).  Tiny tensors at growing counts then show that the statistics add no
per-parameter host work: the Python bytecodes of a watched step stay the same from 100 to 3000
gradients, and its time over the plain step stays flat.
"""

from __future__ import annotations

from tabulate import tabulate

from benchmarks.fmt import by_workload, fmt_cell, fmt_ratio
from benchmarks.methods import METHODS
from benchmarks.suite import Context, Record, run_workload
from benchmarks.workloads import Workload, gpt2_124m, uniform

QUESTION = "diagnostics"

METHOD_NAMES = ("ampfused", "ampfused-watch", "ampfused-norms", "torch", "torch-norms", "floor-mul")
# The bound is stated on these (fp32); mixed dtypes follow them in a full run.
BOUND_WORKLOADS = (
    Workload("gpt2-124m", tuple(gpt2_124m()), family="target"),
    Workload("4 x 16M", tuple(uniform(4, 1 << 24)), family="target"),
)
MIXED = Workload("gpt2-124m", tuple(gpt2_124m()), "mixed", family="model")
# Host cost: 16-element gradients, so what grows with the count is per-tensor overhead.
COUNTS = (100, 1000, 3000)
COUNT_NUMEL = 16
# Also the order of the ratio and bytecode columns of the table.
COUNT_METHODS = ("ampfused", "ampfused-watch", "ampfused-norms", "torch-norms")
RATIO_BOUND = 1.15


def count_workload(n: int) -> Workload:
    return Workload(f"{n} x {COUNT_NUMEL}", tuple(uniform(n, COUNT_NUMEL)), family="count")


def workloads(ctx: Context) -> list[tuple[Workload, tuple[str, ...]]]:
    """(workload, method names) in the order they run; --quick leaves out the mixed set."""
    out = [(w, METHOD_NAMES) for w in BOUND_WORKLOADS]
    if not ctx.quick:
        out.append((MIXED, METHOD_NAMES))
    out += [(count_workload(n), COUNT_METHODS) for n in COUNTS]
    return out


def run(ctx: Context) -> list[Record]:
    records: list[Record] = []
    for w, names in workloads(ctx):
        methods = [METHODS[n] for n in names if METHODS[n].present(ctx.device)]
        records += run_workload(ctx, QUESTION, w, methods, python_cost=True)
        ctx.tick()
    return records


def _code(r: Record | None) -> str:
    return "-" if r is None or r.py_bytecodes is None else str(r.py_bytecodes)


def table(records: list[Record], tablefmt: str = "simple") -> str:
    """One row per workload: each method's median step (a failed one shows its status), the
    watched step over the plain one, torch's per-layer logging over ampfused's, and the Python
    bytecodes one step executes."""
    rows = []
    for cells, by, ok in by_workload(records):
        a, w, n, tn = (ok.get(m) for m in COUNT_METHODS)
        rows.append(
            [
                *cells,
                *(fmt_cell(by.get(m)) for m in METHOD_NAMES),
                fmt_ratio(w, a),
                fmt_ratio(n, a),
                fmt_ratio(tn, w),
                fmt_ratio(tn, n),
                " / ".join(_code(by.get(m)) for m in COUNT_METHODS),
            ]
        )
    headers = [
        "gradients",
        "tensors",
        "MB",
        *METHOD_NAMES,
        "watch / ampfused",
        "norms / ampfused",
        "torch-norms / watch",
        "torch-norms / norms",
        "Python bytecodes a / watch / norms / torch-norms",
    ]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)
