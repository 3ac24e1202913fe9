"""Op-level tests of ``torch.ops.ampfused.*`` (contract: ``csrc/unscale.h``).

Oracles, in this order: torch's own ops (``torch._amp_foreach_non_finite_check_and_unscale_``
and ``torch._amp_update_scale_``), then :mod:`ampfused.reference` where torch has no equal (its
CUDA kernel rejects bfloat16 and narrows float64 to float32 for the finiteness test).  Results
are compared bit for bit: unscaling is one multiply, so there is no tolerance to give.  Tests
take the ``device`` fixture, so a GPU machine runs the CUDA kernels through the same set; the
exceptions are the cross-device tests (``cuda`` only) and the meta-tensor test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import ampfused
from ampfused import _C, ops, reference

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = (F32, F16, BF16, F64)
INT_OF = {F16: torch.int16, BF16: torch.int16, F32: torch.int32, F64: torch.int64}
NAN, INF = float("nan"), float("inf")
SPECIALS = (NAN, INF, -INF)
# Exponent ranges (base 2) of the random finite values; float16 stays below its 65504 maximum.
EXPONENTS = {F16: (-26, 12), BF16: (-130, 120), F32: (-130, 120), F64: (-1000, 1000)}

OP_NAMES = ("unscale", "check", "fused")


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# Inputs


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_values(n: int, dtype: torch.dtype, g: torch.Generator, device: str = "cpu"):
    """n finite values spread over the whole exponent range of dtype (subnormals included),
    with a -0.0 every 97 elements."""
    lo, hi = EXPONENTS[dtype]
    v = torch.randn(n, generator=g, dtype=F64)
    v = v * torch.exp2(torch.randint(lo, hi, (n,), generator=g, dtype=F64))
    v[::97] = -0.0
    return v.to(dtype).to(device)


def rand_bits(n: int, dtype: torch.dtype, g: torch.Generator, device: str = "cpu"):
    """n random bit patterns of dtype: NaNs with arbitrary payloads, infs, subnormals, -0.0."""
    idt = INT_OF[dtype]
    bits = torch.iinfo(idt).bits
    lo = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64)
    if bits == 64:
        hi = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64)
        raw = (hi << 32) | (lo & 0xFFFFFFFF)
    else:
        raw = lo.to(idt)  # wraps: keeps the low bits
    return raw.to(idt).view(dtype).to(device)


def mixed_grads(device: str, seed: int, sizes=(1000, 33, 4097, 7, 0, 130)) -> list[torch.Tensor]:
    """Interleaved float32/float16/bfloat16/float64 grads, finite."""
    g = gen(seed)
    return [rand_values(n, DTYPES[i % 4], g, device) for i, n in enumerate(sizes)]


def clones(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in grads]


def scalar(value: float, device: str, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.full((), value, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------
# Oracles


def oracle_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor):
    """What GradScaler does: torch's op once per dtype group.  On CUDA bfloat16 (no torch kernel)
    and float64 (torch narrows it to float32 for the test) go to the reference instead."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in grads:
        groups.setdefault(t.dtype, []).append(t)
    for dtype, group in groups.items():
        if found_inf.is_cuda and dtype in (BF16, F64):
            reference.non_finite_check_and_unscale_(group, found_inf, inv_scale)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)


def oracle_update(scale, tracker, found_inf, growth, backoff, interval):
    """torch._amp_update_scale_ on copies: the (next_scale, next_growth_tracker) it writes."""
    s, t = scale.clone(), tracker.clone()
    torch._amp_update_scale_(s, t, found_inf.clone(), growth, backoff, interval)
    return s, t


# --------------------------------------------------------------------------------------------
# Bitwise comparison


def assert_bits(
    actual: torch.Tensor,
    expected: torch.Tensor,
    what: str = "tensor",
    *,
    exact_nan: bool | None = None,
) -> None:
    """Bit equality.  float32/float64 NaN payloads are compared too; for float16/bfloat16 only
    NaN-ness is (torch's own CPU kernel, its reference path and c10::Half's conversion disagree on
    16-bit NaN payloads), unless exact_nan=True (for tensors that must not be written at all)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if exact_nan is None:
        exact_nan = a.dtype not in (F16, BF16)
    if a.is_floating_point() and not exact_nan:
        na, ne = a.isnan(), e.isnan()
        if not torch.equal(na, ne):
            i = tuple((na != ne).nonzero()[0].tolist())
            raise AssertionError(f"{what}: NaN at {i} in one only: got {a[i]}, expected {e[i]}")
        a, e = a.masked_fill(na, 0), e.masked_fill(ne, 0)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ai, ei = a.view(as_int), e.view(as_int)
    if not torch.equal(ai, ei):
        bad = (ai != ei).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {a.numel()} elements differ; first at {i}: got "
            f"{actual.detach().cpu()[i].item()!r} (bits {ai[i].item():#x}), expected "
            f"{expected.detach().cpu()[i].item()!r} (bits {ei[i].item():#x})"
        )


def assert_lists_bits(actual, expected, what: str = "grads", **kw) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_bits(a, e, f"{what}[{i}]", **kw)


def assert_found(found_inf: torch.Tensor, value: float) -> None:
    assert_bits(found_inf, torch.full_like(found_inf, value), "found_inf")


# --------------------------------------------------------------------------------------------
# Running an op next to its oracle


def run_unscale(grads, device, inv: float, found_preset: float = 0.0) -> float:
    """non_finite_check_and_unscale_ against the oracle; returns found_inf."""
    inv_t = scalar(inv, device)
    expected, found_exp = clones(grads), scalar(found_preset, device)
    oracle_unscale_(expected, found_exp, inv_t)
    found = scalar(found_preset, device)
    ops.non_finite_check_and_unscale_(grads, found, inv_t)
    assert_lists_bits(grads, expected)
    assert_bits(found, found_exp, "found_inf")
    assert_bits(inv_t, scalar(inv, device), "inv_scale")
    return found.item()


def run_check(grads, device, found_preset: float = 0.0) -> float:
    """non_finite_check_: grads byte-identical, found_inf as torch's op sets it."""
    before = clones(grads)
    found_exp = scalar(found_preset, device)
    oracle_unscale_(clones(grads), found_exp, scalar(1.0, device))
    found = scalar(found_preset, device)
    ops.non_finite_check_(grads, found)
    assert_lists_bits(grads, before, exact_nan=True)
    assert_bits(found, found_exp, "found_inf")
    return found.item()


def run_fused(
    grads,
    device,
    *,
    scale: float = 2.0**16,
    tracker: int = 0,
    growth=2.0,
    backoff=0.5,
    interval=2000,
    check_only=False,
    accumulate=False,
    found_preset=7.0,
    next_preset=(-5.0, 99),
    expect_next: tuple[float, int] | None = None,
) -> float:
    """unscale_update_scale_ against torch's unscale + torch._amp_update_scale_; returns found.
    expect_next: the (next_scale, next_growth_tracker) values, spelled out by the caller."""
    scale_t = scalar(scale, device)
    tracker_t = scalar(tracker, device, torch.int32)
    next_s, next_t = scalar(next_preset[0], device), scalar(next_preset[1], device, torch.int32)
    expected, found_exp = clones(grads), scalar(0.0, device)
    oracle_unscale_(expected, found_exp, reference.inv_scale_of(scale_t))
    if check_only:
        expected = clones(grads)
    if not accumulate or found_exp.item() != 0:
        exp_s, exp_t = oracle_update(scale_t, tracker_t, found_exp, growth, backoff, interval)
    else:
        exp_s, exp_t = next_s.clone(), next_t.clone()
    before = clones(grads)
    found = scalar(found_preset, device)
    ops.unscale_update_scale_(
        grads,
        found,
        scale_t,
        tracker_t,
        next_s,
        next_t,
        growth,
        backoff,
        interval,
        check_only,
        accumulate,
    )
    # check_only: nothing written, so even 16-bit NaN payloads must survive.
    assert_lists_bits(grads, before if check_only else expected, exact_nan=check_only or None)
    assert_bits(found, found_exp, "found_inf")
    assert_bits(next_s, exp_s, "next_scale")
    assert_bits(next_t, exp_t, "next_growth_tracker")
    assert_bits(scale_t, scalar(scale, device), "scale (read only)")
    assert_bits(tracker_t, scalar(tracker, device, torch.int32), "growth_tracker (read only)")
    if expect_next is not None:
        assert (next_s.item(), next_t.item()) == expect_next
    return found.item()


def apply(op: str, grads, found_inf: torch.Tensor, inv: float = 2.0**-16) -> None:
    """One op with plain state: inv_scale = inv, or scale = 1 / inv for the fused op (fresh
    tracker, growth_interval 2000); op "check_only" is the fused op with check_only=True."""
    d = found_inf.device
    if op == "unscale":
        ops.non_finite_check_and_unscale_(grads, found_inf, torch.full((), inv, device=d))
    elif op == "check":
        ops.non_finite_check_(grads, found_inf)
    else:
        z = torch.zeros((), dtype=torch.int32, device=d)
        scale, next_scale = torch.full((), 1.0 / inv, device=d), torch.zeros((), device=d)
        ops.unscale_update_scale_(
            grads, found_inf, scale, z, next_scale, z.clone(), 2.0, 0.5, 2000, op == "check_only"
        )


def run_op(name: str, grads, device) -> float:
    """One of the three ops (unscale by 2**-16) against its oracle; returns found_inf."""
    if name == "unscale":
        return run_unscale(grads, device, 2.0**-16)
    if name == "check":
        return run_check(grads, device)
    return run_fused(grads, device)


# ============================================================================================
# 1. Oracles


