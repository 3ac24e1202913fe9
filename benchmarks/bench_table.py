"""Question: what does the host spend building the CUDA launch's work list (csrc/launch_table.h),
per tensor, when the gradient set is the same as last step (cached) and when every gradient was
reallocated (``zero_grad(set_to_none=True)``)?  Runs on the CPU: the builder is plain host code.

``PYTHONPATH=$PWD python -m benchmarks.bench_table`` prints one row per gradient set; each figure
is the median (and the minimum, the figure least disturbed by other processes) over ``--repeats``
runs of ``--iters`` builds, timed inside the extension.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import ampfused  # noqa: F401  (loads the extension and its private ops)

SETS = ((1000, 1024), (3000, 16))


def ns_per_tensor(
    tensors: list[torch.Tensor], iters: int, realloc: bool, repeats: int
) -> tuple[float, float]:
    op = torch.ops.ampfused._bench_launch_table
    op(tensors, max(1, iters // 10), realloc)  # warm-up: caches, allocator, page faults
    runs = [op(tensors, iters, realloc) for _ in range(repeats)]
    return statistics.median(runs), min(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(
        f"{'ns per tensor':>16} {'cached median':>14} {'min':>6} {'realloc median':>15} {'min':>6}"
    )
    for count, numel in SETS:
        tensors = [torch.empty(numel) for _ in range(count)]
        cached = ns_per_tensor(tensors, args.iters, False, args.repeats)
        realloc = ns_per_tensor(tensors, args.iters, True, args.repeats)
        name = f"{count} x {numel} fp32"
        print(f"{name:>16} {cached[0]:14.2f} {cached[1]:6.2f} {realloc[0]:15.2f} {realloc[1]:6.2f}")


if __name__ == "__main__":
    main()
