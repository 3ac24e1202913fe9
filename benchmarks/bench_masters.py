"""Question: what does a float32-master step of a float16 model cost?  ``ampfused.MasterWeights``
with ``ampfused.GradScaler`` reads each float16 gradient once and writes its master's float32
gradient once, unscaled, in the pass that checks it (2 + 4 bytes per element), and copies the
masters back after the step (4 + 2): 12 bytes.  The same recipe by hand with torch's scaler
casts the gradients, unscales the float32 copies in place and copies back: 6 + 8 + 6 = 20 bytes.
The optimizer is a no-op, so the rows show the scaler's and the masters' own cost; the floor
(the two flat copies, 12 bytes) and the plain float16 step (``allow_fp16``: in place, 4 bytes,
at a precision cost) run beside them.
"""

from __future__ import annotations

from benchmarks.bench_clip import comparison, run_question
from benchmarks.suite import Context, Record
from benchmarks.workloads import Workload, gpt2_124m, uniform

QUESTION = "masters"

METHOD_NAMES = ("ampfused-masters", "torch-masters", "ampfused", "floor-masters")
WORKLOADS = (
    Workload("gpt2-124m", tuple(gpt2_124m()), "fp16", family="model"),
    Workload("4 x 16M", tuple(uniform(4, 1 << 24)), "fp16", family="target"),
    Workload("1000 x 1K", tuple(uniform(1000, 1024)), "fp16", family="count"),
)


def workloads(ctx: Context) -> list[Workload]:
    return list(WORKLOADS)


def run(ctx: Context) -> list[Record]:
    return run_question(ctx, QUESTION, workloads(ctx), METHOD_NAMES)


def table(records: list[Record], tablefmt: str = "simple") -> str:
    """The masters comparison; GB/s from 12 and 20 bytes per float16 element."""
    headers = [
        "by hand / MasterWeights",
        "MasterWeights / floor",
        "MasterWeights / fp16 in place",
        "GB/s MasterWeights / by hand",
    ]
    return comparison(records, METHOD_NAMES, headers, tablefmt)
