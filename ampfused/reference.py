"""Pure-PyTorch specification of the ampfused ops: slow, obvious, and shared by tests,
benchmarks and anyone who wants to know exactly what an op computes.

Each function equals its namesake in :mod:`ampfused.ops` bit for bit on non-overlapping
gradients (overlapping ones are covered by the ops' own tests).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _any_non_finite(grads: list[Tensor]) -> bool:
    return any(not bool(torch.isfinite(g.to(_opmath(g.dtype))).all()) for g in grads if g.numel())


def _unscale_(grads: list[Tensor], inv_scale: float) -> None:
    for g in grads:
        if g.numel() == 0:
            continue
        v = g.to(_opmath(g.dtype))
        if inv_scale != 1.0:
            v = v * torch.tensor(inv_scale, dtype=torch.float32).to(v.dtype)
        g.copy_(v)


def inv_scale_of(scale: Tensor) -> Tensor:
    """float32(1 / float64(scale)), exactly how torch.amp.GradScaler derives inv_scale."""
    return scale.double().reciprocal().float()


def update_rule(
    scale: float,
    growth_tracker: int,
    found: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> tuple[float, int]:
    """``torch._amp_update_scale_`` on Python numbers; the scale is rounded to float32."""

    def f32(x: float) -> float:
        return torch.tensor(x, dtype=torch.float32).item()

    if found:
        return f32(scale * backoff_factor), 0
    successful = growth_tracker + 1
    if successful == growth_interval:
        grown = f32(scale * growth_factor)
        return (grown if abs(grown) != float("inf") and grown == grown else f32(scale)), 0
    return f32(scale), successful


def non_finite_check_and_unscale_(
    grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    if _any_non_finite(grads):
        found_inf.fill_(1.0)
    _unscale_(grads, float(inv_scale.item()))


def non_finite_check_(grads: list[Tensor], found_inf: Tensor) -> None:
    if _any_non_finite(grads):
        found_inf.fill_(1.0)


def unscale_update_scale_(
    grads: list[Tensor],
    found_inf: Tensor,
    scale: Tensor,
    growth_tracker: Tensor,
    next_scale: Tensor,
    next_growth_tracker: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    check_only: bool = False,
    accumulate: bool = False,
) -> None:
    found = _any_non_finite(grads)
    if not check_only:
        _unscale_(grads, float(inv_scale_of(scale).item()))
    found_inf.fill_(1.0 if found else 0.0)
    if not accumulate or found:
        s, t = update_rule(
            float(scale.item()),
            int(growth_tracker.item()),
            found,
            growth_factor,
            backoff_factor,
            growth_interval,
        )
        next_scale.fill_(s)
        next_growth_tracker.fill_(t)


# --------------------------------------------------------------------------- grad_stats
# The per-gradient statistics of scaler_pass_ (csrc/unscale_math.h: StatField, the lane order).
STAT_CHUNK = 65536  # elements per work item: one row of the table each
STAT_THREADS = 512


def _elements(g: Tensor) -> Tensor:
    """g's elements in the order the kernels visit them: memory order for a dense gradient (any
    stride permutation: the pass walks its memory block), row-major order (``g.contiguous()``)
    for one with gaps, which the pass packs first."""
    dims = sorted((st, sz) for st, sz in zip(g.stride(), g.shape, strict=True) if sz != 1)
    dense = all(st == math.prod(sz for _, sz in dims[:k]) for k, (st, _) in enumerate(dims))
    if dense:  # the numel locations from the storage offset on, in their order
        return g.as_strided((g.numel(),), (1,))
    return g.contiguous().reshape(-1)


def _item_sum_squares(sq: Tensor, vec: int) -> float:
    # Lane l of L = 512 * vec adds the squares of elements l, l + L, ... in order; thread t sums
    # lanes t*vec .. t*vec+vec-1 in order; then a pairwise tree over the 512 thread sums.
    lanes_n = STAT_THREADS * vec
    rows = -(-sq.numel() // lanes_n)
    padded = torch.zeros(rows * lanes_n, dtype=sq.dtype)
    padded[: sq.numel()] = sq  # + 0 leaves a lane's sum as it is
    padded = padded.view(rows, lanes_n)
    lanes = torch.zeros(lanes_n, dtype=sq.dtype)
    for j in range(rows):
        lanes = lanes + padded[j]
    lanes = lanes.view(STAT_THREADS, vec)
    s = lanes[:, 0]
    for k in range(1, vec):
        s = s + lanes[:, k]
    h = STAT_THREADS // 2
    while h:
        s = s[:h] + s[h : 2 * h]
        h //= 2
    return float(s[0])


def grad_stats(grads: list[Tensor], inv_scale: float | Tensor, check_only: bool) -> Tensor:
    """The item rows of scaler_pass_'s ``grad_stats`` table (the rows after the header), for the
    gradients as they are BEFORE the pass; the gradients are not modified.

    Returns a float64 ``[sum(ceil(numel / 65536)), 6]`` tensor: for each gradient in order (zero-
    size ones have no rows), its elements in :func:`_elements` order cut into items of 65536,
    one row per item with the columns of ``ampfused.ops.STAT_FIELDS``:

    - u is the unscaled element as the optimizer sees it: in a writing pass the value written
      back (``v * inv`` in opmath - float32, float64 for float64 grads - rounded to the grad's
      dtype, read back in opmath); with ``check_only`` (nothing written) ``v * inv`` in opmath.
      Where inv == 1, u is v unmultiplied (the multiply-or-pass rule).
    - sum_squares: the sum of u*u in opmath, in a fixed order independent of the backend and of
      alignment: with V = 16 / itemsize (float32 4, float16/bfloat16 8, float64 2) and
      L = 512 * V, element i of the item adds its square (rounded) to lane i % L, lanes in
      increasing i; thread t = 0..511 sums lanes t*V .. t*V+V-1 in order; then for h = 256, 128,
      ..., 1: s[j] = s[j] + s[j + h] for j < h.  The row holds s[0] widened to float64.  No
      fused multiply-add anywhere.  inf and NaN propagate (as in torch.linalg.vector_norm).
    - abs_max: max |u| over the finite u (0.0 if none).
    - pos_inf, neg_inf, nan: counts of the INPUT elements v that are +inf, -inf, NaN.
    - zeros: count of u equal to zero (+0.0 or -0.0).
    """
    inv = float(inv_scale.item()) if isinstance(inv_scale, Tensor) else float(inv_scale)
    inv32 = torch.tensor(inv, dtype=torch.float32)
    rows = []
    for g in grads:
        if g.numel() == 0:
            continue
        v_all = _elements(g.detach().cpu())
        opmath = _opmath(g.dtype)
        vec = 16 // g.element_size()
        for b in range(0, v_all.numel(), STAT_CHUNK):
            x = v_all[b : b + STAT_CHUNK]
            v = x.to(opmath)
            u = v if inv == 1.0 else v * inv32.to(opmath)
            if not check_only:
                u = u.to(g.dtype).to(opmath)
            finite = torch.isfinite(u)
            abs_max = float(u[finite].abs().max()) if bool(finite.any()) else 0.0
            rows.append(
                [
                    _item_sum_squares(u * u, vec),
                    abs_max,
                    float(torch.isposinf(v).sum()),
                    float(torch.isneginf(v).sum()),
                    float(torch.isnan(v).sum()),
                    float((u == 0).sum()),
                ]
            )
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, 6)


def reduce_grad_stats(item_rows: Tensor, numels: list[int]) -> tuple[Tensor, float]:
    """Per-gradient statistics from the item rows (``table[1:]``) of gradients of ``numels``
    elements: per gradient, its ceil(numel / 65536) rows reduced in order - sum_squares summed
    sequentially in float64, counts summed, abs_max the max - into a float64 ``[len(numels), 6]``
    tensor; and the total sum of squares, summed sequentially over the gradients in float64.
    A gradient's L2 norm is float32(sqrt(sum_squares))."""
    out = torch.zeros(len(numels), 6, dtype=torch.float64)
    rows = item_rows.tolist()
    r = 0
    total = 0.0
    for i, n in enumerate(numels):
        acc = [0.0] * 6
        for row in rows[r : r + -(-n // STAT_CHUNK)]:
            abs_max = max(acc[1], row[1])
            acc = [a + b for a, b in zip(acc, row, strict=True)]
            acc[1] = abs_max
        r += -(-n // STAT_CHUNK)
        out[i] = torch.tensor(acc, dtype=torch.float64)
        total += acc[0]
    if r != item_rows.shape[0]:
        raise ValueError(f"item_rows has {item_rows.shape[0]} rows, numels account for {r}")
    return out, total
