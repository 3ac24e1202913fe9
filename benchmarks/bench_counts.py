"""Question: how does the per-step cost grow with the number of gradient tensors (1 to 10,000)
at fixed tensor size?  This is where per-tensor Python and launch overhead shows."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from benchmarks.suite import Context, Record, run_workload
from benchmarks.workloads import Workload, uniform

QUESTION = "counts"

COUNTS = (1, 3, 10, 30, 100, 300, 1000, 3000, 10000)
QUICK_COUNTS = (1, 10, 100, 1000)
NUMELS = (16, 1024)


@dataclass(frozen=True)
class CountConfig:
    count: int
    numel: int
    dtype: str = "fp32"
    inject_inf: bool = False

    def workload(self) -> Workload:
        name = f"{self.count} x {self.numel}"
        return Workload(
            name, tuple(uniform(self.count, self.numel)), self.dtype, self.inject_inf, "count"
        )


def configs(ctx: Context, dtypes: list[str] | None) -> list[CountConfig]:
    counts = QUICK_COUNTS if ctx.quick else COUNTS
    dtypes = dtypes or ["fp32"]
    return [CountConfig(c, n, d) for n, d, c in itertools.product(NUMELS, dtypes, counts)]


def run(ctx: Context, cfgs: list[CountConfig]) -> list[Record]:
    records: list[Record] = []
    for cfg in cfgs:
        records += run_workload(ctx, QUESTION, cfg.workload())
        ctx.tick()
    return records
