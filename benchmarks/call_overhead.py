"""Fixed cost of one op call: one 16-element float32 CPU tensor, inv_scale 1, through each door
to the unscale op - torch's generated binding, torch.ops for torch's op and for ours, the
ampfused.ops wrapper and its eager entry point in ampfused._C.  Median of 2,500 calls; the doors
are interleaved over 9 rounds and the lowest median kept (a shared machine's noise only adds).

    python -m benchmarks.call_overhead
"""

from __future__ import annotations

import statistics
import time

import torch

from ampfused import _C, ops


def main() -> None:
    g, f, inv = [torch.randn(16)], torch.zeros(()), torch.full((), 1.0)
    doors = {
        "torch._amp_foreach_non_finite_check_and_unscale_": (
            lambda: torch._amp_foreach_non_finite_check_and_unscale_(g, f, inv)
        ),
        "torch.ops.aten._amp_foreach_non_finite_check_and_unscale_": (
            lambda: torch.ops.aten._amp_foreach_non_finite_check_and_unscale_(g, f, inv)
        ),
        "torch.ops.ampfused.non_finite_check_and_unscale_": (
            lambda: torch.ops.ampfused.non_finite_check_and_unscale_(g, f, inv)
        ),
        "ampfused.ops.non_finite_check_and_unscale_": (
            lambda: ops.non_finite_check_and_unscale_(g, f, inv)
        ),
    }
    if hasattr(_C, "non_finite_check_and_unscale_"):  # builds before the eager entry points
        doors["ampfused._C.non_finite_check_and_unscale_"] = lambda: (
            _C.non_finite_check_and_unscale_(g, f, inv)
        )
    doors["(timer floor: an empty lambda)"] = lambda: None
    best = dict.fromkeys(doors, float("inf"))
    for _ in range(9):
        for name, fn in doors.items():
            times = []
            for _ in range(2500):
                t0 = time.perf_counter_ns()
                fn()
                times.append(time.perf_counter_ns() - t0)
            best[name] = min(best[name], statistics.median(times))
    for name, ns in best.items():
        print(f"{ns:7.0f} ns  {name}")


if __name__ == "__main__":
    main()
