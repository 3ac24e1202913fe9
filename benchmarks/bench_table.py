"""Question: what does the host spend building the CUDA launch's work list (csrc/launch_table.h),
per tensor, when the gradient set is the same as last step (cached) and when every gradient was
reallocated (``zero_grad(set_to_none=True)``)?  Runs on the CPU: the builder is plain host code.

``PYTHONPATH=$PWD python -m benchmarks.bench_table`` prints one row per gradient set; each figure
is the median over ``--repeats`` runs of ``--iters`` builds, timed inside the extension.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import ampfused  # noqa: F401  (loads the extension and its private ops)

SETS = ((1000, 1024), (3000, 16))


def ns_per_tensor(tensors: list[torch.Tensor], iters: int, realloc: bool, repeats: int) -> float:
    op = torch.ops.ampfused._bench_launch_table
    op(tensors, max(1, iters // 10), realloc)  # warm-up: caches, allocator, page faults
    return statistics.median(op(tensors, iters, realloc) for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"{'gradient set':>16} {'cached ns/tensor':>17} {'realloc ns/tensor':>18} {'ratio':>6}")
    for count, numel in SETS:
        tensors = [torch.empty(numel) for _ in range(count)]
        cached = ns_per_tensor(tensors, args.iters, False, args.repeats)
        realloc = ns_per_tensor(tensors, args.iters, True, args.repeats)
        name = f"{count} x {numel} fp32"
        print(f"{name:>16} {cached:17.2f} {realloc:18.2f} {realloc / cached:6.2f}")


if __name__ == "__main__":
    main()
