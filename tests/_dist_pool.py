"""Real torch.distributed processes for the tests: a pool of ranks that run scenario functions.

Starting a process costs a torch import (seconds on a 2-core machine), so the ranks are started
once and reused: ``pool.run("name", **kwargs)`` runs ``tests/_dist_scenarios.py``'s
``name(rank, world, device, **kwargs)`` on every rank at once and returns their results, in rank
order.  Everything is bounded in time: the process group's own timeout makes a rank that waits
on a missed collective raise, and ``run`` gives up after ``timeout`` seconds; a pool that failed
that way is closed, and the next test gets a fresh one.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

# A missed collective raises in the rank after this long (gloo and NCCL honour it).
COLLECTIVE_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, backend: str, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    import _dist_scenarios  # on sys.path: spawn passes the parent's

    while True:
        task = tasks.get()
        if task is None:
            break
        name, kwargs = task
        try:
            value = getattr(_dist_scenarios, name)(rank, world, device, **kwargs)
            results.put((rank, True, value))
        except BaseException:  # noqa: BLE001  (reported to the test, which fails)
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int = 2, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.world, self.backend = world, backend
        self.broken = False
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world, port, backend, self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, name: str, timeout: float = 90.0, **kwargs: Any) -> list[Any]:
        """name(rank, world, device, **kwargs) on every rank; their results in rank order.
        Raises AssertionError with the rank's traceback if one raised, TimeoutError if the ranks
        did not all answer within timeout seconds (the pool is then closed)."""
        for q in self.tasks:
            q.put((name, kwargs))
        out: list[Any] = [None] * self.world
        errors = []
        deadline = time.monotonic() + timeout
        for _ in range(self.world):
            left = deadline - time.monotonic()
            try:
                rank, ok, value = self.results.get(timeout=max(left, 0.1))
            except queue.Empty:
                self.close()
                raise TimeoutError(
                    f"scenario {name!r}: not every rank answered within {timeout} s "
                    f"(answered: {[r for r in range(self.world) if out[r] is not None]})"
                ) from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            # A rank that failed may have left the others in a collective: start afresh.
            self.close()
            raise AssertionError(f"scenario {name!r} failed\n" + "\n".join(errors))
        return out

    def close(self) -> None:
        self.broken = True
        for q in self.tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
