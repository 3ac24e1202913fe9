"""Per-step scaler cost: ``unscale_ + step + update`` of ampfused.GradScaler vs
torch.amp.GradScaler vs the in-place ``_foreach_mul_`` floor, at scale 2^16, for the four
gradient sets the CPU targets are stated on, each with the same gradient tensors every step
and (``realloc``) with new ones every step, as ``zero_grad(set_to_none=True)`` leaves them.

    python -m benchmarks.step_cost            # CPU (the targets' device)
    python -m benchmarks.step_cost --device cuda --quick
    python -m benchmarks.step_cost --timing batched   # the GPU method, run on the CPU

The full suite (``python -m benchmarks``) runs the same measurement as its ``step_cost``
question and checks the targets on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from tabulate import tabulate

from benchmarks.fmt import fmt_time
from benchmarks.methods import METHODS
from benchmarks.suite import Context, Record, run_workload
from benchmarks.timing import TIMING_MODES, TimingConfig
from benchmarks.workloads import Workload, gpt2_124m, uniform

QUESTION = "step_cost"

# The targets are stated on the same-gradients rows; the realloc rows follow them.
SAME_GRADS = (
    Workload("3000 x 16", tuple(uniform(3000, 16)), family="target"),
    Workload("1000 x 1K", tuple(uniform(1000, 1024)), family="target"),
    Workload("gpt2-124m", tuple(gpt2_124m()), family="target"),
    Workload("4 x 16M", tuple(uniform(4, 1 << 24)), family="target"),
)
WORKLOADS = SAME_GRADS + tuple(dataclasses.replace(w, realloc=True) for w in SAME_GRADS)
METHOD_NAMES = ("ampfused", "torch", "floor-mul")

# More samples than the sweeps: the targets are ratios of medians a few percent apart.
TIMING = TimingConfig(warmup=3, min_rounds=15, enough_rounds=61, min_time_s=0.5, max_wall_s=20.0)
QUICK_TIMING = TimingConfig(
    warmup=2, min_rounds=5, enough_rounds=11, min_time_s=0.1, max_wall_s=2.5, batch_s=0.02
)


def measure(ctx: Context) -> list[Record]:
    """Runs the four workloads with ampfused, torch and the floor (whatever ctx.methods says)."""
    methods = [METHODS[n] for n in METHOD_NAMES]
    records: list[Record] = []
    for w in WORKLOADS:
        records += run_workload(ctx, QUESTION, w, methods)
        ctx.tick()
    return records


def table(records: list[Record], tablefmt: str = "simple") -> str:
    """One row per workload: the three medians (IQR) and their ratios; batched runs add the
    host (CPU-side) cost and the device time of both scalers."""
    batched = any(r.timing == "batched" for r in records)
    device = any(r.device_median_s is not None for r in records)
    rows = []
    for w in WORKLOADS:
        by = {
            r.method: r for r in records if r.workload == w.name and r.realloc == w.realloc and r.ok
        }
        if not by:
            continue
        a, t, f = by.get("ampfused"), by.get("torch"), by.get("floor-mul")

        def cell(r: Record | None) -> str:
            if r is None:
                return "-"
            return f"{fmt_time(r.median_s)} ±{fmt_time(r.iqr_s)}"

        def ratio(x: Record | None, y: Record | None) -> str:
            if x is None or y is None:
                return "-"
            return f"{x.median_s / y.median_s:.2f}x"  # type: ignore[operator]

        rows.append(
            [
                w.name + (" realloc" if w.realloc else ""),
                w.n_tensors,
                f"{w.grad_bytes / 1e6:.1f}",
                cell(a),
                cell(t),
                cell(f),
                ratio(t, a),
                ratio(a, f),
                ratio(t, f),
            ]
        )
        if batched:
            rows[-1] += [fmt_time(x.host_median_s) if x else "-" for x in (a, t)]
        if device:
            rows[-1] += [fmt_time(x.device_median_s) if x else "-" for x in (a, t)]
    headers = [
        "gradients (fp32)",
        "tensors",
        "MB",
        "ampfused",
        "torch",
        "floor _foreach_mul_",
        "torch / ampfused",
        "ampfused / floor",
        "torch / floor",
    ]
    if batched:
        headers += ["host: ampfused", "host: torch"]
    if device:
        headers += ["device: ampfused", "device: torch"]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.step_cost", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--device", default="cpu", help="device to measure on (default: cpu)")
    p.add_argument("--quick", action="store_true", help="fewer samples (a few seconds)")
    p.add_argument(
        "--timing",
        choices=TIMING_MODES,
        default="auto",
        help="per-step samples or batched loops (default auto: batched on GPU, per-step on CPU)",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    timing = dataclasses.replace(QUICK_TIMING if args.quick else TIMING, mode=args.timing)
    ctx = Context(
        device=device,
        timing=timing,
        methods=[METHODS[n] for n in METHOD_NAMES],
        quick=args.quick,
        profile=False,
    )
    t0 = time.perf_counter()
    records = measure(ctx)
    print(
        f"per-step unscale_ + step + update at scale 2^16 on {device} "
        f"(median ±IQR, {torch.get_num_threads()} threads, torch {torch.__version__})"
    )
    print(table(records))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
