"""How the CPU passes share work between threads (csrc/cpu/parallel.h): the same bits whether a
pass is split or not and whichever thread takes which piece, and the decision to split from
what earlier splits cost (a pool thread that starts late keeps later small passes on the
calling thread, and a quiet spell brings the split back).

The private ``_cpu_split_config(mode, worker_delay_ns, reset)`` forces a mode ("always",
"never"; "auto" is the default) and makes threads other than the caller sleep before their
first piece, as a thread the OS starts late does; ``_cpu_split_stats()`` reads (split passes,
passes kept on the calling thread, the expected wait in ns, ns per byte)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from ampfused import ops, reference

CONFIG = torch.ops.ampfused._cpu_split_config
STATS = torch.ops.ampfused._cpu_split_stats
TUNE = torch.ops.ampfused._cpu_split_tune
TORCH_RULE = (2.0, 0.5, 2000)
HALF_LIFE_NS = 1e9  # kLateHalfLifeNs


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Two intra-op threads (passes split only with more than one), the split's measurements
    cleared before and the default mode restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    CONFIG("auto", 0, True)
    yield
    CONFIG("auto", 0, True)
    TUNE(HALF_LIFE_NS)
    torch.set_num_threads(before)


def _grads(seed: int, with_inf: bool = False) -> list[torch.Tensor]:
    """~3 MB in 40 tensors: large ones cut into several pieces, runs of small ones, each dtype;
    scaled values (some subnormal after unscaling) and, optionally, one inf late in the list."""
    g = torch.Generator().manual_seed(seed)
    sizes = [70_000, 5, 300_000, *range(1, 30), 131_072, 65_537, 1_000, 250_000, 3, 90_000]
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    grads = []
    for i, n in enumerate(sizes):
        v = torch.randn(n, generator=g) * 2.0 ** torch.randint(-20, 12, (n,), generator=g)
        grads.append(v.to(dtypes[i % 3]))
    if with_inf:
        grads[-3][500] = float("inf")
    return grads


def _bits(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.reshape(-1).contiguous().view(torch.uint8).clone() for t in ts]


def _plain(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    found = torch.zeros(1)
    ops.non_finite_check_and_unscale_(grads, found, torch.tensor([2.0**-13]))
    return [found]


def _measuring(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The headroom policy's pass: it also measures the largest magnitude."""
    state = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    reference.state_from_list(reference.initial_state(2.0**13), state)
    nxt, found = torch.zeros_like(state), torch.zeros(())
    ops.scaler_pass_(grads, found, state, nxt, None, *TORCH_RULE, headroom=4.0)
    return [found, nxt]


def _statistics(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    state = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    reference.state_from_list(reference.initial_state(2.0**13), state)
    nxt, found = torch.zeros_like(state), torch.zeros(())
    table = torch.empty(ops.grad_stats_rows(grads), len(ops.STAT_FIELDS), dtype=torch.float64)
    ops.scaler_pass_(grads, found, state, nxt, table, *TORCH_RULE)
    return [found, nxt, table]


def _into(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [torch.empty_like(g, dtype=torch.float32) for g in grads]
    found = torch.zeros(1)
    ops.unscale_into_(grads, out, found, torch.tensor([2.0**-13]))
    return [found, *out]


PASSES: dict[str, Callable[[list[torch.Tensor]], list[torch.Tensor]]] = {
    "plain": _plain,
    "measuring": _measuring,
    "statistics": _statistics,
    "into": _into,
}


@pytest.mark.parametrize("with_inf", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("name", PASSES)
def test_split_or_not_same_bits(name: str, with_inf: bool) -> None:
    """On the calling thread, split, and split with the other thread 20 ms late (the caller
    takes its share): the same gradients and outputs, bit for bit."""
    results = []
    for mode, delay_ns in (("never", 0), ("always", 0), ("always", 20_000_000)):
        CONFIG(mode, delay_ns, True)
        grads = _grads(1, with_inf)
        outputs = PASSES[name](grads)
        results.append(_bits(grads) + _bits(outputs))
        split, kept = STATS()[:2]
        assert (split, kept) == ((0, 0) if mode == "never" else (1, 0)), mode
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_late_thread_keeps_small_passes_on_the_calling_thread() -> None:
    """A split whose other thread starts 50 ms late is measured; the next small pass runs on the
    calling thread (its saving, tens of microseconds, is below the expected wait), and once
    the measurement has faded the passes split again."""
    grads = _grads(2)
    _plain(grads)  # the first split (the pool's start is its own cost: not measured)
    assert STATS()[:3] == (1, 0, 0.0)
    CONFIG("auto", 50_000_000, False)
    _plain(grads)
    split, kept, late_ns, ns_per_byte = STATS()
    assert (split, kept) == (2, 0)
    assert late_ns >= 50e6 / 32 * 0.9  # (the wait weighs 1/32 of the running mean)
    assert ns_per_byte > 0.0
    CONFIG("auto", 0, False)  # the thread is prompt again; the measurement stays
    for _ in range(3):
        _plain(grads)
    assert STATS()[:2] == (2, 3)

    TUNE(1e5)  # the wait fades in 0.1 ms instead of a second
    time.sleep(0.02)
    _plain(grads)
    assert STATS()[:2] == (3, 3)  # (what later splits measure is this machine's to say)


def test_prompt_threads_keep_splitting() -> None:
    """Without a late thread a large pass keeps splitting: its saving (about a millisecond for
    32 MB here) is far above the waits of prompt threads, a stray hiccup included."""
    grads = [torch.randn(8 << 20)]
    for _ in range(20):
        _plain(grads)
    split, kept, late_ns, _ = STATS()
    assert split + kept == 20 and split >= 15, (split, kept, late_ns)


def test_small_passes_are_not_split() -> None:
    """Under 256 KB a pass runs on the calling thread without asking (no count either way)."""
    CONFIG("always", 0, True)
    _plain([torch.randn(60_000)])  # 240 KB
    assert STATS()[:2] == (0, 0)
    torch.set_num_threads(1)
    _plain(_grads(4))
    assert STATS()[:2] == (0, 0)


def test_config_refuses_unknown_modes() -> None:
    with pytest.raises(ValueError, match="mode must be 'auto', 'always' or 'never'"):
        CONFIG("sometimes", 0, True)
    with pytest.raises(ValueError, match="worker_delay_ns must be >= 0"):
        CONFIG("auto", -1, True)
    assert CONFIG("never", 0, True) == "auto"
    assert CONFIG("auto", 0, True) == "never"
