"""Pure-PyTorch specification of the ampfused ops: slow, obvious, and shared by tests,
benchmarks and anyone who wants to know exactly what an op computes.

Each function equals its namesake in :mod:`ampfused.ops` bit for bit on non-overlapping
gradients (overlapping ones are covered by the ops' own tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def unscale_into_(
    grads: list[Tensor], out: list[Tensor], found_inf: Tensor, inv_scale: Tensor
) -> None:
    """Each gradient widened to float32 into its out tensor, then unscaled there (multiply-or-
    pass); found_inf from the inputs (widening is exact, so the same test)."""
    for g, o in zip(grads, out, strict=True):
        o.copy_(g)
    non_finite_check_and_unscale_(out, found_inf, inv_scale)


def master_weights_step(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    params: list[Tensor],
    masters: list[Tensor],
    before_step: Callable[[], object] | None = None,
) -> None:
    """One step of the float32-master recipe, with torch's own scaler, in plain PyTorch.

    ``optimizer`` is built over ``masters`` (float32 copies of the low-precision ``params``,
    e.g. ``p.detach().float().requires_grad_()``).  Cast each parameter's gradient to its
    master's (``.float()``, exact), let ``scaler`` unscale and step the masters as it would any
    float32 model (``before_step``, e.g. ``scaler.unscale_`` then clipping, runs first), then
    copy the masters back to the parameters, rounded.  ampfused.MasterWeights with
    ampfused.GradScaler gives the same bits (tests/test_master_weights.py).
    """
    for p, m in zip(params, masters, strict=True):
        m.grad = None if p.grad is None else p.grad.float()
    if before_step is not None:
        before_step()
    scaler.step(optimizer)
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            p.copy_(m)


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
STAT_COLUMNS = 7  # (ampfused.ops.STAT_FIELDS)
HALF_NORMAL = 2.0**-14  # float16's smallest normal: below it the subnormal column counts


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

    Returns a float64 ``[sum(ceil(numel / 65536)), 7]`` tensor: for each gradient in order (zero-
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
    - subnormal: for a float16 gradient, the count of finite u with 0 < |u| < 2^-14, float16's
      smallest normal (its subnormals); 0 for the other dtypes.
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
                    float(((u != 0) & (u.abs() < HALF_NORMAL)).sum())
                    if g.dtype == torch.float16
                    else 0.0,
                ]
            )
    return torch.tensor(rows, dtype=torch.float64).reshape(-1, STAT_COLUMNS)


def reduce_grad_stats(item_rows: Tensor, numels: list[int]) -> tuple[Tensor, float]:
    """Per-gradient statistics from the item rows (``table[1:]``) of gradients of ``numels``
    elements: per gradient, its ceil(numel / 65536) rows reduced in order - sum_squares summed
    sequentially in float64, counts summed, abs_max the max - into a float64 ``[len(numels), 7]``
    tensor; and the total sum of squares over every row, in :func:`stat_total`'s order.
    A gradient's L2 norm is float32(sqrt(sum_squares))."""
    out = torch.zeros(len(numels), STAT_COLUMNS, dtype=torch.float64)
    rows = item_rows.tolist()
    r = 0
    for i, n in enumerate(numels):
        acc = [0.0] * STAT_COLUMNS
        for row in rows[r : r + -(-n // STAT_CHUNK)]:
            abs_max = max(acc[1], row[1])
            acc = [a + b for a, b in zip(acc, row, strict=True)]
            acc[1] = abs_max
        r += -(-n // STAT_CHUNK)
        out[i] = torch.tensor(acc, dtype=torch.float64)
    if r != item_rows.shape[0]:
        raise ValueError(f"item_rows has {item_rows.shape[0]} rows, numels account for {r}")
    return out, stat_total(item_rows)[0]


TOTAL_LANES = 256


def stat_total(item_rows: Tensor) -> tuple[float, float, float, float]:
    """(sum_squares, abs_max, non_finite, nan) over a table's item rows, in a fixed order:
    lane l = 0..255 takes rows l, l + 256, l + 512, ... in order (sum_squares added in float64,
    abs_max the max, non_finite += pos_inf + neg_inf + nan, nan += nan); then for h = 128, 64,
    ..., 1: lane[j] += lane[j + h] for j < h, field by field.  The result is lane 0."""
    lanes = [[0.0, 0.0, 0.0, 0.0] for _ in range(TOTAL_LANES)]
    for r, row in enumerate(item_rows.tolist()):
        lane = lanes[r % TOTAL_LANES]
        lane[0] += row[0]
        lane[1] = max(lane[1], row[1])
        lane[2] += row[2] + row[3] + row[4]
        lane[3] += row[4]
    h = TOTAL_LANES // 2
    while h:
        for j in range(h):
            a, b = lanes[j], lanes[j + h]
            lanes[j] = [a[0] + b[0], max(a[1], b[1]), a[2] + b[2], a[3] + b[3]]
        h //= 2
    return tuple(lanes[0])  # type: ignore[return-value]


def total_norm(item_rows: Tensor, norm_type: float) -> float:
    """The norm of order 2 or inf of every unscaled element behind the item rows, in float64:
    2: sqrt of :func:`stat_total`'s sum of squares; inf: NaN if an element was NaN (or a square
    is NaN), else inf if one was inf, else the largest finite magnitude."""
    sum_squares, abs_max, non_finite, nan = stat_total(item_rows)
    if norm_type == 2.0:
        return math.sqrt(sum_squares) if sum_squares == sum_squares else math.nan
    if norm_type != math.inf:
        raise NotImplementedError(f"norm_type must be 2 or inf, got {norm_type}")
    if nan > 0 or sum_squares != sum_squares:
        return math.nan
    return math.inf if non_finite > 0 else abs_max


def clip_factor_(
    grad_stats: Tensor,
    state: Tensor | None,
    total_norm: Tensor,
    factor: Tensor,
    max_norm: float,
    norm_type: float = 2.0,
) -> None:
    """total_norm = float32(:func:`total_norm` of the table's item rows); factor = inv *
    clamp((1 / (total_norm + 1e-6)) * max_norm, max=1.0), each operation in float32 as torch's
    ``max_norm / (total_norm + 1e-6)`` rounds it, inv = :func:`inv_scale_of` the state's scale
    (1 when state is None)."""
    f32 = torch.float32
    total = torch.tensor(globals()["total_norm"](grad_stats[1:].cpu(), norm_type)).to(f32)
    coef = torch.tensor(1.0, dtype=f32) / (total + torch.tensor(1e-6, dtype=f32))
    coef = torch.clamp(coef * torch.tensor(max_norm, dtype=f32), max=1.0)
    inv = torch.tensor(1.0, dtype=f32) if state is None else inv_scale_of(_state_scale(state))
    total_norm.fill_(total)
    factor.fill_((inv.reshape(()) * coef).item())


def _state_scale(state: Tensor) -> Tensor:
    return state[0:1].view(torch.float32).cpu()


def clip_grad_norm_(
    grads: list[Tensor], scale: Tensor | None, max_norm: float, norm_type: float = 2.0
) -> Tensor:
    """What ``GradScaler.clip_grad_norm_`` computes for gradients of one device, still scaled by
    ``scale`` (None: already unscaled): the item rows of a check-only pass
    (:func:`grad_stats` with inv = :func:`inv_scale_of` scale), :func:`clip_factor_` from them,
    then one multiply-or-pass of every element by the factor (as
    :func:`non_finite_check_and_unscale_`).  Returns the float32 total norm."""
    inv = 1.0 if scale is None else float(inv_scale_of(scale.cpu()).item())
    rows = grad_stats(grads, inv, check_only=True)
    table = torch.cat([torch.zeros(1, rows.shape[1], dtype=torch.float64), rows])
    total, factor = torch.empty((), dtype=torch.float32), torch.empty((), dtype=torch.float32)
    state = None
    if scale is not None:
        state = torch.zeros(STATE_SIZE, dtype=torch.int32)
        state[0:1].view(torch.float32).copy_(scale.reshape(1).cpu())
    clip_factor_(table, state, total, factor, max_norm, norm_type)
    _unscale_(grads, float(factor.item()))
    return total


# ----------------------------------------------------------------------------- the scaler's state
# GradScaler's state as a list (ops.STATE_FIELDS): [scale, growth_tracker, hysteresis_left, steps,
# skipped_steps, consecutive_skips, growths, backoffs, floor_hits, magnitude, ceiling,
# since_backoff, *history, margin], the scale, the magnitude, the ceiling, the HISTORY entries
# and the margin Python floats holding float32 values, the rest Python ints.  The ops keep it in
# an int32 tensor (the floats as their bits).
HISTORY = 16
STATE_SIZE = 13 + HISTORY
MARGIN = 12 + HISTORY
_FLOAT_FIELDS = {0, 9, 10, *range(12, STATE_SIZE)}
HALF_MAX = 65504.0
CEILING_WINDOW = 2 * HISTORY
BLIND_GROWTH_LIMIT = 65536.0
MARGIN_LEAST = 1.4142135381698608  # sqrt(2) in float32
MARGIN_DECAY = 2 ** (-1 / 512)
_INT32_MAX = 2**31 - 1
_F32_MAX = 3.4028234663852886e38


def _f32(x: float) -> float:
    """x rounded to float32 (to +-inf beyond its range), as a Python float."""
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).item()


def _wrap32(x: int) -> int:
    """x modulo 2**32, as an int32: the counters wrap instead of overflowing."""
    return (x + 2**31) % 2**32 - 2**31


def update_state(
    state: list[int | float],
    found: bool,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float = float("-inf"),
    max_scale: float = float("inf"),
    hysteresis: int = 1,
    headroom: float = 0.0,
    magnitude: float = 0.0,
) -> list[int | float]:
    """The scaler's state after one iteration: the rule of ``scaler_pass_`` and ``scaler_update_``.

    ``torch._amp_update_scale_`` (see :func:`update_rule`) with four additions, none of which
    changes anything at their defaults (-inf, inf, 1, 0):

    * hysteresis (apex's ``update_scale_hysteresis``): an iteration that found inf/NaN uses up one
      of ``hysteresis_left`` (down to 0) and backs the scale off only when none is left, so the
      scale backs off on the ``hysteresis``-th overflowing iteration in a row and on every one
      after it; a clean iteration refills ``hysteresis_left`` to ``hysteresis``.  Every
      overflowing iteration resets the growth tracker, backing off or not.
    * min_scale: a backoff that would go below it stops there, or stays where it is when the scale
      already was below (an overflow never raises the scale); that counts as a floor hit.
    * max_scale: a growth that would go above it stops there, or stays where it is when the scale
      already was above (a clean iteration never lowers the scale).
    * headroom > 0, the headroom policy: ``magnitude`` is the largest finite |scaled gradient| the
      iteration measured (0: none).  The iteration's entry of the history (slot steps % HISTORY)
      is, after an overflow, the scale it backed off to, negated (a bound; +inf where the
      history's other entries hold no cap: nothing was measured lately, as before the first
      measured step, so the overflow says nothing about the level the measurements will find);
      after a clean iteration the cap
      ``HALF_MAX * scale / (headroom * magnitude)`` (float64, rounded to float32, at most
      float32's largest finite value; +inf where nothing was measured).  A clean iteration then
      moves the scale to the lowest bound of the history (its caps and its overflows' bounds;
      with a learned margin the caps times ``headroom / margin``, float64, rounded to float32,
      at most float32's largest finite value): up by growth_factor as many times as it
      stays within it (a growth beyond max_scale held there), else down by backoff_factor until
      it is within it (held at min_scale), at most 64 factors per iteration.  Where the history
      holds no cap and there is no ceiling (nothing measured), it grows by growth_factor each
      clean iteration up to BLIND_GROWTH_LIMIT (torch's initial scale), then by torch's rule.
      ``since_backoff`` counts clean iterations since the last overflow that backed off
      (saturating at 2**31 - 1, its value before any): an overflow that backs off while it is
      below CEILING_WINDOW, or while there is a ceiling, makes its scale the ceiling (if lower),
      and the scale is then held at most ceiling * backoff_factor; every growth_interval clean
      iterations after a backoff the ceiling is multiplied by growth_factor (a probe, as torch's
      rule grows).  A clean iteration that measures while the history's other entries hold no
      cap forgets the ceiling and the backoff first (both learned from overflows of gradients
      that were not measured).  The tracker counts clean iterations since the last overflow.
    * headroom < 0: the headroom policy with a learned margin, at most ``-headroom``: after a
      clean iteration that measured (a finite cap), the margin (the state's last field; 0: none
      learned, read as the most) becomes ``margin * MARGIN_DECAY``, raised to ``MARGIN_LEAST``
      times the history's lowest cap of a clean iteration over this cap (how far the magnitude
      rose above the history's largest), held from MARGIN_LEAST to the most (float64, rounded
      to float32).  Otherwise the margin stays.

    min_scale and max_scale are compared in float32, as the kernels hold them.  The counters
    (int32, wrapping): steps +1 every iteration; skipped_steps +1 and consecutive_skips +1 when
    found, consecutive_skips back to 0 when clean; growths / backoffs +1 when the scale went up /
    down; floor_hits +1 on a floor hit.  The magnitude field becomes the iteration's (+inf when
    found).
    """
    state = _full(state)
    scale, tracker, left, steps, skipped, consecutive, growths, backoffs, floor_hits = state[:9]
    learned, headroom = headroom < 0, abs(headroom)
    ceiling = state[10] if headroom > 0 else math.inf
    since_backoff = state[11]
    history = list(state[12:MARGIN])
    margin = state[MARGIN]
    scale = _f32(float(scale))
    low, high = _f32(min_scale), _f32(max_scale)
    new_scale, floor_hit = scale, False
    slot = (steps % 2**32) % HISTORY
    cap = math.inf
    # Whether the history holds a cap (this slot's, the oldest, aside).  An overflow while none is
    # held (a NaN in the first step) says nothing about the level the measurements will find.
    measured = any(math.isfinite(h) for j, h in enumerate(history) if j != slot)
    if found:
        magnitude = math.inf
        tracker = 0
        left = max(left - 1, 0)
        if left == 0:
            new_scale = _f32(scale * backoff_factor)
            if new_scale < low:
                new_scale, floor_hit = min(scale, low), True
            if headroom > 0:
                if since_backoff < CEILING_WINDOW or math.isfinite(ceiling):
                    ceiling = min(ceiling, scale)
                since_backoff = 0
        cap = -new_scale if measured else math.inf  # (a bound, not a measurement)
    else:
        left = hysteresis
        tracker = _wrap32(tracker + 1)
        allowed = math.inf
        if headroom > 0:
            cap = _headroom_cap(scale, magnitude, headroom)
            if not measured and math.isfinite(cap):  # the first measurement after none
                ceiling, since_backoff = math.inf, _INT32_MAX
            since_backoff = min(since_backoff + 1, _INT32_MAX)
            if growth_interval > 0 and since_backoff % growth_interval == 0:
                ceiling = _f32(ceiling * growth_factor)  # a probe
            others = [h for j, h in enumerate(history) if j != slot]
            lowest_cap = min([h for h in others if h > 0], default=math.inf)
            allowed = min(cap, lowest_cap)
            if learned:
                if math.isfinite(cap):
                    margin = _learned_margin(margin, lowest_cap, cap, _f32(headroom))
                in_force = margin if margin > 0 else _f32(headroom)
                if math.isfinite(allowed):
                    allowed = min(_f32(allowed * _f32(headroom) / in_force), _F32_MAX)
            bounds = [abs(h) for h in others if not h > 0]
            allowed = min([allowed, _f32(ceiling * backoff_factor), *bounds])
        if headroom > 0 and math.isfinite(allowed):
            new_scale = _headroom_move(scale, allowed, growth_factor, backoff_factor, low, high)
        elif headroom > 0 and scale < BLIND_GROWTH_LIMIT:  # nothing measured yet: a fast start
            grown = min(_f32(scale * growth_factor), BLIND_GROWTH_LIMIT)
            if grown > high:
                grown = max(scale, high)
            new_scale = max(grown, scale)
        elif tracker == growth_interval:
            tracker = 0
            grown = _f32(scale * growth_factor)
            if math.isfinite(grown):  # a growth that overflows float32 keeps the scale
                new_scale = grown if grown <= high else max(scale, high)
    if headroom > 0:
        history[slot] = cap
    return [
        new_scale,
        tracker,
        left,
        _wrap32(steps + 1),
        _wrap32(skipped + found),
        _wrap32(consecutive + 1) if found else 0,
        _wrap32(growths + (new_scale > scale)),
        _wrap32(backoffs + (new_scale < scale)),
        _wrap32(floor_hits + floor_hit),
        _f32(magnitude),
        ceiling if headroom > 0 else state[10],
        since_backoff,
        *history,
        margin if headroom > 0 and learned else state[MARGIN],
    ]


_F32_INF_BITS = 0x7F800000


def _magnitude_bits(state: Tensor) -> int:
    """A state's magnitude field as the kernels compare it: unsigned float32 bits."""
    return int(state[9].item()) % 2**32


def _bits_f32(bits: int) -> float:
    return (
        torch.tensor(bits - 2**32 if bits >= 2**31 else bits, dtype=torch.int32)
        .view(torch.float32)
        .item()
    )


def _learned_margin(margin: float, lowest_cap: float, cap: float, most: float) -> float:
    m = (margin if 0 < margin < math.inf else most) * MARGIN_DECAY
    if math.isfinite(lowest_cap):
        m = max(m, lowest_cap / cap * MARGIN_LEAST if cap > 0 else math.inf)
    return _f32(min(max(m, MARGIN_LEAST), most))


def _headroom_cap(scale: float, magnitude: float, headroom: float) -> float:
    if not magnitude > 0:
        return math.inf
    return min(_f32(HALF_MAX * scale / (_f32(headroom) * magnitude)), _F32_MAX)


def _headroom_move(
    scale: float, allowed: float, growth: float, backoff: float, low: float, high: float
) -> float:
    s = scale
    for _ in range(64):
        g = _f32(s * growth)
        if not g > s or not math.isfinite(g) or g > allowed:
            break
        if g > high:
            if s < high <= allowed:
                s = high
            break
        s = g
    if s != scale:
        return s
    for _ in range(64):
        if not s > allowed:
            break
        b = _f32(s * backoff)
        if not b < s:
            break
        if b < low:
            if s > low:
                s = low
            break
        s = b
    return s


def _full(state: list[int | float]) -> list[int | float]:
    """A state list of the first nine fields only (scale to floor_hits) completed as a fresh
    state completes them: nothing measured, no ceiling, no backoff yet, no cap."""
    if len(state) == 9:
        return [*state, 0.0, math.inf, _INT32_MAX] + [math.inf] * HISTORY + [0.0]
    return list(state)


def initial_state(scale: float, hysteresis: int = 1) -> list[int | float]:
    """A fresh state: the scale, a zero tracker and counters, ``hysteresis`` left, nothing
    measured, no cap in the history."""
    return _full([_f32(scale), 0, hysteresis, 0, 0, 0, 0, 0, 0])


def magnitude(grads: list[Tensor]) -> float:
    """The headroom policy's measurement of a pass without statistics: the largest finite |v|
    over the (scaled) values of ``grads``, as a float32 (0.0 for none)."""
    best = 0.0
    for g in grads:
        v = g.detach().double().abs()
        v = v[torch.isfinite(v)]
        if v.numel():
            best = max(best, min(_f32(v.max().item()), _F32_MAX))
    return best


def stat_magnitude(item_rows: Tensor, scale: float) -> float:
    """The measurement of a pass with statistics: each item's abs-max times the scale (float64,
    rounded to float32, at most its largest finite value), the largest of them (0.0 for none)."""
    best = 0.0
    for a in item_rows[:, 1].tolist():
        if a * scale > 0:  # (a scale <= 0 or NaN measures nothing)
            best = max(best, min(_f32(a * scale), _F32_MAX))
    return best


def state_to_list(state: Tensor) -> list[int | float]:
    """An int32 state tensor as :func:`update_state` takes it."""
    ints = state.tolist()  # (no .cpu(): on the CPU it returns the tensor itself)
    floats = state.view(torch.float32).tolist()
    return [floats[k] if k in _FLOAT_FIELDS else ints[k] for k in range(STATE_SIZE)]


def state_from_list(values: list[int | float], into: Tensor) -> None:
    """Writes :func:`update_state`'s list (or its first nine fields: :func:`_full`) into an
    int32 state tensor."""
    values = _full(values)
    bits = [
        torch.tensor(v, dtype=torch.float32).view(torch.int32).item() if k in _FLOAT_FIELDS else v
        for k, v in enumerate(values)
    ]
    into.copy_(torch.tensor(bits, dtype=torch.int32))


def _update_into(
    next_state: Tensor, state: Tensor, found: bool, policy: tuple, headroom: float, magnitude: float
) -> None:
    new = update_state(state_to_list(state), found, *policy, headroom, magnitude)
    state_from_list(new, next_state)


def scaler_update_(
    found_inf: Tensor,
    state: Tensor,
    next_state: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float = float("-inf"),
    max_scale: float = float("inf"),
    hysteresis: int = 1,
    headroom: float = 0.0,
) -> None:
    """The update with found_inf's verdict (nonzero is found, NaN included, as torch's `if
    (*found_inf)`) and, with headroom != 0, the magnitude next_state holds (+inf there counts as
    none)."""
    policy = (growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis)
    bits = _magnitude_bits(next_state) if headroom else 0
    measured = _bits_f32(bits) if bits < _F32_INF_BITS else 0.0
    _update_into(next_state, state, found_inf.item() != 0, policy, headroom, measured)


def scaler_pass_(
    grads: list[Tensor],
    found_inf: Tensor,
    state: Tensor,
    next_state: Tensor,
    grad_stats: Tensor | None,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    min_scale: float = float("-inf"),
    max_scale: float = float("inf"),
    hysteresis: int = 1,
    check_only: bool = False,
    accumulate: bool = False,
    headroom: float = 0.0,
    islands: list[int] | tuple[int, ...] = (),
    island_inv: Tensor | None = None,
) -> None:
    """:func:`unscale_update_scale_` over the whole state, by :func:`update_state`; grad_stats
    (when given) receives the header (scale in force, steps so far, found) and the rows of
    :func:`grad_stats`.  With headroom != 0 the pass measures the magnitude (:func:`magnitude`,
    or with grad_stats :func:`stat_magnitude`); with accumulate the iteration's magnitude is the
    largest of it and next_state's (+inf there: an earlier pass found inf/NaN), and the update
    is computed again from state.

    Scale islands: a gradient of island k >= 1 (``islands``) is unscaled, and its statistics
    taken, with the pass's inverse scale times ``island_inv[k - 1]`` (a float32 product), and its
    magnitude measured at the global scale (times ``island_inv[k - 1]``); inf/NaN in it is found
    as anywhere."""
    found = _any_non_finite(grads)
    of = list(islands) if islands else [0] * len(grads)
    scale = state[0:1].view(torch.float32)
    inv = inv_scale_of(scale)

    def inv_of(k: int) -> Tensor:
        if k == 0:
            return inv
        assert island_inv is not None
        return inv * island_inv[k - 1 : k].cpu()

    measured = 0.0
    if headroom and grad_stats is None:
        # (an island's at the global scale: its magnitude times its inverse factor)
        factors = [1.0 if k == 0 else float(island_inv[k - 1]) for k in of]  # type: ignore[index]
        measured = max(
            [_f32(magnitude([g]) * f) for g, f in zip(grads, factors, strict=True)], default=0.0
        )
    if grad_stats is not None:
        grad_stats.zero_()
        grad_stats[0, 0] = float(scale.item())
        grad_stats[0, 1] = float(state[3].item())  # steps
        grad_stats[0, 2] = 1.0 if found else 0.0
        rows = [_stat_rows([g], inv_of(k), check_only) for g, k in zip(grads, of, strict=True)]
        if rows:
            grad_stats[1:] = torch.cat(rows).to(grad_stats.device)
        if headroom and rows:  # (unscaled values: at the global scale, islands' too)
            measured = stat_magnitude(torch.cat(rows), float(scale.item()))
    if not check_only:
        for g, k in zip(grads, of, strict=True):
            _unscale_([g], float(inv_of(k).item()))
    found_inf.fill_(1.0 if found else 0.0)
    if accumulate:  # (as unsigned bits: inf, NaN and negative bits count as found)
        bits = _magnitude_bits(next_state)
        found = found or bits >= _F32_INF_BITS
        if not found:
            measured = max(measured, _bits_f32(bits))
    policy = (growth_factor, backoff_factor, growth_interval, min_scale, max_scale, hysteresis)
    _update_into(next_state, state, found, policy, headroom, measured)


_stat_rows = grad_stats  # (scaler_pass_'s argument of that name hides the function)
