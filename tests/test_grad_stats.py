"""scaler_pass_'s per-gradient statistics (grad_stats) against ampfused.reference, bit for bit,
and the host reduction (_C.reduce_grad_stats) against reference.reduce_grad_stats and
torch.linalg.vector_norm."""

from __future__ import annotations

import math

import pytest
import torch

from ampfused import _C, ops, reference

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
L = {d: 512 * (16 // torch.tensor([], dtype=d).element_size()) for d in DTYPES}  # lanes
CHUNK = ops.CHUNK_SIZE
FIELDS = len(ops.STAT_FIELDS)
SCALE = 1000.0  # not a power of two: every unscaled value is rounded
STEPS = 7  # the state's step counter, read back from the header


def _state(scale: float, device) -> torch.Tensor:
    s = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    s[0] = torch.tensor(scale, dtype=torch.float32).view(torch.int32)
    s[ops.STATE_FIELDS.index("hysteresis_left")] = 1
    s[ops.STATE_FIELDS.index("steps")] = STEPS
    return s.to(device)


def _inv(scale: float) -> float:
    return float(reference.inv_scale_of(torch.tensor(scale, dtype=torch.float32)))


def _run(grads, scale=SCALE, check_only=False):
    """scaler_pass_ with a fresh grad_stats table; returns (table on the CPU, found)."""
    device = grads[0].device if grads else "cpu"
    found = torch.full((), 5.0, device=device)
    table = torch.full(
        (ops.grad_stats_rows(grads), len(ops.STAT_FIELDS)),
        -1.0,
        dtype=torch.float64,
        device=device,
    )
    nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32, device=device)
    ops.scaler_pass_(
        grads, found, _state(scale, device), nxt, table, 2.0, 0.5, 2000, check_only=check_only
    )
    return table.cpu(), float(found)


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit equality, NaN equal to any NaN (a NaN sum's payload is the hardware's)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    nan_a, nan_e = actual.isnan(), expected.isnan()
    assert torch.equal(nan_a, nan_e), (actual[nan_a != nan_e], expected[nan_a != nan_e])
    a, e = actual[~nan_a], expected[~nan_e]
    bad = a.view(torch.int64) != e.view(torch.int64)
    assert not bad.any(), f"{int(bad.sum())} values differ, e.g. {a[bad][:4]} vs {e[bad][:4]}"


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Scaled-gradient-like values spread over many binades, with all mantissa bits in use."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=gen, dtype=torch.float64)
    v = v * torch.exp2(torch.randint(-6, 7, (n,), generator=gen).double())
    return v.to(dtype)


def _check(grads, scale=SCALE, check_only=False):
    """Runs the pass and compares every row with the reference; returns the table."""
    expected = reference.grad_stats(grads, _inv(scale), check_only)
    before = [g.clone() for g in grads]
    table, found = _run(grads, scale, check_only)
    _same(table[1:], expected)
    nonfinite = any(not bool(torch.isfinite(g).all()) for g in before if g.numel())
    scale32 = float(torch.tensor(scale, dtype=torch.float32))  # the state holds a float32
    header = [scale32, STEPS, float(nonfinite)] + [0] * (FIELDS - 3)
    _same(table[0], torch.tensor(header, dtype=torch.float64))
    assert found == float(nonfinite)
    return table


SIZES = [0, 1, 511, 65535, 65536, 65537, 3 * 65536 + 7]


@pytest.mark.parametrize("check_only", [False, True], ids=["write", "check_only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_bit_for_bit(device, dtype, check_only):
    sizes = SIZES + [L[dtype] - 1, L[dtype], L[dtype] + 1]
    grads = [_values(n, dtype, seed).to(device) for seed, n in enumerate(sizes)]
    before = [g.clone() for g in grads]
    _check(grads, check_only=check_only)
    for g, b in zip(grads, before, strict=True):
        assert torch.equal(g, b if check_only else _unscaled(b, SCALE))


# Around float16's smallest normal 2^-14: the subnormal column counts finite u with
# 0 < |u| < 2^-14 (float16's subnormals, the values it keeps with fewer bits or loses).
EDGE = {
    "zero": (0.0, False),
    "-zero": (-0.0, False),
    "smallest normal": (2.0**-14, False),
    "-smallest normal": (-(2.0**-14), False),
    "just below": (2.0**-14 * (1 - 2.0**-10), True),  # float16's largest subnormal
    "-just below": (-(2.0**-14) * (1 - 2.0**-10), True),
    "below, 8 bits": (2.0**-14 * (1 - 2.0**-8), True),  # bfloat16's largest value below
    "smallest subnormal": (2.0**-24, True),
    "inf": (math.inf, False),
    "nan": (math.nan, False),
    "large": (3.0e4, False),  # a finite float16 maximum: the abs-max column too
}


@pytest.mark.parametrize("check_only", [False, True], ids=["write", "check_only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subnormal_count_at_every_position(device, dtype, check_only):
    """Each edge value planted alone in a run of ones, at a head, a lane of every vector
    position, the last full vector and the tail, at scale 1 (u = v): in a float16 gradient the
    subnormal column counts exactly the values in (0, 2^-14), whatever the path (SIMD body,
    scalar tail, CUDA lanes); the other dtypes count none."""
    lanes = 16 // torch.tensor([], dtype=dtype).element_size()
    n = 3 * L[dtype] + 2 * lanes + 3  # several lane groups, then a partial vector
    positions = sorted(
        {0, 1, lanes - 1, lanes + 5 % lanes, L[dtype] - 1, L[dtype] + 7, n - 4, n - 1}
    )
    col = ops.STAT_FIELDS.index("subnormal")
    planted = 0
    for name, (value, counted) in EDGE.items():
        g = torch.ones(n, dtype=dtype)
        g[0] = value
        stored = abs(float(g[0]))  # (rounded to the dtype: 2**-14 * (1 - 2**-10) is 2**-14 in
        counted = counted and 0 < stored < 2.0**-14  # bfloat16)
        counted = counted and dtype == torch.float16  # (the other dtypes hold these in full)
        planted += counted
        for pos in positions:
            g = torch.ones(n, dtype=dtype)
            g[pos] = value
            table = _check([g.to(device)], scale=1.0, check_only=check_only)
            assert table[1, col].item() == int(counted), (name, pos)
    assert planted == (4 if dtype == torch.float16 else 0)  # (the premise)


def _unscaled(g: torch.Tensor, scale: float) -> torch.Tensor:
    """What a writing pass stores (the plain pass's rule; tests/test_ops.py tests it)."""
    op = reference._opmath(g.dtype)
    return (g.to(op) * torch.tensor(_inv(scale), dtype=torch.float32).to(op)).to(g.dtype)


def test_reference_order_would_expose_fma():
    """The test data tells a contracted sum from the reference's: acc + round(u*u) versus
    round(acc + u*u) differs for these lanes, so a kernel built with FMA contraction fails."""
    u = _values(4 * L[torch.float32], torch.float32, 3)
    plain = torch.zeros(L[torch.float32])
    fused = torch.zeros(L[torch.float32])
    for j in range(4):
        x = u[j * L[torch.float32] : (j + 1) * L[torch.float32]]
        plain = plain + x * x
        fused = (fused.double() + x.double() * x.double()).float()  # one rounding: an FMA
    assert (plain != fused).sum() > 100


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_only_sees_unscaled_unrounded_values(device, dtype):
    # Tiny values: u = v * inv is representable in float32 but rounds to zero (or a subnormal)
    # in float16/bfloat16 - check-only rows are of v * inv in opmath, writing rows of the
    # stored value.
    g = (_values(70000, dtype, 1).to(torch.float64) * 2.0**-14).to(dtype).to(device)
    before = g.clone()
    t_check = _check([g], check_only=True)
    assert torch.equal(g, before)  # nothing written
    t_write = _check([g.clone()], check_only=False)
    if dtype in (torch.float16, torch.bfloat16):
        assert not torch.equal(t_check[1:, 0], t_write[1:, 0])
    inv1 = _check([g.clone()], scale=1.0, check_only=True)  # multiply-or-pass: u = v
    _same(inv1[1:], reference.grad_stats([before], 1.0, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_one(device, dtype):
    g = _values(2 * 65536 + 5, dtype, 2).to(device)
    before = g.clone()
    _check([g], scale=1.0)
    assert torch.equal(g, before)  # inv == 1: written back unmultiplied


@pytest.mark.parametrize("check_only", [False, True], ids=["write", "check_only"])
def test_scale_one_keeps_bfloat16_denormals_under_flush_denormal(check_only):
    """inv == 1 passes values through, never multiplies them by 1: with denormals flushed
    (torch.set_flush_denormal(True)) a multiply would zero bfloat16 denormals, which widen to
    float32 denormals, in the vectorized part of a run and not in its tail.  (The reference,
    in torch ops, sees denormals as zeros then: the kernels count zeros on the stored bits.)"""
    g = torch.full((16 * 5 + 7,), 5, dtype=torch.int16).view(torch.bfloat16)
    plain = g.clone()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        table, _ = _run([g], scale=1.0, check_only=check_only)
        found = torch.zeros(())
        ops.non_finite_check_and_unscale_([plain], found, torch.ones(()))
    finally:
        torch.set_flush_denormal(False)
    assert table[1, ops.STAT_FIELDS.index("zeros")].item() == 0
    assert torch.equal(g.view(torch.int16), torch.full_like(g.view(torch.int16), 5))
    assert torch.equal(plain.view(torch.int16), torch.full_like(g.view(torch.int16), 5))


# scale 0.25 (inv 4 > 1): a finite input can overflow, so the CPU counts inputs in its loop
# instead of from the stored values (inputs_countable_after_write).
@pytest.mark.parametrize("scale", [SCALE, 0.25])
@pytest.mark.parametrize("check_only", [False, True], ids=["write", "check_only"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_counts(device, dtype, check_only, scale):
    n = 3 * 65536 + 7
    grads = [_values(n, dtype, s).to(device) for s in range(4)] + [
        _values(300, dtype, 9).to(device)
    ]
    # tensor -> {position: value}: first, middle, last, item boundaries, several tensors
    inject = {
        0: {0: math.inf, 65535: -math.inf, 65536: math.nan, n - 1: math.nan},
        2: {n // 2: -math.inf, n // 2 + 1: -math.inf, 100: math.inf},
        4: {299: math.inf},
    }
    for t, where in inject.items():
        for i, v in where.items():
            grads[t][i] = v
    # Values of zero in the input and u that underflow count as zeros.
    grads[1][:1000] = 0.0
    grads[1][1000] = -0.0
    grads[3][7] = torch.finfo(dtype).max / 2  # finite; overflows (u = inf) when inv = 4
    table = _check(grads, scale=scale, check_only=check_only)
    per, total = _C.reduce_grad_stats(table[1:], [g.numel() for g in grads])
    for t in range(len(grads)):
        vals = list(inject.get(t, {}).values())
        counts = [
            sum(v == math.inf for v in vals),
            sum(v == -math.inf for v in vals),
            sum(v != v for v in vals),
        ]
        assert per[t, 2:5].tolist() == counts, t
        assert math.isfinite(per[t, 1])  # abs-max of the finite values only
        if vals:
            assert not math.isfinite(per[t, 0])
    assert per[1, 5] >= 1001
    assert math.isnan(total)


# inv = 1.5 and inv = 0.501953125 (on both sides of inputs_countable_after_write): thousands of
# float32 products that are exact ties for bfloat16 (round half to even), hundreds for inv <= 1.
@pytest.mark.parametrize("scale", [2 / 3, 1 / 0.501953125])
@pytest.mark.parametrize("check_only", [False, True], ids=["write", "check_only"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_value(device, dtype, check_only, scale):
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    g = every.to(device, copy=True)
    _check([g], scale=scale, check_only=check_only)
    expected = every if check_only else _unscaled(every, scale)
    _same(g.cpu().double(), expected.double())  # a NaN stays a NaN, payload aside


def test_abs_max_and_overflow_to_inf(device):
    # u overflowing float16 (scale < 1): counted as neither inf input nor finite abs-max.
    g = torch.tensor([60000.0, -1.0, 2.0, 0.5], dtype=torch.float16, device=device)
    table = _check([g], scale=0.5)
    assert table[1].tolist() == [math.inf, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert g[0].item() == math.inf


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts(device, dtype):
    base = _values(4 * 70004, dtype, 5).to(device)
    misaligned = [base[k * 70004 + k :][:70000] for k in (1, 2, 3)]  # storage_offset % 4: 1..3
    m2d = _values(300 * 500, dtype, 6).to(device).view(300, 500)
    permuted = m2d.t()  # dense, walked in memory order
    gaps = _values(300 * 500, dtype, 7).to(device).view(300, 500)[:, ::2]
    # Memory order and row-major order, stated without the reference's _elements():
    # (clone first: on the CPU .cpu() returns the tensor itself, which the device audit then marks)
    exp_perm = reference.grad_stats([m2d.clone().cpu()], _inv(SCALE), False)
    exp_gaps = reference.grad_stats([gaps.clone().cpu().contiguous()], _inv(SCALE), False)
    gaps_before = gaps.clone()
    table = _check([*misaligned[::2], permuted, gaps])
    rows_m = -(-70000 // CHUNK)
    _same(table[1 + 2 * rows_m : 1 + 2 * rows_m + len(exp_perm)], exp_perm)
    _same(table[-len(exp_gaps) :], exp_gaps)
    assert torch.equal(gaps, _unscaled(gaps_before, SCALE))  # written back through the copy
    _check([misaligned[1]], check_only=True)


def test_overlapping_gradients_refused(device):
    g = _values(5, torch.float32, 0).to(device).view(1, 5).expand(4, 5)
    other = _values(10, torch.float32, 1).to(device)
    before = other.clone()
    with pytest.raises(NotImplementedError, match="overlap"):
        _run([other, g])
    assert torch.equal(other, before)


def test_many_items_and_launches(device):
    # 2,100 items: more than one CUDA launch (2,032 items each), rows of the second offset.
    grads = [_values(3 + i % 5, torch.float32, i).to(device) for i in range(2100)]
    grads.append(_values(65537, torch.float16, 1).to(device))
    _check(grads)


def test_empty_pass(device):
    table, found = _run([torch.zeros(0, device=device)])
    assert table.shape == (1, FIELDS) and found == 0.0
    _same(table[0], torch.tensor([SCALE, STEPS] + [0] * (FIELDS - 2), dtype=torch.float64))


# --------------------------------------------------------------------------- reduction


def test_reduce_matches_reference():
    numels = [0, 5, 65536, 65537, 0, 3 * 65536 + 7, 1]
    grads = [_values(n, torch.float32, i) for i, n in enumerate(numels)]
    grads[3][65536] = math.inf
    rows = reference.grad_stats(grads, 0.25, False)
    per, total = _C.reduce_grad_stats(rows, numels)
    ref_per, ref_total = reference.reduce_grad_stats(rows, numels)
    _same(per, ref_per)
    per_t, total_t = _C.reduce_grad_stats(rows, torch.tensor(numels))
    _same(per_t, ref_per)
    assert total == ref_total == total_t
    assert per[0].tolist() == [0.0] * FIELDS and per[4].tolist() == [0.0] * FIELDS
    assert per[3, 2] == 1 and math.isinf(per[3, 0])


def test_reduce_rejects_mismatched_table():
    rows = torch.zeros(3, FIELDS, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=rf"table\[1:\].*\[2, {FIELDS}\]"):
        _C.reduce_grad_stats(rows, [65536, 2])
    with pytest.raises(RuntimeError, match="float64"):
        _C.reduce_grad_stats(rows.float(), [65536, 2, 3])
    with pytest.raises(RuntimeError, match=">= 0"):
        _C.reduce_grad_stats(rows, [-1])


# Relative error bound of one item's fp32 sum of squares: every term is rounded once when
# squared, then passes through at most 65536/2048 - 1 = 31 lane additions (float32: 2048
# lanes, J = 32 terms a lane), 3 thread additions and 9 tree levels: d = 44 roundings of
# 2^-24 on any path (sums of non-negative terms: |error| <= d * 2^-24 * sum).  Items are then
# summed in float64 (negligible).  A norm is the square root: half the relative error, plus the
# final rounding to float32.  float16/bfloat16 items have fewer lane terms and more thread
# additions: J = 16, V = 8, d = 1 + 15 + 7 + 9 = 32 < 44.
NORM_RTOL = (44 / 2 + 1) * 2.0**-24


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_norms_against_vector_norm(device, dtype):
    numels = [1, 767, 65536 * 3 + 11, 4096]
    grads = [_values(n, dtype, i).to(device) for i, n in enumerate(numels)]
    table, _ = _run(grads)
    per, total = _C.reduce_grad_stats(table[1:], numels)
    norms = torch.sqrt(per[:, 0]).float()
    for g, norm in zip(grads, norms, strict=True):
        # The unscaled gradient as written, its norm accumulated in float64 (torch's float32
        # accumulation has an error bound of its own, larger than ours for long tensors).
        exact = float(torch.linalg.vector_norm(g, dtype=torch.float64))
        assert abs(float(norm) - exact) <= NORM_RTOL * exact
    flat = torch.cat([g.reshape(-1).double() for g in grads])
    exact_total = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
    assert abs(math.sqrt(total) - exact_total) <= NORM_RTOL * exact_total


# --------------------------------------------------------------------------- CUDA vs CPU


@pytest.mark.cuda
@pytest.mark.parametrize("check_only", [False, True], ids=["write", "check_only"])
def test_cuda_equals_cpu(check_only):
    grads = [_values(n, DTYPES[i % 4], i) for i, n in enumerate(SIZES * 2)]
    grads[3][0] = math.nan
    cuda = [g.cuda() for g in grads]
    cuda.append(_values(70001, torch.float32, 9).cuda()[1:])  # misaligned on the GPU
    grads.append(cuda[-1].cpu())
    t_cpu, f_cpu = _run(grads, check_only=check_only)
    t_cuda, f_cuda = _run(cuda, check_only=check_only)
    _same(t_cuda, t_cpu)
    assert f_cpu == f_cuda == 1.0
