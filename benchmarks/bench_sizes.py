"""Question: what bandwidth does each method reach as tensors grow from 16 elements to 2^28?
Eight tensors of each size, so small sizes show per-call overhead and large ones the memory
system (8 x 2^25 fp32 is 1 GiB of gradients)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from benchmarks.suite import Context, Record, run_workload
from benchmarks.workloads import Workload, uniform

QUESTION = "sizes"

COUNT = 8
LOG2_SIZES = tuple(range(4, 29, 2))  # 16 ... 2^28 elements
CPU_MAX_LOG2 = 24  # 8 x 2^24 fp32 = 512 MiB: a step takes tens of ms on a 2-core CPU
QUICK_MAX_LOG2 = 20


@dataclass(frozen=True)
class SizeConfig:
    log2_numel: int
    dtype: str = "fp32"
    count: int = COUNT
    inject_inf: bool = False

    def workload(self) -> Workload:
        name = f"{self.count} x 2^{self.log2_numel}"
        shapes = tuple(uniform(self.count, 1 << self.log2_numel))
        return Workload(name, shapes, self.dtype, self.inject_inf, "size")


def configs(ctx: Context, dtypes: list[str] | None) -> tuple[list[SizeConfig], list[str]]:
    gpu = ctx.device.type == "cuda"
    cap = QUICK_MAX_LOG2 if ctx.quick else (LOG2_SIZES[-1] if gpu else CPU_MAX_LOG2)
    sizes = [s for s in LOG2_SIZES if s <= cap]
    if ctx.quick:
        sizes = sizes[::2] + ([sizes[-1]] if sizes[-1] not in sizes[::2] else [])
    notes = []
    if cap < LOG2_SIZES[-1]:
        notes.append(f"sizes capped at 2^{cap} elements per tensor on this run (time budget)")
    dtypes = dtypes or ["fp32"]
    return [SizeConfig(s, d) for d, s in itertools.product(dtypes, sizes)], notes


def run(ctx: Context, cfgs: list[SizeConfig]) -> list[Record]:
    records: list[Record] = []
    for cfg in cfgs:
        records += run_workload(ctx, QUESTION, cfg.workload())
        ctx.tick()
    return records
