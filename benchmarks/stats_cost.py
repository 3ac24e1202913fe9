"""Cost of scaler_pass_'s per-gradient statistics (grad_stats) against the plain pass, on the CPU.

Paired runs: each repetition times the plain pass and the stats pass back to back (in alternating
order), and the report gives the minimum of each over all repetitions and their ratio, so a
noisy machine inflates neither side alone.  The gradients are unscaled by 2 and by 0.5 in turn
(two scaler states), so their values never drift.

    PYTHONPATH=$PWD python -m benchmarks.stats_cost [--reps 40] [--dtype fp32] [--check-only]
"""

from __future__ import annotations

import argparse
import time

import torch

from ampfused import ops
from benchmarks.workloads import gpt2_124m

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _state(scale: float) -> torch.Tensor:
    s = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    s[0] = torch.tensor(scale, dtype=torch.float32).view(torch.int32)
    s[2] = 1
    return s


def _grads(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).mul_(2.0**-6).to(dtype) for s in shapes]


def measure(
    grads: list[torch.Tensor], reps: int, check_only: bool, plain_only: bool = False
) -> tuple[float, float]:
    """Minimum seconds of one plain pass and of one pass with statistics (nan: plain_only)."""
    found = torch.zeros((), dtype=torch.float32)
    states = [_state(2.0), _state(0.5)]
    nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    table = (
        None
        if plain_only
        else torch.empty(ops.grad_stats_rows(grads), len(ops.STAT_FIELDS), dtype=torch.float64)
    )
    k = 0

    def one(stats: torch.Tensor | None) -> float:
        nonlocal k
        k += 1
        t0 = time.perf_counter()
        ops.scaler_pass_(
            grads, found, states[k % 2], nxt, stats, 2.0, 0.5, 2000, check_only=check_only
        )
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: pages, thread pool
        one(None)
        one(table)
    plain, stats = float("inf"), float("nan" if plain_only else "inf")
    for r in range(reps):
        if r % 2:
            plain = min(plain, one(None))
            stats = min(stats, one(table))
        else:
            stats = min(stats, one(table))
            plain = min(plain, one(None))
    if plain_only:
        stats = float("nan")
    return plain, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument(
        "--plain-only", action="store_true", help="time the plain pass twice (no grad_stats)"
    )
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    workloads = {"gpt2-124m": gpt2_124m(), "4x16M": [(16 * 2**20,)] * 4}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
        f"check_only={args.check_only}, min of {args.reps} paired runs"
    )
    for name, shapes in workloads.items():
        grads = _grads(shapes, dtype)
        plain, stats = measure(grads, args.reps, args.check_only, args.plain_only)
        print(
            f"{name:10s} plain {plain * 1e3:8.2f} ms   stats {stats * 1e3:8.2f} ms   "
            f"ratio {stats / plain:5.3f}"
        )


if __name__ == "__main__":
    main()