@pytest.mark.parametrize("inv", [2.0**-16, 1.0, 1 / 3, 4.0, 0.0], ids=lambda v: f"inv={v:.3g}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_unscale_matches_torch(device, dtype, inv):
    g = gen(1)
    clean = [rand_values(n, dtype, g, device) for n in (1, 33, 4097)]
    # Nothing found: found_inf is left as it was, garbage included.
    assert run_unscale(clean, device, inv, found_preset=3.0) == 3.0
    dirty = [rand_values(n, dtype, g, device) for n in (1, 33, 4097)]
    dirty[2][[0, 100, 2049, 4096]] = torch.tensor([NAN, INF, -INF, NAN], dtype=dtype, device=device)
    assert run_unscale(dirty, device, inv) == 1.0


def test_reference_agrees_with_torch(device):
    """The reference stands in for torch on CUDA (bfloat16, float64): check it where both run."""
    dtypes = DTYPES if device == "cpu" else (F32, F16)
    g = gen(2)
    for inv in (2.0**-16, 1.0, 0.3):
        grads = [rand_bits(3000, dt, g, device) for dt in dtypes]
        a, b = clones(grads), clones(grads)
        fa, fb = scalar(0.0, device), scalar(0.0, device)
        for t in a:
            torch._amp_foreach_non_finite_check_and_unscale_([t], fa, scalar(inv, device))
        reference.non_finite_check_and_unscale_(b, fb, scalar(inv, device))
        assert_lists_bits(b, a)
        assert_bits(fb, fa, "found_inf")
    for case in UPDATE_CASES:
        _, scale, tracker, interval, growth, backoff, has_inf = case
        s, t = oracle_update(
            scalar(scale, device),
            scalar(tracker, device, torch.int32),
            scalar(float(has_inf), device),
            growth,
            backoff,
            interval,
        )
        scale32 = scalar(scale, "cpu").item()  # update_rule takes the float32 scale's value
        expected = reference.update_rule(scale32, tracker, has_inf, growth, backoff, interval)
        assert (s.item(), t.item()) == expected, case


@pytest.mark.parametrize("has_inf", [False, True], ids=["finite", "inf"])
@pytest.mark.parametrize("preset", [0.0, 1.0, 7.0], ids=lambda v: f"found={v}")
@pytest.mark.parametrize("op", OP_NAMES)
def test_found_inf_set_left_or_overwritten(device, op, preset, has_inf):
    """unscale/check: set to 1.0 or left as it was (like torch); fused: overwritten to 0.0/1.0."""
    grads = mixed_grads(device, 3)
    if has_inf:
        grads[1][5] = INF
    found = scalar(preset, device)
    apply(op, grads, found)
    assert_found(found, 1.0 if has_inf else (0.0 if op == "fused" else preset))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_finite_check_leaves_grads_byte_identical(device, dtype):
    g = gen(4)
    raw = [rand_bits(n, dtype, g, device) for n in (5000, 3, 0, 65537)]
    assert run_check(raw, device, found_preset=0.0) == 1.0  # random bits hold NaNs and infs
    clean = [rand_values(n, dtype, g, device) for n in (5000, 3, 0, 65537)]
    assert run_check(clean, device, found_preset=5.0) == 5.0


# (id, scale, growth_tracker, growth_interval, growth_factor, backoff_factor, inf in grads)
UPDATE_CASES = [
    ("count", 65536.0, 3, 2000, 2.0, 0.5, False),
    ("found_backoff", 65536.0, 1999, 2000, 2.0, 0.5, True),
    ("found_tracker_reset", 65536.0, 5, 2000, 2.0, 0.5, True),
    ("grow", 65536.0, 1999, 2000, 2.0, 0.5, False),
    ("grow_interval_1", 1.0, 0, 1, 2.0, 0.5, False),
    ("grow_overflow_kept", 3e38, 9, 10, 2.0, 0.5, False),
    ("tracker_past_interval", 8.0, 50, 10, 2.0, 0.5, False),
    ("odd_factors_grow", 3.0, 4, 5, 1.7, 1 / 3, False),
    ("odd_factors_backoff", 3.0, 4, 5, 1.7, 1 / 3, True),
    ("backoff_to_subnormal", 1e-38, 0, 10, 2.0, 0.01, True),
    ("backoff_to_zero", 1e-45, 0, 10, 2.0, 0.1, True),
    ("scale_one", 1.0, 0, 100, 2.0, 0.5, False),
    ("odd_scale", 3.0e7 + 1.0, 0, 100, 2.0, 0.5, False),
    # float32(double(scale) * factor) differs from float32 math for these two
    ("double_math_backoff", 769.2218017578125, 0, 10, 2.0, 1 / 3, True),
    ("double_math_grow", 497.256591796875, 4, 5, 1.7, 0.5, False),
]


@pytest.mark.parametrize("check_only", [False, True], ids=["unscale", "check_only"])
@pytest.mark.parametrize("case", UPDATE_CASES, ids=lambda c: c[0])
def test_unscale_update_scale_matches_torch(device, case, check_only):
    _, scale, tracker, interval, growth, backoff, has_inf = case
    grads = mixed_grads(device, 5)
    if has_inf:
        grads[3][-1] = NAN  # the last float64 element
    found = run_fused(
        grads,
        device,
        scale=scale,
        tracker=tracker,
        growth=growth,
        backoff=backoff,
        interval=interval,
        check_only=check_only,
    )
    assert found == float(has_inf)


def test_update_rule_named_outcomes(device):
    """The rule's cases spelled out (not only "same as torch"), so a shared mistake shows."""

    def next_of(scale, tracker, has_inf, interval=10, growth=2.0, backoff=0.5):
        grads = [torch.tensor([1.0, INF if has_inf else 2.0], device=device)]
        ns, nt = scalar(-1.0, device), scalar(-1, device, torch.int32)
        ops.unscale_update_scale_(
            grads,
            scalar(7.0, device),
            scalar(scale, device),
            scalar(tracker, device, torch.int32),
            ns,
            nt,
            growth,
            backoff,
            interval,
            False,
            False,
        )
        return ns.item(), nt.item()

    assert next_of(1024.0, 5, True) == (512.0, 0)  # found: backoff, tracker reset
    assert next_of(1024.0, 5, False) == (1024.0, 6)  # count
    assert next_of(1024.0, 9, False) == (2048.0, 0)  # tracker + 1 == interval: grow
    # The grown scale overflows float32: the scale is kept, the tracker still resets.
    assert next_of(3e38, 9, False) == (scalar(3e38, "cpu").item(), 0)
    assert next_of(1.0, 0, False, interval=1, growth=1.5) == (1.5, 0)
    # Products in double, rounded once (float32 math would give another value for these).
    for scale, has_inf, factor in (
        (769.2218017578125, True, 1 / 3),
        (497.256591796875, False, 1.7),
    ):
        in_double = scalar(scale * factor, "cpu").item()
        in_float = (scalar(scale, "cpu") * scalar(factor, "cpu")).item()
        assert in_double != in_float
        kw = {"backoff": factor} if has_inf else {"growth": factor, "interval": 1}
        assert next_of(scale, 0, has_inf, **kw) == (in_double, 0)


def test_accumulate_without_inf_leaves_next_alone(device):
    grads = mixed_grads(device, 6)
    found = run_fused(
        grads, device, tracker=1999, accumulate=True, next_preset=(-5.0, 99), expect_next=(-5.0, 99)
    )
    assert found == 0.0  # overwritten from 7.0


@pytest.mark.parametrize("check_only", [False, True], ids=["unscale", "check_only"])
def test_accumulate_with_inf_writes_backoff(device, check_only):
    grads = mixed_grads(device, 7)
    grads[2][17] = -INF
    found = run_fused(
        grads,
        device,
        scale=4096.0,
        tracker=1999,
        accumulate=True,
        check_only=check_only,
        next_preset=(-5.0, 99),
        expect_next=(2048.0, 0),  # backoff from scale (not from next_scale), tracker reset
    )
    assert found == 1.0


@pytest.mark.parametrize(
    "passes", [(0, 0), (0, 1), (1, 0), (1, 1), (0, 0, 0), (0, 1, 0)], ids=lambda p: str(p)
)
def test_passes_of_one_iteration_equal_torch_update_over_the_sum(device, passes):
    """First pass accumulate=False, later ones accumulate=True: next equals torch's update over
    the summed found_inf of all passes (GradScaler with several optimizers)."""
    scale, tracker = scalar(2.0**16, device), scalar(1999, device, torch.int32)
    ns, nt = scalar(-5.0, device), scalar(99, device, torch.int32)
    total = scalar(0.0, device)
    for i, has_inf in enumerate(passes):
        grads = mixed_grads(device, 10 + i)
        if has_inf:
            grads[0][0] = NAN
        found = scalar(7.0, device)
        ops.unscale_update_scale_(
            grads, found, scale, tracker, ns, nt, 2.0, 0.5, 2000, False, i > 0
        )
        assert_found(found, float(has_inf))
        total += found
    exp_s, exp_t = oracle_update(scale, tracker, total, 2.0, 0.5, 2000)
    assert_bits(ns, exp_s, "next_scale")
    assert_bits(nt, exp_t, "next_growth_tracker")
    assert (ns.item(), nt.item()) == ((32768.0, 0) if any(passes) else (131072.0, 0))


@pytest.mark.parametrize("accumulate", [False, True], ids=["first", "accumulate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_check_only_writes_no_gradient(device, dtype, accumulate):
    """Raw bit patterns (NaN payloads, subnormals, -0.0) must survive byte for byte."""
    g = gen(8)
    grads = [rand_bits(n, dtype, g, device) for n in (4099, 1, 70000)]
    found = run_fused(grads, device, check_only=True, accumulate=accumulate)
    assert found == 1.0


# ============================================================================================
# 2. Mixed dtypes in one call


@pytest.mark.parametrize("inf_in", [None, *DTYPES], ids=lambda d: dtype_id(d) if d else "none")
@pytest.mark.parametrize("op", OP_NAMES)
def test_mixed_dtypes_one_call(device, op, inf_in):
    g = gen(9)
    sizes = (300, 4097, 1, 65536, 77, 0, 129, 5000, 33, 2)
    grads = [rand_values(n, DTYPES[i % 4], g, device) for i, n in enumerate(sizes)]
    if inf_in is not None:
        # The last non-empty tensor of that dtype holds a special near its end.
        idx = max(i for i, t in enumerate(grads) if t.dtype == inf_in and t.numel())
        grads[idx][-1] = SPECIALS[DTYPES.index(inf_in) % 3]
    found = run_op(op, grads, device)
    assert found == (0.0 if inf_in is None else 1.0)


def test_mixed_dtypes_fused_matches_reference(device):
    """Second oracle for the fused op: ampfused.reference.unscale_update_scale_."""
    g = gen(11)
    grads = [rand_bits(n, DTYPES[i % 4], g, device) for i, n in enumerate((999, 5, 4096, 17))]
    grads += mixed_grads(device, 12)
    expected = clones(grads)
    state = [
        scalar(v, device, dt)
        for v, dt in ((7.0, F32), (2.0**15, F32), (3, torch.int32), (-5.0, F32), (99, torch.int32))
    ]
    exp_state = [t.clone() for t in state]
    reference.unscale_update_scale_(expected, *exp_state, 2.0, 0.5, 4)
    ops.unscale_update_scale_(grads, *state, 2.0, 0.5, 4)
    assert_lists_bits(grads, expected)
    for name, a, e in zip(
        ("found_inf", "scale", "tracker", "next_scale", "next_tracker"),
        state,
        exp_state,
        strict=True,
    ):
        assert_bits(a, e, name)


# ============================================================================================
# 3. Adversarial sizes, counts, placements and layouts

SIZES = [0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 127, 128, 129, 4095, 4096, 4097, 65535, 65536, 65537] + [
    65536 * 2 + 3,
    65536 * 4 - 1,
    65536 * 4 + 1,
]
# Chunk (65536 elements), CPU piece (256 KiB: 32768 float64 / 65536 float32 / 131072 16-bit
# elements) and vector boundaries.
BOUNDARIES = (8, 16, 4096, 32768, 65536, 131072, 262144)


def positions(n: int) -> list[int]:
    cand = {0, 1, n // 2, n - 2, n - 1}
    for b in BOUNDARIES:
        cand |= {b - 1, b}
    return sorted(p for p in cand if 0 <= p < n)


@pytest.mark.parametrize("n", SIZES)
def test_sizes_and_special_positions(device, n):
    g = gen(n)
    base = [rand_values(n, dt, g, device) for dt in DTYPES]  # one tensor of each dtype, size n
    # Clean: every element of every dtype against the oracle, nothing found.
    assert run_unscale(clones(base), device, 2.0**-10, found_preset=0.0) == 0.0
    assert run_fused(clones(base), device) == 0.0
    for i, p in enumerate(positions(n)):
        # Detection, cheaply: one special at p in each dtype in turn (read-only op).
        for k, dt in enumerate(DTYPES):
            old = base[k][p].clone()
            base[k][p] = SPECIALS[(i + k) % 3]
            found = scalar(0.0, device)
            ops.non_finite_check_(base, found)
            base[k][p] = old
            assert found.item() == 1.0, f"{SPECIALS[(i + k) % 3]} at {p} of {dt} not found"
        # Values and detection of the writing ops, rotating dtype, special and op.
        grads = clones(base)
        grads[i % 4][p] = SPECIALS[i % 3]
        if i % 2:
            assert run_unscale(grads, device, 2.0**-16) == 1.0
        else:
            assert run_fused(grads, device) == 1.0


TENSOR_COUNTS = [0, 1, 2, 109, 110, 111, 320, 769, 770, 771]


@pytest.mark.parametrize("count", TENSOR_COUNTS)
def test_tensor_counts(device, count):
    g = gen(count)
    # Sizes 0-299 (some zero-size), about 150 elements on average: the larger counts go past
    # the CPU kernel's parallel threshold.
    grads = [rand_values((i * 37 + 5) % 300, DTYPES[i % 4], g, device) for i in range(count)]
    assert run_unscale(clones(grads), device, 0.125) == 0.0
    nonempty = [i for i, t in enumerate(grads) if t.numel()]
    if not nonempty:
        assert run_fused(grads, device) == 0.0
        return
    first, last = nonempty[0], nonempty[-1]
    dirty = clones(grads)
    dirty[last][-1] = NAN
    assert run_unscale(dirty, device, 0.125) == 1.0
    dirty = clones(grads)
    dirty[first][0] = -INF
    assert run_check(dirty, device) == 1.0
    dirty = clones(grads)
    dirty[nonempty[len(nonempty) // 2]][0] = INF
    assert run_fused(dirty, device) == 1.0


def test_ten_thousand_tiny_tensors(device):
    """10,007 grads of 1-3 elements, dtypes interleaved, all views into four shared buffers (so
    most are misaligned and a write past a grad's end would land in its neighbour)."""
    count = 10_007
    sizes = [1 + (i * 7) % 3 for i in range(count)]
    per_dtype = [[n for i, n in enumerate(sizes) if i % 4 == k] for k in range(4)]
    g = gen(10)
    bufs = [rand_values(sum(s), dt, g, device) for s, dt in zip(per_dtype, DTYPES, strict=True)]

    def as_grads(buffers):
        parts = [list(torch.split(b, s)) for b, s in zip(buffers, per_dtype, strict=True)]
        return [parts[i % 4][i // 4] for i in range(count)]

    def check(buffers, expected_buffers):
        for k in range(4):
            assert_bits(buffers[k], expected_buffers[k], f"buffer of {DTYPES[k]}")

    # Clean pass.
    expected = [b.clone() for b in bufs]
    f_exp, f = scalar(0.0, device), scalar(0.0, device)
    oracle_unscale_(as_grads(expected), f_exp, scalar(2.0**-8, device))
    ops.non_finite_check_and_unscale_(as_grads(bufs), f, scalar(2.0**-8, device))
    check(bufs, expected)
    assert_found(f, 0.0)
    # A NaN in the very last grad only: found by both ops, fused update backs off.
    last = as_grads(bufs)[-1]
    last[-1] = NAN
    f = scalar(0.0, device)
    ops.non_finite_check_(as_grads(bufs), f)
    assert_found(f, 1.0)
    expected = [b.clone() for b in bufs]
    oracle_unscale_(as_grads(expected), scalar(0.0, device), scalar(2.0**-16, device))
    ns, nt = scalar(0.0, device), scalar(0, device, torch.int32)
    ops.unscale_update_scale_(
        as_grads(bufs),
        f,
        scalar(2.0**16, device),
        scalar(0, device, torch.int32),
        ns,
        nt,
        2.0,
        0.5,
        1,
        False,
        False,
    )
    check(bufs, expected)
    assert_found(f, 1.0)
    assert (ns.item(), nt.item()) == (2.0**15, 0)


def special_values(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    common = [0.0, -0.0, 1.0, -1.0, fi.max, -fi.max, fi.tiny, -fi.tiny, fi.eps, 1.0 + fi.eps]
    common += [fi.smallest_normal / 2, fi.smallest_normal / 1024, fi.max / 3]
    extra = {
        F32: [1e-40, 1e-45, -1e-45, 3.4028234663852886e38 * 2.0**-16, 6e-39],
        F16: [65504.0, -65504.0, 2.0**-24, -(2.0**-24), 2.0**-14, 60000.0, 6.0e-8],
        BF16: [1e-40, -1e-40, 9.2e-41, 3.38e38],
        F64: [5e-324, -5e-324, 1e300, 4e38, -1e-310, 3.5e38, 1e-45],
    }[dtype]
    return common + extra


@pytest.mark.parametrize("inv", [2.0**-16, 1.0, 4.0, 1 / 3, 2.0**-149], ids=lambda v: f"{v:.3g}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_special_finite_values(device, dtype, inv):
    """-0.0, subnormals and dtype maxima, against the oracle.  All inputs are finite, so nothing
    is found even when the product overflows to inf (the test is on the *input*)."""
    vals = torch.tensor(special_values(dtype), dtype=F64).to(dtype)
    assert torch.isfinite(vals).all()
    grads = [vals.to(device), vals.flip(0).to(device).repeat(9)]  # second one is 16+ elements
    assert run_unscale(clones(grads), device, inv, found_preset=0.0) == 0.0
    assert run_fused(clones(grads), device, scale=min(1.0 / inv, 2.0**127)) == 0.0


@pytest.mark.parametrize("op", OP_NAMES)
def test_float64_beyond_float32_range_is_finite(device, op):
    """float64 is tested in float64 (torch's CUDA kernel narrows it first and flags these)."""
    grads = [torch.tensor([4e38, -1e300, 1.7e308, 3.5e38], dtype=F64, device=device)]
    before = grads[0].clone()
    assert run_op(op, grads, device) == 0.0
    if op != "check":
        assert_bits(grads[0], before * 2.0**-16, "float64 grads")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_inv_scale_one_writes_values_back_unchanged(device, dtype):
    """inv_scale == 1 writes v, not v * 1: every bit pattern survives, NaN payloads included
    (on float32/float64; 16-bit NaNs stay NaN)."""
    g = gen(12)
    grads = [rand_bits(n, dtype, g, device) for n in (5000, 3, 65539)]
    before = clones(grads)
    assert run_unscale(grads, device, 1.0) == 1.0
    assert_lists_bits(grads, before)  # payloads exact for float32/float64
    grads = clones(before)
    assert run_fused(grads, device, scale=1.0) == 1.0  # float32(1 / 1.0) == 1.0 exactly
    assert_lists_bits(grads, before)


@pytest.mark.parametrize(
    "inv", [1.0, 0.5, 2.0**-16, 1 / 3, 3.0, 2.0**-140], ids=lambda v: f"{v:.3g}"
)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
def test_every_16_bit_pattern(device, dtype, inv):
    """The shared per-element code (csrc/unscale_math.h) on all 65,536 patterns of a 16-bit
    dtype: the storage -> float -> storage conversions and rounding, the multiply-or-pass rule,
    and the finiteness test of each pattern.  bfloat16 NaNs are stored as 0x7FC0 on every backend
    (the shared conversion); 7 extra elements reach the scalar tail after the vector loop."""
    bits = (torch.arange(65536 + 7, dtype=torch.int32) - 32768).to(torch.int16)
    x = bits.view(dtype)
    inv32 = torch.tensor(inv, dtype=F32)
    wide = x.float()
    expected = (wide if inv == 1.0 else wide * inv32).to(dtype)  # torch's CPU conversion: RNE
    grads = [x.clone().to(device)]
    found = scalar(0.0, device)
    ops.non_finite_check_and_unscale_(grads, found, scalar(inv, device))
    assert_bits(grads[0], expected, f"{dtype_id(dtype)} patterns")
    assert_found(found, 1.0)
    if dtype == BF16:
        nan_bits = grads[0].cpu().view(torch.int16)[expected.isnan()]
        assert (nan_bits == 0x7FC0).all(), f"bfloat16 NaN stored as {nan_bits.unique()}"
    # The same shared functions called as the CUDA kernel calls them (one element at a time,
    # inv_is_one at run time): the same bits.
    cuda_form = x.clone()
    assert _C._visit_elements(cuda_form, inv, False)
    assert_bits(cuda_form, expected, f"{dtype_id(dtype)} patterns, CUDA form")
    if dtype == BF16:
        assert_bits(cuda_form, grads[0], "CUDA form vs kernel", exact_nan=True)
    assert _C._visit_elements(x, 1.0, True) and not _C._visit_elements(
        x[torch.isfinite(x)], 1.0, True
    )
    # The finiteness test, pattern by pattern: the finite ones pass, each non-finite one is found
    # (one call over every non-finite pattern placed alone between finite neighbours).
    finite = x[torch.isfinite(x)]
    for op in OP_NAMES:
        assert run_op(op, [finite.clone().to(device)], device) == 0.0
    for k, special in enumerate(x[~torch.isfinite(x)][::37].tolist()):
        g = finite[k * 64 : k * 64 + 20].clone()
        g[k % 20] = special
        assert run_op(OP_NAMES[k % 3], [g.to(device)], device) == 1.0


@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_nan_payloads_and_signed_zero(device, dtype):
    """float32/float64: inv_scale 1 writes each NaN back with its payload, a signalling one
    included (no multiply); another inv_scale gives torch's product (a quiet NaN); -0.0 stays
    -0.0.  Compared bit for bit with torch's kernel on the same device."""
    if dtype == F32:  # signalling NaN, quiet NaNs with payloads, negative NaN, -0.0, inf
        patterns = [0x7F800001, 0x7FBFFFFF, 0x7FC00000, -0x3EDCBA0B, 0x7FFFFFFF, -(2**31)]
    else:
        patterns = [0x7FF0000000000001, 0x7FF4000000000000, -0x0008000000000000, -(2**63)]
    raw = torch.tensor(
        patterns + [0x3F000000 if dtype == F32 else 0x3FE0000000000000], dtype=INT_OF[dtype]
    )
    x = raw.view(dtype).repeat(5)  # 30+ elements: vector body and tail
    for inv in (1.0, 0.5, 3.0):
        ours = [x.clone().to(device)]
        theirs = [x.clone().to(device)]
        f_ours, f_theirs = scalar(0.0, device), scalar(0.0, device)
        ops.non_finite_check_and_unscale_(ours, f_ours, scalar(inv, device))
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, f_theirs, scalar(inv, device))
        assert_bits(ours[0], theirs[0], f"{dtype_id(dtype)} inv={inv}", exact_nan=True)
        assert_found(f_ours, 1.0)
        if inv == 1.0:
            assert_bits(ours[0], x.to(device), "written back unchanged", exact_nan=True)
        # The shared per-element code as the CUDA kernel calls it (inv_is_one at run time).
        cuda_form = x.clone()
        assert _C._visit_elements(cuda_form, inv, False)
        expected = x if inv == 1.0 else theirs[0].cpu()
        if inv == 1.0 or device == "cpu":
            assert_bits(
                cuda_form, expected, f"{dtype_id(dtype)} inv={inv}, CUDA form", exact_nan=True
            )


# (dtype, storage offset in elements, length): data_ptr not 16-byte aligned
MISALIGNED = [
    (F16, 3, 1000),
    (F16, 1, 65537),
    (BF16, 5, 131075),
    (F32, 1, 999),
    (F32, 3, 4097),
    (F32, 1, 65536 * 2),
    (F64, 1, 257),
    (F64, 1, 40000),
]


@pytest.mark.parametrize(
    "dtype,offset,n",
    MISALIGNED,
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v),
)
def test_misaligned_views(device, dtype, offset, n):
    g = gen(13)
    for k, op in enumerate(OP_NAMES):
        base = rand_values(offset + n + 5, dtype, g, device)
        view = base[offset : offset + n]
        assert view.data_ptr() % 16 != 0
        if k == 1:
            view[0] = INF  # in the scalar head
        if k == 2:
            view[-1] = NAN  # in the scalar tail
        expected = base.clone()
        found_exp = scalar(0.0, device)
        if op == "check":
            oracle_unscale_([expected[offset : offset + n].clone()], found_exp, scalar(1.0, device))
        else:
            inv = scalar(2.0**-16, device)
            oracle_unscale_([expected[offset : offset + n]], found_exp, inv)
        found = scalar(0.0, device)
        apply(op, [view], found)
        # The whole storage: the view's elements and the untouched neighbours on both sides.
        assert_bits(base, expected, f"storage ({op})", exact_nan=op == "check")
        assert_bits(found, found_exp, "found_inf")
        assert found.item() == (0.0 if k == 0 else 1.0)


# name -> (storage numel, view of a flat storage tensor)
LAYOUTS = {
    "transposed": (37 * 64, lambda s: s.view(37, 64).t()),
    "every_other_column": (64 * 66, lambda s: s.view(64, 66)[:, ::2]),
    "channels_last": (2 * 3 * 17 * 19, lambda s: s.view(2, 17, 19, 3).permute(0, 3, 1, 2)),
    "step3_1d": (1000, lambda s: s[1::3]),
    "permuted_sliced": (5 * 6 * 70, lambda s: s.view(5, 6, 70).permute(2, 0, 1)[1:, :, 2:]),
    "transposed_sliced": (130 * 70, lambda s: s.view(130, 70).t()[3:, 1:]),
    "big_gapped": (300 * 513, lambda s: s.view(300, 513)[:, 1::2]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_non_contiguous_grads(device, layout, dtype):
    numel, make = LAYOUTS[layout]
    g = gen(14)
    if layout == "channels_last":
        assert make(torch.empty(numel)).is_contiguous(memory_format=torch.channels_last)
    for k, (has_special, op) in enumerate(
        (s, o) for s in (False, True) for o in OP_NAMES + ("check_only",)
    ):
        storage = rand_values(numel, dtype, g, device)
        view = make(storage)
        if has_special:  # at the view's last element, first element or in between
            where = [
                tuple(n - 1 for n in view.shape),
                (0,) * view.dim(),
                tuple(n // 2 for n in view.shape),
                (0,) * (view.dim() - 1) + (1,),
            ][k % 4]
            view[where] = SPECIALS[k % 3]
        expected = storage.clone()
        found_exp = scalar(0.0, device)
        writes = op in ("unscale", "fused")
        oracle_unscale_(
            [make(expected) if writes else make(expected).clone()],
            found_exp,
            scalar(2.0**-16, device),
        )
        found = scalar(0.0, device)
        apply(op, [view], found)
        assert_bits(storage, expected, f"storage ({op})", exact_nan=not writes)
        assert_found(found, float(has_special))


# name -> (storage numel, size, stride, storage offset); every one has overlapping elements
OVERLAPPING = {
    "expand_scalar": (1, (100,), (0,), 0),  # torch.randn(1).expand(100)
    "as_strided_zero_stride": (10, (10,), (0,), 0),  # x.as_strided((10,), (0,))
    "window_4_over_6": (6, (3, 4), (1, 1), 0),  # stride-1 windows of 4 over a length-6 storage
    "window_in_longer_storage": (11, (3, 4), (1, 1), 2),
    "expand_columns": (3, (3, 5), (1, 0), 0),
    "expand_rows": (8, (4, 8), (0, 1), 0),
    "overlapping_rows": (40, (5, 8), (3, 1), 1),
    "big_expand": (70001, (3, 70000), (0, 1), 1),
}


def touched_offsets(size, stride, offset, device) -> torch.Tensor:
    """The distinct storage offsets a view reaches, by broadcasting index * stride per dim."""
    offs = torch.full((1,) * len(size), offset, dtype=torch.int64)
    for d, (n, s) in enumerate(zip(size, stride, strict=True)):
        shape = [1] * len(size)
        shape[d] = n
        offs = offs + (torch.arange(n) * s).view(shape)
    return torch.unique(offs.reshape(-1)).to(device)


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("case", list(OVERLAPPING))
def test_overlapping_grads_unscale_each_location_once(device, case, dtype):
    numel, size, stride, offset = OVERLAPPING[case]
    g = gen(15)
    idx = touched_offsets(size, stride, offset, device)
    untouched = sorted(set(range(numel)) - set(idx.tolist()))[:3]

    def expected_storage(storage, scale_it):
        exp, f = storage.clone(), scalar(0.0, device)
        sub = exp[idx]
        oracle_unscale_([sub], f, scalar(2.0**-16 if scale_it else 1.0, device))
        if scale_it:
            exp[idx] = sub
        return exp, f

    for op in OP_NAMES + ("check_only",):
        storage = rand_values(numel, dtype, g, device)
        view = storage.as_strided(size, stride, offset)
        assert torch._debug_has_internal_overlap(view) != 0  # 1: overlaps, 2: too hard to tell
        exp, f_exp = expected_storage(storage, op in ("unscale", "fused"))
        found = scalar(0.0, device)
        apply(op, [view], found)
        assert_bits(storage, exp, f"storage ({op})")
        assert_bits(found, f_exp, "found_inf")
        assert_found(found, 0.0)
    # An inf at a reached location is found; one at a location the view never reaches is not.
    storage = rand_values(numel, dtype, g, device)
    storage[idx[-1]] = INF
    found = scalar(0.0, device)
    apply("unscale", [storage.as_strided(size, stride, offset)], found)
    assert_found(found, 1.0)
    for i in untouched:
        storage = rand_values(numel, dtype, g, device)
        storage[i] = NAN
        found = scalar(0.0, device)
        apply("unscale", [storage.as_strided(size, stride, offset)], found)
        assert_found(found, 0.0)
        assert storage[i].isnan()


@pytest.mark.parametrize("op", OP_NAMES)
def test_empty_list(device, op):
    if op == "fused":  # found_inf overwritten with 0.0, next_* = the grown scale
        assert run_fused([], device, tracker=1999, expect_next=(2.0**17, 0)) == 0.0
        return
    found = scalar(7.0, device)
    apply(op, [], found)
    assert_found(found, 7.0)


@pytest.mark.parametrize("op", OP_NAMES)
def test_zero_size_tensors(device, op):
    def zero_size():
        return [
            torch.empty(0, device=device),
            torch.empty(3, 0, dtype=F16, device=device),
            torch.empty(0, 5, dtype=BF16, device=device).t(),
            torch.empty(4, dtype=F64, device=device).as_strided((0, 3), (0, 0)),
        ]

    assert run_op(op, zero_size(), device) == 0.0
    grads = zero_size()
    grads.insert(2, torch.tensor([1.0, -INF, 3.0], device=device))
    assert run_op(op, grads, device) == 1.0


# ============================================================================================
# 4. Bad inputs: the error names the argument


def valid_args(device: str) -> dict:
    return {
        "grads": [torch.full((8,), 4.0, device=device), torch.full((3,), 2.0, device=device)],
        "found_inf": scalar(0.0, device),
        "inv_scale": scalar(0.5, device),
        "scale": scalar(2.0, device),
        "growth_tracker": scalar(0, device, torch.int32),
        "next_scale": scalar(0.0, device),
        "next_growth_tracker": scalar(0, device, torch.int32),
    }


def call(op: str, a: dict) -> None:
    if op == "unscale":
        ops.non_finite_check_and_unscale_(a["grads"], a["found_inf"], a["inv_scale"])
    elif op == "check":
        ops.non_finite_check_(a["grads"], a["found_inf"])
    else:
        ops.unscale_update_scale_(
            a["grads"],
            a["found_inf"],
            a["scale"],
            a["growth_tracker"],
            a["next_scale"],
            a["next_growth_tracker"],
            2.0,
            0.5,
            1,
            False,
            False,
        )


def zeros(*shape: int, dtype: torch.dtype = F32):
    return lambda d: torch.zeros(shape, dtype=dtype, device=d)


def none(d: str) -> None:
    return None


def grads_with(dtype: torch.dtype, first_ok: bool = True):
    """A grads list whose last tensor has dtype (after a good one if first_ok)."""
    return lambda d: [torch.ones(4, device=d)] * first_ok + [torch.zeros(3, device=d).to(dtype)]


def copy_arg(v):
    if v is None:
        return None
    return [copy_arg(t) for t in v] if isinstance(v, list) else v.clone()


def torch_call(op: str, arg: str, a: dict, device: str) -> None:
    """torch's op that takes the role of `arg` in `call(op, a)`, on copies: the oracle for the
    exception type.  grads, found_inf and inv_scale go to the foreach unscale (inv_scale 1 for
    the check-only op, as torch's check pass uses); scale and growth_tracker to the scale update,
    and next_scale / next_growth_tracker too, in the places of the tensors it writes."""
    c = {k: copy_arg(v) for k, v in a.items()}
    if arg in ("grads", "found_inf", "inv_scale"):
        inv = c["inv_scale"] if op == "unscale" else scalar(1.0, device)
        torch._amp_foreach_non_finite_check_and_unscale_(c["grads"], c["found_inf"], inv)
    else:
        scale = c["next_scale"] if arg == "next_scale" else c["scale"]
        tracker = c["next_growth_tracker"] if arg == "next_growth_tracker" else c["growth_tracker"]
        torch._amp_update_scale_(scale, tracker, c["found_inf"], 2.0, 0.5, 1)


def torch_error(op: str, arg: str, a: dict, device: str) -> BaseException:
    with pytest.raises(Exception) as info:
        torch_call(op, arg, a, device)
    return info.value


I32, I64 = torch.int32, torch.int64
ALL, UNSCALE, FUSED = OP_NAMES, ("unscale",), ("fused",)
RTE, NotImpl = RuntimeError, NotImplementedError
# (ops, argument, bad value factory, our exception, start of our message).  Our exception is
# torch's for the same input or a subclass of it (the test checks against torch's op): torch's
# kernels raise RuntimeError for a state tensor's dtype or element count, its dtype dispatch
# NotImplementedError for a gradient dtype it has no kernel for, its Python binding TypeError
# for None and for a tensor where the list goes.
BAD_INPUTS = [
    (ALL, "found_inf", zeros(dtype=F64), RTE, "found_inf must be a Float tensor, got Doub"),
    (ALL, "found_inf", zeros(dtype=I32), RTE, "found_inf must be a Float tensor, got Int"),
    (ALL, "found_inf", zeros(2), RTE, r"found_inf must have exactly one element.*\[2\]"),
    (ALL, "found_inf", zeros(0), RTE, r"found_inf must have exactly one element.*\[0\]"),
    (ALL, "found_inf", none, TypeError, r"found_inf is undefined \(None\)"),
    (UNSCALE, "inv_scale", zeros(dtype=F64), RTE, "inv_scale must be a Float tensor"),
    (UNSCALE, "inv_scale", zeros(dtype=F16), RTE, "inv_scale must be a Float tensor"),
    (UNSCALE, "inv_scale", zeros(2), RTE, "inv_scale must have exactly one element"),
    (UNSCALE, "inv_scale", none, TypeError, r"inv_scale is undefined \(None\)"),
    (FUSED, "scale", zeros(dtype=F64), RTE, "scale must be a Float tensor"),
    (FUSED, "scale", zeros(dtype=BF16), RTE, "scale must be a Float tensor"),
    (FUSED, "scale", zeros(1, 2), RTE, "scale must have exactly one element"),
    (FUSED, "scale", none, TypeError, r"scale is undefined \(None\)"),
    (FUSED, "growth_tracker", zeros(dtype=I64), RTE, "growth_tracker must be a Int.*int32"),
    (FUSED, "growth_tracker", zeros(), RTE, "growth_tracker must be a Int tensor.*int32"),
    (FUSED, "growth_tracker", zeros(3, dtype=I32), RTE, "growth_tracker must have exac"),
    (FUSED, "growth_tracker", none, TypeError, r"growth_tracker is undefined \(None\)"),
    (FUSED, "next_scale", zeros(dtype=F64), RTE, "next_scale must be a Float tensor"),
    (FUSED, "next_scale", zeros(2), RTE, "next_scale must have exactly one element"),
    (FUSED, "next_growth_tracker", zeros(dtype=I64), RTE, "next_growth_tracker must be"),
    (ALL, "grads", lambda d: [torch.ones(2, device=d), None], TypeError, r"grads\[1\] is None"),
    (
        ALL,
        "grads",
        lambda d: torch.ones(2, device=d),
        TypeError,
        "grads must be a list of tensors, not a Tensor",
    ),
    (ALL, "grads", grads_with(I32, False), NotImpl, r"grads\[0\] has dtype Int.*integer, bool"),
    (ALL, "grads", grads_with(torch.complex64, False), NotImpl, r"grads\[0\] has dtype Complex"),
    (ALL, "grads", grads_with(torch.complex128), NotImpl, r"grads\[1\] has dtype ComplexDouble"),
    (ALL, "grads", grads_with(I64), NotImpl, r"grads\[1\] has dtype Long"),
    (ALL, "grads", grads_with(torch.uint8), NotImpl, r"grads\[1\] has dtype Byte"),
    (ALL, "grads", grads_with(torch.bool), NotImpl, r"grads\[1\] has dtype Bool"),
    (ALL, "grads", grads_with(torch.float8_e4m3fn), NotImpl, r"grads\[1\] has dtype Float8"),
]


def _bad_id(case) -> str:
    _, arg, bad, _, _ = case
    t = bad("cpu")
    t = t[-1] if isinstance(t, list) else t
    return f"{arg}-None" if t is None else f"{arg}-{dtype_id(t.dtype)}{list(t.shape)}"


def assert_unchanged(a: dict, before: dict) -> None:
    """Every argument holds the bits it held before (sparse ones compared densely)."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        t = t.to_dense() if t.layout != torch.strided else t
        return torch.view_as_real(t) if t.is_complex() else t

    for k, v in a.items():
        if v is None:
            continue
        if k == "grads":
            v, was = [t for t in v if t is not None], [t for t in before[k] if t is not None]
            assert_lists_bits([bits(t) for t in v], [bits(t) for t in was], exact_nan=True)
        else:
            assert_bits(bits(v), bits(before[k]), k, exact_nan=True)


@pytest.mark.parametrize(
    "op,case",
    [(op, case) for case in BAD_INPUTS for op in case[0]],
    ids=[f"{op}-{_bad_id(case)}" for case in BAD_INPUTS for op in case[0]],
)
def test_bad_inputs_name_the_argument(device, op, case):
    _, arg, bad, exc, match = case
    a = valid_args(device)
    a[arg] = bad(device)
    before = {k: copy_arg(v) for k, v in a.items()}
    with pytest.raises(exc, match="^" + match) as info:  # the message starts with the argument
        call(op, a)
    assert type(info.value) is exc
    # `except <torch's exception>:` catches ours: the same type or a subclass.
    theirs = torch_error(op, arg, a, device)
    assert isinstance(info.value, type(theirs)), (type(info.value), repr(theirs))
    # Arguments are checked before any work: nothing was written.
    assert_unchanged(a, before)


def test_one_element_state_of_any_shape_is_accepted(device):
    grads = [torch.tensor([2.0, INF], device=device)]
    found = torch.zeros(1, 1, device=device)
    ops.non_finite_check_and_unscale_(grads, found, torch.full((1,), 0.5, device=device))
    assert found.item() == 1.0 and grads[0][0].item() == 1.0


# Sparse arguments: the ops are registered for the sparse dispatch keys too, only so that the
# layout checks can name the argument instead of the dispatcher's "Could not run ... SparseCPU".
# Both are NotImplementedError.
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize(
    "where,match",
    [
        ("grads-coo", r"^grads\[1\] has layout Sparse.*_values\(\)"),
        ("grads-csr", r"^grads\[1\] has layout SparseCsr"),
        ("found_inf-coo", r"^found_inf must be a dense \(strided\) tensor, got Sparse"),
        ("inv_scale-coo", r"^inv_scale must be a dense \(strided\) tensor, got Sparse"),
        ("scale-coo", r"^scale must be a dense \(strided\) tensor, got Sparse"),
    ],
    ids=["grads-coo", "grads-csr", "found_inf-coo", "inv_scale-coo", "scale-coo"],
)
@pytest.mark.parametrize("op", OP_NAMES)
def test_sparse_arguments_rejected_naming_them(device, op, where, match):
    arg, layout = where.split("-")
    if arg == "inv_scale" and op != "unscale" or arg == "scale" and op != "fused":
        pytest.skip(f"{op} takes no {arg}")
    a = valid_args(device)
    dense = torch.tensor([[0.0, 2.0], [INF, 0.0]], device=device)
    if arg == "grads":
        bad = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
        a["grads"] = [torch.ones(2, device=device), bad]
    else:
        a[arg] = a[arg].reshape(1).to_sparse()
    before = {k: copy_arg(v) for k, v in a.items()}
    with pytest.raises(NotImplementedError, match=match) as info:
        call(op, a)
    theirs = torch_error(op, arg, a, device)
    assert isinstance(info.value, type(theirs)), (type(info.value), repr(theirs))
    assert_unchanged(a, before)


# Another device than found_inf's.  The dispatcher would route a call with CPU and meta tensors
# to the meta (fake) kernels, torch's and ours alike, so these redispatch to the CPU kernels
# directly: the CPU proxy of a call mixing CPU and CUDA tensors.
CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
OTHER_DEVICE = [
    ("unscale", "found_inf", r"^inv_scale is on cpu but found_inf is on meta"),
    ("unscale", "inv_scale", r"^inv_scale is on meta but found_inf is on cpu"),
    ("unscale", "grads", r"^grads\[1\] is on meta but found_inf is on cpu"),
    ("check", "found_inf", r"^grads\[0\] is on cpu but found_inf is on meta"),
    ("fused", "scale", r"^scale is on meta but found_inf is on cpu"),
    ("fused", "growth_tracker", r"^growth_tracker is on meta but found_inf is on cpu"),
    ("fused", "next_scale", r"^next_scale is on meta but found_inf is on cpu"),
    ("fused", "next_growth_tracker", r"^next_growth_tracker is on meta but found_inf is on cpu"),
]
AMPFUSED_OPS = {
    "unscale": torch.ops.ampfused.non_finite_check_and_unscale_.default,
    "check": torch.ops.ampfused.non_finite_check_.default,
    "fused": torch.ops.ampfused.unscale_update_scale_.default,
}


@pytest.mark.parametrize("op,arg,match", OTHER_DEVICE, ids=[f"{o}-{a}" for o, a, _ in OTHER_DEVICE])
def test_argument_on_another_device_cpu_kernel(op, arg, match):
    a = valid_args("cpu")
    if arg == "grads":
        a["grads"] = [torch.ones(4), torch.ones(3, device="meta")]
    else:
        a[arg] = a[arg].to("meta")
    before = {k: copy_arg(v) for k, v in a.items() if k != arg}
    args = {
        "unscale": lambda: (a["grads"], a["found_inf"], a["inv_scale"]),
        "check": lambda: (a["grads"], a["found_inf"]),
        "fused": lambda: (
            *(a[k] for k in ("grads", "found_inf", "scale", "growth_tracker", "next_scale")),
            *(a["next_growth_tracker"], 2.0, 0.5, 1, False, False),
        ),
    }[op]()
    with pytest.raises(RuntimeError, match=match) as info:
        AMPFUSED_OPS[op].redispatch(CPU_KEYS, *args)
    assert type(info.value) is RuntimeError
    if arg in ("grads", "found_inf", "inv_scale"):
        torch_op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
        torch_args = (clones(a["grads"]), a["found_inf"].clone(), a["inv_scale"].clone())
    else:  # next_scale / next_growth_tracker in the places of the tensors torch's update writes
        torch_op = torch.ops.aten._amp_update_scale_.default
        scale = a["next_scale" if arg == "next_scale" else "scale"].clone()
        tracker = a["next_growth_tracker" if arg == "next_growth_tracker" else "growth_tracker"]
        torch_args = (scale, tracker.clone(), a["found_inf"].clone(), 2.0, 0.5, 1)
    with pytest.raises(Exception) as theirs:
        torch_op.redispatch(CPU_KEYS, *torch_args)
    assert isinstance(info.value, type(theirs.value)), (type(info.value), repr(theirs.value))
    assert_unchanged({k: v for k, v in a.items() if k != arg}, before)


# Version counters: every tensor an op writes is bumped once per call, as by in-place torch ops;
# what it only reads (a check-only pass's grads, scale, growth_tracker, inv_scale) is not.
@pytest.mark.parametrize(
    "op,check_only", [("unscale", False), ("check", True), ("fused", False), ("fused", True)]
)
def test_version_counters_of_written_tensors_are_bumped(device, op, check_only):
    a = valid_args(device)
    names = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    before = {k: a[k]._version for k in names}
    grads_before = [g._version for g in a["grads"]]
    if op == "fused":
        ops.unscale_update_scale_(
            a["grads"],
            *(a[k] for k in ("found_inf", "scale", "growth_tracker", "next_scale")),
            *(a["next_growth_tracker"], 2.0, 0.5, 1, check_only, False),
        )
        written = {"found_inf", "next_scale", "next_growth_tracker"}
    else:
        call(op, a)
        written = {"found_inf"}
    assert {k: a[k]._version - before[k] for k in names} == {k: int(k in written) for k in names}
    bumps = [g._version - v for g, v in zip(a["grads"], grads_before, strict=True)]
    assert bumps == [0 if check_only else 1] * len(bumps)


# A build without CUDA kernels still registers the CUDA key, so a CUDA call gets the arguments
# checked and then says why nothing runs, instead of the dispatcher's "Could not run ...".  No
# GPU needed: CPU tensors redispatched to the CUDA key reach that kernel.
@pytest.mark.skipif(_C.with_cuda, reason="this build has CUDA kernels")
@pytest.mark.parametrize("op", OP_NAMES)
def test_cuda_key_of_a_cpu_only_build_explains(op):
    a = valid_args("cpu")
    before = {k: copy_arg(v) for k, v in a.items()}
    args = {
        "unscale": (a["grads"], a["found_inf"], a["inv_scale"]),
        "check": (a["grads"], a["found_inf"]),
        "fused": (
            *(a[k] for k in ("grads", "found_inf", "scale", "growth_tracker", "next_scale")),
            *(a["next_growth_tracker"], 2.0, 0.5, 1, False, False),
        ),
    }[op]
    cuda_keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(RuntimeError, match="^ampfused was built without CUDA kernels"):
        AMPFUSED_OPS[op].redispatch(cuda_keys, *args)
    assert_unchanged(a, before)
    bad_found = torch.zeros((), dtype=torch.int32)  # the shared checks still run first
    with pytest.raises(RuntimeError, match="^found_inf must be a Float tensor"):
        AMPFUSED_OPS[op].redispatch(cuda_keys, *(args[0], bad_found, *args[2:]))


# Gradients that require grad (backward(create_graph=True) leaves them so): torch's op unscales
# them in place under grad mode, and so do ours.
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("op", OP_NAMES)
def test_grads_that_require_grad_are_unscaled_as_torch_does(device, op):
    def grads():
        w = torch.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
        (w * w * 1024.0).sum().backward(create_graph=True)  # w.grad = 2048 w, with a grad_fn
        leaf = torch.tensor([8.0, INF], device=device, requires_grad=True)
        return [w.grad, leaf]

    ours, theirs = grads(), grads()
    assert torch.is_grad_enabled() and all(g.requires_grad for g in ours)
    a = {**valid_args(device), "grads": ours}
    call(op, a)
    inv = a["inv_scale"] if op == "unscale" else scalar(1.0 if op == "check" else 0.5, device)
    found = scalar(0.0, device)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found, inv)
    if op == "check":  # read-only: the values stay, torch's check pass (inv_scale 1) equals that
        assert_lists_bits(ours, [t.detach() for t in theirs])
    else:
        assert_lists_bits([t.detach() for t in ours], [t.detach() for t in theirs])
    assert_bits(a["found_inf"], found, "found_inf")


# Deliberate difference: a gradient no kernel takes, after good ones, makes torch's CPU kernel
# unscale the tensors before it and then raise; ours validates the whole list first, so the
# call raises the same type and changes nothing.
@pytest.mark.parametrize("op", OP_NAMES)
def test_unsupported_grad_after_good_ones_changes_nothing(device, op):
    def grads():
        return [
            torch.full((5,), 8.0, device=device),
            torch.ones(3, dtype=torch.complex64, device=device),
            torch.full((2,), 8.0, device=device),
        ]

    a = {**valid_args(device), "grads": grads()}
    before = {k: copy_arg(v) for k, v in a.items()}
    with pytest.raises(NotImplementedError, match=r"^grads\[1\] has dtype ComplexFloat"):
        call(op, a)
    assert_unchanged(a, before)
    if device == "cpu":
        theirs = grads()
        with pytest.raises(NotImplementedError):
            torch._amp_foreach_non_finite_check_and_unscale_(
                theirs, scalar(0.0, device), scalar(0.5, device)
            )
        assert theirs[0][0].item() == 4.0  # torch: the first tensor is already unscaled


# Several devices in one call: only meaningful with a GPU.


@pytest.mark.cuda
@pytest.mark.parametrize("op", OP_NAMES)
def test_found_inf_on_another_device(op):
    a = valid_args("cuda")
    a["found_inf"] = scalar(0.0, "cpu")
    with pytest.raises(RuntimeError, match=r"but found_inf is on cpu"):
        call(op, a)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "arg", ["inv_scale", "scale", "growth_tracker", "next_scale", "next_growth_tracker"]
)
def test_state_on_another_device(arg):
    a = valid_args("cuda")
    a[arg] = a[arg].cpu()
    op = "unscale" if arg == "inv_scale" else "fused"
    with pytest.raises(RuntimeError, match=rf"\b{arg} is on cpu but found_inf is on cuda"):
        call(op, a)


@pytest.mark.cuda
@pytest.mark.parametrize("op", OP_NAMES)
def test_grads_on_several_devices(op):
    a = valid_args("cuda")
    a["grads"] = [torch.ones(4, device="cuda"), torch.ones(4), torch.ones(2, device="cuda")]
    before = clones(a["grads"])
    with pytest.raises(RuntimeError, match=r"^grads\[1\] is on cpu but found_inf is on cuda"):
        call(op, a)
    assert_lists_bits(a["grads"], before)


@pytest.mark.cuda
@pytest.mark.parametrize("op", OP_NAMES)
def test_grads_on_cpu_state_on_cuda(op):
    a = valid_args("cuda")
    a["grads"] = [torch.ones(4)]
    with pytest.raises(RuntimeError, match=r"^grads\[0\] is on cpu but found_inf is on cuda"):
        call(op, a)


@pytest.mark.cuda
def test_no_host_sync():
    """The contract: no op syncs with the host (dense and gapped grads; a second call reuses
    the cached metadata table)."""
    grads = mixed_grads("cuda", 16) + [torch.randn(64, 66, device="cuda")[:, ::2]]
    a = valid_args("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            for op in OP_NAMES:
                call(op, {**a, "grads": grads})
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ============================================================================================
# 5. torch.library.opcheck


def opcheck_cases(device: str) -> dict:
    def mixed(with_inf: bool):
        grads = mixed_grads(device, 17, sizes=(5, 12, 7, 2, 0))
        grads.append(rand_values(24, F32, gen(18), device).view(4, 6).t())
        if with_inf:
            grads[1][3] = INF
        return grads

    def fused(grads, check_only, accumulate, interval=1):
        return (
            grads,
            scalar(7.0, device),
            scalar(4.0, device),
            scalar(0, device, torch.int32),
            scalar(-1.0, device),
            scalar(5, device, torch.int32),
            2.0,
            0.5,
            interval,
            check_only,
            accumulate,
        )

    u, c, f = (
        torch.ops.ampfused.non_finite_check_and_unscale_.default,
        torch.ops.ampfused.non_finite_check_.default,
        torch.ops.ampfused.unscale_update_scale_.default,
    )
    return {
        "unscale-mixed-inf": (u, (mixed(True), scalar(0.0, device), scalar(0.25, device))),
        "unscale-mixed-clean": (u, (mixed(False), scalar(0.0, device), scalar(0.25, device))),
        "unscale-empty": (u, ([], scalar(0.0, device), scalar(0.25, device))),
        "check-mixed-inf": (c, (mixed(True), scalar(0.0, device))),
        "check-mixed-clean": (c, (mixed(False), scalar(0.0, device))),
        "fused-mixed-grow": (f, fused(mixed(False), False, False)),
        "fused-mixed-inf": (f, fused(mixed(True), False, False, interval=2000)),
        "fused-check-only-accumulate": (f, fused(mixed(True), True, True)),
        "fused-empty-accumulate": (f, fused([], False, True)),
    }


@pytest.mark.parametrize("case", list(opcheck_cases("cpu")))
def test_opcheck(device, case):
    op, args = opcheck_cases(device)[case]
    result = torch.library.opcheck(op, args)
    assert result and all(v == "SUCCESS" for v in result.values()), result


# ============================================================================================
# 6. More than 2**31 elements in one tensor


@pytest.mark.bigmem
def test_more_than_2_31_elements(device):
    n = 2**31 + 2**20 + 5
    g = torch.ones(n, dtype=BF16, device=device)  # 4.3 GB
    g[2**31 - 1] = 12.0
    g[2**31] = 10.0
    g[-1] = 6.0
    found = scalar(0.0, device)
    ops.non_finite_check_([g], found)
    assert_found(found, 0.0)
    g[n - 3] = INF  # beyond 2**31: found only if indexing does not wrap
    ops.non_finite_check_([g], found)
    assert_found(found, 1.0)
    found = scalar(7.0, device)
    ns, nt = scalar(0.0, device), scalar(0, device, torch.int32)
    ops.unscale_update_scale_(
        [g],
        found,
        scalar(2.0, device),
        scalar(0, device, torch.int32),
        ns,
        nt,
        2.0,
        0.5,
        2000,
        False,
        False,
    )
    assert_found(found, 1.0)
    assert (ns.item(), nt.item()) == (1.0, 0)
    assert g[-1].item() == 3.0  # the last element was scaled
    assert g[2**31].item() == 5.0 and g[2**31 - 1].item() == 6.0
    assert g[n - 3].item() == INF and g[n - 2].item() == 0.5
    # Samples across the whole tensor (every other element was 1.0).
    for sample in (
        g[: 2**31 - 1 : 2**20 + 7],
        g[2**31 - 4096 : 2**31 - 1],
        g[2**31 + 1 : n - 3 : 4099],
        g[n - 4096 : n - 3],
    ):
        assert bool((sample == 0.5).all()), sample[sample != 0.5]


# ============================================================================================
# 6b. ampfused.ops' eager entry points (ampfused._C, csrc/python_module.cpp): plain tensors
# skip torch.ops' boxing; everything else must still reach torch.ops and what it dispatches to.


class _SeenFunctions(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _LoggingTensor(torch.Tensor):
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class _PassThroughDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _op_call(op: str):
    """(ampfused.ops function, its torch.ops packet, args builder) for op."""
    return {
        "unscale": (
            ops.non_finite_check_and_unscale_,
            torch.ops.ampfused.non_finite_check_and_unscale_,
            lambda a: (a["grads"], a["found_inf"], a["inv_scale"]),
        ),
        "check": (
            ops.non_finite_check_,
            torch.ops.ampfused.non_finite_check_,
            lambda a: (a["grads"], a["found_inf"]),
        ),
        "fused": (
            ops.unscale_update_scale_,
            torch.ops.ampfused.unscale_update_scale_,
            lambda a: (
                *(a[k] for k in ("grads", "found_inf", "scale", "growth_tracker", "next_scale")),
                *(a["next_growth_tracker"], 2.0, 0.5, 1, False, False),
            ),
        ),
    }[op]


@pytest.mark.parametrize("op", OP_NAMES)
def test_eager_path_honours_torch_function_modes(op):
    fn, packet, args = _op_call(op)
    a = valid_args("cpu")
    with _SeenFunctions() as mode:
        fn(*args(a))
    assert [f for f in mode.seen if "ampfused" in str(f)], mode.seen
    assert a["found_inf"].item() == 0.0


@pytest.mark.parametrize("where", ["grads", "found_inf"])
@pytest.mark.parametrize("op", OP_NAMES)
def test_eager_path_honours_tensor_subclasses(op, where):
    fn, packet, args = _op_call(op)
    a = valid_args("cpu")
    if where == "grads":
        a["grads"] = [a["grads"][0], a["grads"][1].as_subclass(_LoggingTensor)]
    else:
        a["found_inf"] = a["found_inf"].as_subclass(_LoggingTensor)
    _LoggingTensor.seen = []
    fn(*args(a))
    assert [f for f in _LoggingTensor.seen if "ampfused" in str(f)], _LoggingTensor.seen


@pytest.mark.parametrize("op", OP_NAMES)
def test_eager_path_returns_not_implemented_for_what_it_does_not_take(op):
    """The entry points themselves: None for a plain call, NotImplemented for a list with a None,
    a tuple-less iterable or a subclass, and a Python int where the schema says float (torch.ops
    converts it; the wrapper then goes there)."""
    eager = getattr(_C, _op_call(op)[1]._qualified_op_name.split("::")[1])
    a = valid_args("cpu")
    args = _op_call(op)[2]
    assert eager(*args(a)) is None
    for grads in (
        [a["grads"][0], None],
        iter(a["grads"]),
        [a["grads"][0].as_subclass(_LoggingTensor)],
    ):
        assert eager(*args({**a, "grads": grads})) is NotImplemented
    assert eager(*args(a)[:-1]) is NotImplemented  # argument count
    # A dispatch mode runs Python inside the op call, which could drop a borrowed tensor.
    with _PassThroughDispatchMode():
        assert eager(*args(a)) is NotImplemented
    if op == "fused":
        with_int = list(args(a))
        with_int[6] = 2  # growth_factor
        assert eager(*with_int) is NotImplemented
        ops.unscale_update_scale_(*with_int)  # torch.ops takes it
        assert a["next_scale"].item() == 4.0


# ============================================================================================
# 7. torch.compile traces the fused op (fake kernels registered)


@pytest.mark.parametrize("op", OP_NAMES)
def test_fake_kernels_run_on_meta_tensors(op):
    """ops.py registers fake kernels (torch can only synthesize trivial ones for ops returning
    nothing in recent releases; without a registration meta tensors raise NotImplementedError)."""
    grads = [torch.empty(5, device="meta"), torch.empty(3, 4, dtype=F16, device="meta")]
    apply(op, grads, torch.empty((), device="meta"))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(device, backend):
    torch._dynamo.reset()

    def step(grads, found_inf, scale, tracker, next_scale, next_tracker):
        ops.unscale_update_scale_(
            grads, found_inf, scale, tracker, next_scale, next_tracker, 2.0, 0.5, 2, False, False
        )
        return found_inf * 2, next_scale + 1, next_tracker + 1

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, fullgraph=True, backend=counter)

    def inputs(has_inf):
        grads = mixed_grads(device, 19, sizes=(50, 31, 17, 9))
        if has_inf:
            grads[1][4] = INF
        return (
            grads,
            scalar(7.0, device),
            scalar(2.0**16, device),
            scalar(1, device, torch.int32),
            scalar(0.0, device),
            scalar(0, device, torch.int32),
        )

    for has_inf in (False, True):
        eager_in, compiled_in = inputs(has_inf), inputs(has_inf)
        eager_out, compiled_out = step(*eager_in), compiled(*compiled_in)
        for a, e in zip(compiled_out, eager_out, strict=True):
            assert_bits(a, e, "output")
        assert_lists_bits(compiled_in[0], eager_in[0])
        for a, e in zip(compiled_in[1:], eager_in[1:], strict=True):
            assert_bits(a, e, "state")
        assert compiled_in[4].item() == (2.0**15 if has_inf else 2.0**17)
    assert counter.frame_count == 1  # one graph, no recompile for new values
    assert "ampfused.unscale_update_scale_" in str(counter.graphs[0].graph)


# ============================================================================================
# 8. The scaler's C++ walk over param_groups (csrc/grad_gather.cpp, ampfused._C): the oracle is
# torch.amp.GradScaler._unscale_grads_, which reads nothing of the optimizer but param_groups.


def walk_torch(groups, device: str, allow_fp16: bool = False) -> dict:
    found = scalar(0.0, device)
    scaler = torch.amp.GradScaler(device)
    return torch.amp.GradScaler._unscale_grads_(
        scaler, SimpleNamespace(param_groups=groups), scalar(0.5, device), found, allow_fp16
    )


def walk_ours(groups, device: str, allow_fp16: bool = False, fused: bool = False):
    if not fused:
        return _C.unscale_grads(groups, scalar(0.5, device), scalar(0.0, device), allow_fp16)
    state = torch.zeros(ops.STATE_SIZE, dtype=I32, device=device)
    state[0] = scalar(2.0, device).view(I32)
    state[2] = 1
    inf = float("inf")
    result = _C.fused_pass(
        groups,
        state,
        torch.empty_like(state),
        2.0,
        0.5,
        2000,
        -inf,
        inf,
        1,
        False,
        False,
        allow_fp16,
        False,
    )
    return None if result is None else [(device, found) for device, found, _, _ in result]


def param(device: str, dtype: torch.dtype = F32, value: float = 8.0, layout: str = "strided"):
    """A parameter with a .grad of dtype filled with value (sparse COO or CSR if asked)."""
    p = torch.zeros(2, 2, dtype=dtype, device=device)
    g = torch.full((2, 2), value, device=device).to(dtype)
    if layout == "csr":
        p, g = p.to_sparse_csr(), g.to_sparse_csr()
    elif layout == "coo":
        g = g.to_sparse()
    p.grad = g
    return p


WALK_BAD = {
    # name: (grad kinds in order, our exception, start of our message)
    "complex-between": (
        [F32, torch.complex64, F32],
        NotImplementedError,
        r"unscaling ComplexFloat gradients is not implemented: optimizer.param_groups\[0\]"
        r"\['params'\]\[1\].grad",
    ),
    "int-after": ([F32, I64], NotImplementedError, r"unscaling Long gradients"),
    "coo-complex": ([F32, "coo-complex"], NotImplementedError, r"unscaling ComplexFloat"),
    "csr": ([F32, "csr"], NotImplementedError, r"optimizer.param_groups\[0\]\['params'\]\[1\]"),
    # torch's loop raises for float16 as it meets it and for the dtype only after the loop
    "complex-then-fp16": ([torch.complex64, F16], ValueError, "Attempting to unscale FP16"),
    "not-a-tensor": ([F32, "int"], AssertionError, "expected param to be torch.Tensor, got int"),
}


def walk_groups(kinds, device: str) -> list[dict]:
    params = []
    for k in kinds:
        if k == "csr":
            params.append(param(device, layout="csr"))
        elif k == "coo-complex":
            params.append(param(device, torch.complex64, layout="coo"))
        elif k == "int":
            params.append(3)
        else:
            params.append(param(device, k))
    return [{"params": params}]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("fused", [False, True], ids=["unscale_grads", "fused_pass"])
@pytest.mark.parametrize("case", list(WALK_BAD))
def test_walk_bad_grads_raise_torch_type_and_change_nothing(device, case, fused):
    kinds, exc, match = WALK_BAD[case]
    ours, theirs = walk_groups(kinds, device), walk_groups(kinds, device)
    before = [p.grad.to_dense().clone() for p in ours[0]["params"] if isinstance(p, torch.Tensor)]
    with pytest.raises(exc, match="^" + match) as info:
        walk_ours(ours, device, fused=fused)
    assert type(info.value) is exc
    with pytest.raises(Exception) as torch_info:
        walk_torch(theirs, device)
    assert isinstance(info.value, type(torch_info.value)), (info.value, torch_info.value)
    after = [p.grad.to_dense() for p in ours[0]["params"] if isinstance(p, torch.Tensor)]
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)  # ours validated the whole list first: nothing unscaled


def test_scaler_complex_grad_beside_float32_changes_nothing(device):
    """The deliberate difference, through the public scaler: torch unscales the float32 grads
    before the complex one and raises; ampfused raises the same type and unscales none."""
    results = {}
    for cls in (torch.amp.GradScaler, ampfused.GradScaler):
        params = walk_groups([F32, torch.complex64, F32], device)[0]["params"]
        opt = torch.optim.SGD(params, lr=1.0)
        scaler = cls(device, init_scale=2.0)
        scaler.scale(torch.ones((), device=device))
        with pytest.raises(NotImplementedError):
            scaler.unscale_(opt)
        results[cls] = [p.grad[0, 0].item() for p in params]
    assert results[ampfused.GradScaler] == [8.0, 8.0, 8.0]
    if device == "cpu":
        assert results[torch.amp.GradScaler] == [4.0, 8.0, 4.0]


ITERABLES = {
    "list": list,
    "tuple": tuple,
    "generator": lambda xs: (x for x in xs),
    "dict-keys": lambda xs: dict.fromkeys(xs).keys(),
}


@pytest.mark.parametrize("fused", [False, True], ids=["unscale_grads", "fused_pass"])
@pytest.mark.parametrize("params_kind", list(ITERABLES))
@pytest.mark.parametrize("groups_kind", list(ITERABLES)[:3])
def test_walk_takes_any_iterable_torch_takes(device, groups_kind, params_kind, fused):
    def groups():
        # torch's CUDA kernel has no bfloat16 (ours does): float32 in its place there
        dtypes = [F32, F64, BF16 if device == "cpu" else F32, F32]
        ps = [param(device, dt, 8.0 * (i + 1)) for i, dt in enumerate(dtypes)]
        ps[2].grad[0, 1] = INF
        g = [{"params": ITERABLES[params_kind](ps[:3])}, {"params": ITERABLES[params_kind](ps[3:])}]
        return ps, ITERABLES[groups_kind](g)

    (ours, our_groups), (theirs, their_groups) = groups(), groups()
    found = dict(walk_ours(our_groups, device, fused=fused))
    expected = walk_torch(their_groups, device)
    assert_lists_bits([p.grad for p in ours], [p.grad for p in theirs])
    assert list(found) == list(expected)
    for dev, f in found.items():
        assert_bits(f, expected[dev], "found_inf")


def test_walk_fallback_after_reading_a_generator_keeps_the_params():
    """A gradient on a device without ampfused kernels (meta, here) makes the walk return None
    for torch's path, which reads group['params'] again: a generator read by the walk is
    replaced by the list it yielded, so torch's walk sees every parameter."""
    ps = [param("cpu"), param("meta"), param("cpu")]
    groups = [{"params": (p for p in ps)}]
    assert walk_ours(groups, "cpu") is None
    kept = groups[0]["params"]  # the same objects, in order, as a list
    assert type(kept) is list and all(a is b for a, b in zip(kept, ps, strict=True))
    found = walk_torch(groups, "cpu")
    assert [p.grad[0, 0].item() for p in (ps[0], ps[2])] == [4.0, 4.0]
    assert set(found) == {torch.device("cpu"), torch.device("meta")}
    # A generator of groups cannot be put back: refused, naming the fix (the scaler reads
    # optimizer.param_groups into a list first, so only a direct caller can get here).
    with pytest.raises(TypeError, match="optimizer.param_groups is a one-shot iterator"):
        walk_ours((g for g in [{"params": [param("meta")]}]), "cpu")


@pytest.mark.parametrize(
    "groups,match",
    [(5, r"^optimizer.param_groups must be an iterable, got int"), ([{"params": 5}], r"^opt")],
    ids=["param_groups", "params"],
)
def test_walk_non_iterable_raises_type_error_as_torch(groups, match):
    with pytest.raises(TypeError, match=match):
        walk_ours(groups, "cpu")
    with pytest.raises(TypeError):
        walk_torch(groups, "cpu")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("fused", [False, True], ids=["unscale_grads", "fused_pass"])
def test_walk_unscales_grads_that_require_grad(device, fused):
    def groups():
        w = torch.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
        (w * w * 1024.0).sum().backward(create_graph=True)
        return w, [{"params": [w]}]

    (w, ours), (v, theirs) = groups(), groups()
    assert torch.is_grad_enabled() and w.grad.requires_grad
    walk_ours(ours, device, fused=fused)
    walk_torch(theirs, device)
    assert_bits(w.grad.detach(), v.grad.detach(), "grad")
    assert w.grad[0].item() == 1024.0


def test_a_sequence_other_than_a_list_keeps_the_kernels_error():
    """Only a tensor where the list goes is the argument's TypeError: a sequence the schema
    parser takes (a ParameterList) meets the kernel's own check."""
    grads = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(RuntimeError, match="^found_inf must have exactly one element"):
        ops.non_finite_check_and_unscale_(grads, torch.zeros(2), torch.ones(()))
