"""Fused clipping: the ``clip_factor_`` op and ``GradScaler.clip_grad_norm_``.

Op level: the total norm and the factor against ``ampfused.reference.clip_factor_`` bit for bit
(tables of 0 to 3,000 item rows, around the 256 lanes of the fixed order; inf/NaN counts; with
and without the scaler's state), the factor against torch's own clip formula, opcheck, and the
bad inputs, each named.

Scaler level: three copies of one parameter set train side by side, each with its own scaler:

- ``torch``: ``torch.amp.GradScaler`` + ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``, the
  pair ``clip_grad_norm_`` replaces (on CUDA, where torch has no bfloat16 unscale kernel, its
  bfloat16 gradients are unscaled by torch's float32 kernel on copies: ``TorchScaler``);
- ``exact``: the same, but clipped by ``torch.nn.utils.clip_grads_with_norm_`` with the total
  of ``ampfused.reference`` (our fixed-order total; torch's own clip formula and multiply);
- ``fused``: ``ampfused.GradScaler`` + ``scaler.clip_grad_norm_``.

The fused copy must equal ``exact`` bit for bit in everything (gradients, parameters, optimizer
state, scale, growth tracker) whenever the scale is a power of two (then unscaling is exact, so
torch's two roundings, ``(g * inv) * coef``, equal our one, ``g * (inv * coef)``), and equal the
reference's clipped gradients and total bit for bit always.  Against ``torch`` it makes the same
skip decisions and scale updates; its total is close (TOTAL_RTOL); for the inf norm of float32
gradients (a max: exact in any order), for norms that take torch's route (1, 3) and where the
clip does not clip, everything equals torch's bit for bit.

Without a GPU, the CUDA kernel's lane order is not observable here; its CUDA variants compare it
with the reference and the CPU kernel.
"""

from __future__ import annotations

import math
import re
import sys
import unittest.mock
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import ampfused
from ampfused import ops, reference

INF, NAN = math.inf, math.nan
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
FIELDS = len(ops.STAT_FIELDS)
SUM_SQ, ABS_MAX, POS_INF, NEG_INF, NAN_COUNT, ZEROS, SUBNORMAL = range(FIELDS)


# ------------------------------------------------------------------------------- comparison
def _same(actual: torch.Tensor, expected: torch.Tensor, what: str = "value") -> None:
    """Bit equality of two tensors (dtype, shape and device included); NaN equals any NaN (a
    NaN's payload is the hardware's)."""
    meta_a = (actual.dtype, tuple(actual.shape), actual.device)
    meta_e = (expected.dtype, tuple(expected.shape), expected.device)
    assert meta_a == meta_e, f"{what}: {meta_a} vs {meta_e}"
    a, e = actual.detach().reshape(-1), expected.detach().reshape(-1)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    if torch.equal(a.view(bits), e.view(bits)):
        return  # the fast path: the same bytes
    nan_a, nan_e = a.isnan(), e.isnan()
    assert torch.equal(nan_a, nan_e), f"{what}: NaN at different places:\n {a}\n {e}"
    differ = a[~nan_a].view(bits) != e[~nan_e].view(bits)
    assert not differ.any(), (
        f"{what}: {int(differ.sum())} values differ, e.g. {a[~nan_a][differ][:4].tolist()} vs "
        f"{e[~nan_e][differ][:4].tolist()}"
    )


def _host(t: torch.Tensor) -> torch.Tensor:
    """A copy on the host (cloned first: on the CPU .cpu() returns the tensor itself, which the
    device audit would then take for a host tensor)."""
    return t.clone().cpu()


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=F32)


# =============================================================================================
# 1. The op: ampfused::clip_factor_


def _table(n_rows: int, seed: int, device: str) -> torch.Tensor:
    """A statistics table as scaler_pass_ writes it: a header, then n_rows item rows whose sums
    of squares spread over 8 binades (most additions round, so the order of their sum shows in
    the last bits)."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.zeros(n_rows + 1, FIELDS, dtype=F64)
    t[0] = torch.tensor([1024.0, 3.0] + [0.0] * (FIELDS - 2))  # scale, steps, found (not read)
    sums = torch.rand(n_rows, generator=gen, dtype=F64)
    sums = sums * torch.exp2(torch.randint(-4, 4, (n_rows,), generator=gen).double())
    t[1:, SUM_SQ] = sums
    t[1:, ABS_MAX] = sums.sqrt() * torch.rand(n_rows, generator=gen, dtype=F64)
    t[1:, ZEROS] = torch.randint(0, 100, (n_rows,), generator=gen).double()
    return t.to(device)


def _state(scale: float, device: str) -> torch.Tensor:
    """The scaler's int32 state with this (float32) scale."""
    s = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    s[0:1].view(F32).fill_(scale)
    s[ops.STATE_FIELDS.index("hysteresis_left")] = 1
    return s.to(device)


def _outputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    # -7 and 5: values the op must overwrite
    return torch.full((), -7.0, device=device), torch.full((), 5.0, device=device)


def _clip_op(table, state, max_norm, norm_type) -> tuple[torch.Tensor, torch.Tensor]:
    total, factor = _outputs(table.device)
    ops.clip_factor_(table, state, total, factor, max_norm, norm_type)
    return total, factor


def _clip_reference(table, state, max_norm, norm_type) -> tuple[torch.Tensor, torch.Tensor]:
    total, factor = torch.empty((), dtype=F32), torch.empty((), dtype=F32)
    reference.clip_factor_(_host(table), state, total, factor, max_norm, norm_type)
    return total, factor


def _torch_factor(total: torch.Tensor, scale: float | None, max_norm: float) -> torch.Tensor:
    """What torch's clip_grads_with_norm_ multiplies unscaled gradients by, times inv_scale as
    torch.amp.GradScaler computes it: the same float32 operations, run by torch itself."""
    coef = torch.clamp(max_norm / (_host(total) + 1e-6), max=1.0)
    inv = _f32(1.0) if scale is None else reference.inv_scale_of(_f32(scale))
    return inv * coef


ROWS = [0, 1, 2, 255, 256, 257, 513, 3000]
SCALES = [None, 65536.0, 1000.0]  # None: no state (gradients already unscaled)


@pytest.mark.parametrize("max_norm", [1e9, 0.1], ids=["large", "small"])
@pytest.mark.parametrize("scale", SCALES, ids=["no_state", "pow2", "scale1000"])
@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
@pytest.mark.parametrize("n_rows", ROWS)
def test_op_matches_reference(device, n_rows, norm_type, scale, max_norm):
    table = _table(n_rows, n_rows, device)
    state = None if scale is None else _state(scale, device)
    before = (table.clone(), None if state is None else state.clone())
    total, factor = _clip_op(table, state, max_norm, norm_type)
    ref_state = None if state is None else _host(state)
    ref_total, ref_factor = _clip_reference(table, ref_state, max_norm, norm_type)
    _same(_host(total), ref_total, "total_norm")
    _same(_host(factor), ref_factor, "factor")
    _same(_host(factor), _torch_factor(total, scale, max_norm), "factor against torch's formula")
    inv = 1.0 if scale is None else float(reference.inv_scale_of(_f32(scale)))
    if float(total) < max_norm:
        assert float(factor) == inv  # clip_coef clamped to 1: the factor only unscales
    else:
        assert float(factor) < inv
    # Inputs untouched; the float64 total of the table's rows, rounded once to float32.
    _same(table, before[0])
    if state is not None:
        _same(state, before[1])
    if norm_type == 2.0:
        exact = math.sqrt(math.fsum(table[1:, SUM_SQ].tolist()))
        assert abs(float(total) - exact) <= 2.0**-24 * exact
    else:
        assert float(total) == float(_f32(float(table[1:, ABS_MAX].max()) if n_rows else 0.0))


def _sequential_sum(values: list[float]) -> float:
    """Left to right, one float64 rounding per addition."""
    total = 0.0
    for v in values:
        total += v
    return total


def _pairwise_sum(values: list[float]) -> float:
    """Halves summed recursively, then added: one float64 rounding per addition."""
    if len(values) <= 1:
        return values[0] if values else 0.0
    half = len(values) // 2
    return _pairwise_sum(values[:half]) + _pairwise_sum(values[half:])


def test_reference_order_is_not_a_plain_sum():
    """The float64 total of the 3,000-row table of test_report_total_in_the_clip_order tells the
    lane order from a sequential or pairwise sum (that test compares those bits; the op's float32
    total hides most such differences, test_op_order_shows_in_the_float32_total makes one
    visible).

    Both orders are spelled out here: Python's sum() is no plain sum from Python 3.12 on
    (compensated: it equals the lane total of this table, which is correctly rounded), and the
    order of torch's Tensor.sum() is torch's to choose (vector width, version).  The data comes
    from a seeded CPU generator and the sums are IEEE float64 additions in Python, so the result
    is the same on every machine."""
    rows = _table(3000, 3001, "cpu")[1:]
    values = rows[:, SUM_SQ].tolist()
    lanes = reference.stat_total(rows)[0]
    assert lanes != _sequential_sum(values)
    assert lanes != _pairwise_sum(values)


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
def test_op_order_shows_in_the_float32_total(device, norm_type):
    """A table whose float32 total depends on the order of the float64 sum: the first row is
    T**2 with T = 2**30 + 2**6, halfway between two float32 values, then 2,999 rows of 1.0.
    Added one by one to the first, each 1.0 is lost (half an ulp of T**2 is 128): sqrt gives T
    exactly, which rounds to even, 2**30.  In the lane order the ones meet in the lanes and the
    tree first, about 3,000 of them reach the first row, and the total rounds up to 2**30 + 128.
    """
    t = 2.0**30 + 2.0**6
    table = torch.zeros(3001, FIELDS, dtype=F64)
    table[1:, SUM_SQ] = 1.0
    table[1, SUM_SQ] = t * t  # exact in float64
    table[1:, ABS_MAX] = 1.0
    sequential = 0.0
    for v in table[1:, SUM_SQ].tolist():
        sequential += v
    assert float(_f32(math.sqrt(sequential))) == 2.0**30
    total, _ = _clip_op(table.to(device), None, 1.0, norm_type)
    ref_total, _ = _clip_reference(table, None, 1.0, norm_type)
    _same(_host(total), ref_total)
    if norm_type == 2.0:
        assert float(total) == 2.0**30 + 128


@pytest.mark.parametrize("n_rows", [6, 257, 3000])
def test_report_total_in_the_clip_order(n_rows):
    """reduce_grad_stats's total (GradScaler.report()'s total norm) sums the rows in the clip's
    order: the same float64 bits as reference.stat_total, so the two totals agree bit for bit."""
    rows = _table(n_rows, n_rows + 1, "cpu")[1:]
    numels = [ops.CHUNK_SIZE] * (n_rows - 1) + [5]  # a row each
    _, total = ampfused._C.reduce_grad_stats(rows, numels)
    assert total == reference.stat_total(rows)[0]
    assert total == reference.reduce_grad_stats(rows, numels)[1]


# Item rows with inf/NaN inputs, as the pass writes them: the counts and a non-finite sum.
#            name:     (rows: {row: (sum_squares, pos_inf, neg_inf, nan)}, total l2, total inf)
NON_FINITE = {
    "pos_inf": ({3: (INF, 1, 0, 0)}, INF, INF),
    "neg_inf_last_row": ({299: (INF, 0, 2, 0)}, INF, INF),
    "nan": ({0: (NAN, 0, 0, 1)}, NAN, NAN),
    "inf_and_nan": ({10: (INF, 1, 0, 0), 266: (NAN, 0, 0, 3)}, NAN, NAN),
    # an inf input unscaled by inv == 0: its square is NaN, no NaN input counted
    "inf_times_zero": ({5: (NAN, 1, 0, 0)}, NAN, NAN),
}


@pytest.mark.parametrize("scale", [None, 1000.0], ids=["no_state", "scale1000"])
@pytest.mark.parametrize("case", list(NON_FINITE))
def test_op_non_finite_tables(device, case, scale):
    rows, want_l2, want_inf = NON_FINITE[case]
    table = _table(300, 7, device)
    for r, (sum_sq, pos, neg, nan) in rows.items():
        table[1 + r, SUM_SQ] = sum_sq
        counts = torch.tensor([pos, neg, nan], dtype=F64, device=device)
        table[1 + r, POS_INF : NAN_COUNT + 1] = counts
    state = None if scale is None else _state(scale, device)
    ref_state = None if state is None else _host(state)
    for norm_type, want in ((2.0, want_l2), (INF, want_inf)):
        total, factor = _clip_op(table, state, 1.0, norm_type)
        ref_total, ref_factor = _clip_reference(table, ref_state, 1.0, norm_type)
        _same(_host(total), ref_total, f"{norm_type} total_norm")
        _same(_host(factor), ref_factor, f"{norm_type} factor")
        _same(_host(total), _f32(want), f"{norm_type} total_norm")
        # torch's formula: 1 / inf = 0 (the gradients become 0 or NaN), NaN stays NaN.
        _same(_host(factor), _torch_factor(total, scale, 1.0), f"{norm_type} factor")
        assert math.isnan(float(factor)) if math.isnan(want) else float(factor) == 0.0


def test_op_finite_huge_rows_do_not_hide_non_finite_counts():
    # The largest finite float64 squares overflow to inf in the sum: norm 2 is inf; norm inf is
    # the largest magnitude (no inf element was counted).
    table = _table(4, 1, "cpu")
    table[1:3, SUM_SQ] = 1.7e308
    table[1:3, ABS_MAX] = torch.tensor([1.0, 3.0e38], dtype=F64)
    total, _ = _clip_op(table, None, 1.0, 2.0)
    assert float(total) == INF
    total, factor = _clip_op(table, None, 1.0, INF)
    assert float(total) == float(_f32(3.0e38)) and float(factor) > 0.0


def _opcheck_cases(device: str) -> dict[str, tuple]:
    def args(n_rows: int, state: bool, norm_type: float, max_norm: float = 0.5) -> tuple:
        total, factor = _outputs(device)
        s = _state(1000.0, device) if state else None
        return (_table(n_rows, 1, device), s, total, factor, max_norm, norm_type)

    return {
        "l2-state-257": args(257, True, 2.0),
        "inf-no-state-3": args(3, False, INF),
        "l2-header-only": args(0, True, 2.0, 1e9),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases("cpu")))
def test_opcheck(device, case):
    result = torch.library.opcheck(
        torch.ops.ampfused.clip_factor_.default, _opcheck_cases(device)[case]
    )
    assert result and all(v == "SUCCESS" for v in result.values()), result


# Bad arguments: (argument, replacement, exception type, message).  The replacement takes the
# test's device.
def _zeros(*shape: int, dtype: torch.dtype = F32) -> Callable[[str], torch.Tensor]:
    return lambda device: torch.zeros(shape, dtype=dtype, device=device)


def _sparse_table(device: str) -> torch.Tensor:
    return torch.zeros(3, FIELDS, dtype=F64, device=device).to_sparse()


# Bad arguments: argument -> [(id, replacement made on the test's device, exception, message)].
TABLE_MSG = (
    rf"^grad_stats must be the contiguous float64 \[rows, {FIELDS}\] table scaler_pass_ wrote"
)
OUT_MSG = "must be a one-element float32 tensor"
STATE_MSG = rf"^state must be a contiguous int32 tensor of {ops.STATE_SIZE} elements"
NORM_MSG = r"^clip_factor_ computes norm_type 2 or inf, got "
BAD: dict[str, list[tuple[str, Callable[[str], Any], type, str]]] = {
    "grad_stats": [
        (
            "float32",
            _zeros(3, FIELDS),
            RuntimeError,
            TABLE_MSG + rf".*got Float of shape \[3, {FIELDS}\]",
        ),
        ("5_columns", _zeros(3, 5, dtype=F64), RuntimeError, TABLE_MSG + r".*shape \[3, 5\]"),
        ("1d", _zeros(18, dtype=F64), RuntimeError, TABLE_MSG + r".*shape \[18\]"),
        (
            "no_header",
            _zeros(0, FIELDS, dtype=F64),
            RuntimeError,
            TABLE_MSG + rf".*shape \[0, {FIELDS}\]",
        ),
        ("transposed", lambda d: _zeros(FIELDS, 3, dtype=F64)(d).t(), RuntimeError, TABLE_MSG),
    ],
    "total_norm": [
        ("float64", _zeros(dtype=F64), RuntimeError, rf"^total_norm {OUT_MSG}.*got Double"),
        ("2_elements", _zeros(2), RuntimeError, rf"^total_norm {OUT_MSG}.*shape \[2\]"),
    ],
    "factor": [
        ("bfloat16", _zeros(dtype=BF16), RuntimeError, rf"^factor {OUT_MSG}.*got BFloat16"),
        ("empty", _zeros(0), RuntimeError, rf"^factor {OUT_MSG}.*shape \[0\]"),
    ],
    "state": [
        ("float32", _zeros(ops.STATE_SIZE), RuntimeError, STATE_MSG + r".*got Float"),
        ("4_elements", _zeros(4, dtype=torch.int32), RuntimeError, STATE_MSG + r".*shape \[4\]"),
    ],
    "norm_type": [
        ("1", lambda d: 1.0, NotImplementedError, NORM_MSG + "1"),
        ("3", lambda d: 3.0, NotImplementedError, NORM_MSG + "3"),
        ("-inf", lambda d: -INF, NotImplementedError, NORM_MSG + "-inf"),
    ],
}
BAD_CASES = [
    pytest.param(arg, make, exc, match, id=f"{arg}-{name}")
    for arg, cases in BAD.items()
    for name, make, exc, match in cases
] + [
    # A sparse table reaches the op's own checks through its sparse-key registrations.
    pytest.param(
        "grad_stats",
        _sparse_table,
        NotImplementedError,
        r"^grad_stats must be a dense",
        id="grad_stats-sparse",
    )
]
ARG_INDEX = {"grad_stats": 0, "state": 1, "total_norm": 2, "factor": 3, "norm_type": 5}


@pytest.mark.parametrize("arg,make,exc,match", BAD_CASES)
def test_op_bad_inputs_named(device, arg, make, exc, match):
    total, factor = _outputs(device)
    args = [_table(5, 0, device), _state(1000.0, device), total, factor, 0.5, 2.0]
    args[ARG_INDEX[arg]] = make(device)
    with pytest.raises(exc, match=match) as info:
        ops.clip_factor_(*args)
    assert type(info.value) is exc
    # Nothing written before every check passed (the outputs that are still the valid ones).
    assert float(total) == -7.0 and float(factor) == 5.0


# Arguments on another device than grad_stats.  The dispatcher would send a call mixing CPU and
# meta tensors to the fake kernel, so this redispatches to the CPU kernel: the CPU stand-in for
# a call mixing CPU and CUDA tensors.
CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@pytest.mark.parametrize("arg", ["state", "total_norm", "factor"])
def test_op_argument_on_another_device(arg):
    total, factor = _outputs("cpu")
    args = [_table(5, 0, "cpu"), _state(1000.0, "cpu"), total, factor, 0.5, 2.0]
    args[ARG_INDEX[arg]] = args[ARG_INDEX[arg]].to("meta")
    op = torch.ops.ampfused.clip_factor_.default
    with pytest.raises(RuntimeError, match=rf"^{arg} is on meta but grad_stats is on cpu"):
        op.redispatch(CPU_KEYS, *args)
    if arg == "state":  # the outputs were checked first and are valid: still not written
        assert float(total) == -7.0 and float(factor) == 5.0


@pytest.mark.cuda
@pytest.mark.parametrize("arg", ["state", "total_norm", "factor"])
def test_op_argument_on_cpu_table_on_cuda(arg):
    total, factor = _outputs("cuda")
    args = [_table(5, 0, "cuda"), _state(1000.0, "cuda"), total, factor, 0.5, 2.0]
    args[ARG_INDEX[arg]] = _host(args[ARG_INDEX[arg]])
    with pytest.raises(RuntimeError, match=rf"^{arg} is on cpu but grad_stats is on cuda"):
        ops.clip_factor_(*args)


@pytest.mark.cuda
def test_op_cuda_equals_cpu():
    for n_rows in (1, 257, 3000):
        table = _table(n_rows, 11, "cpu")
        if n_rows > 7:  # a NaN counted in item row 7 (the 1-row table has none: all finite)
            table[7, NAN_COUNT] = 1.0
        for norm_type in (2.0, INF):
            cpu = _clip_op(table, _state(1000.0, "cpu"), 0.3, norm_type)
            cuda = _clip_op(table.cuda(), _state(1000.0, "cuda"), 0.3, norm_type)
            _same(_host(cuda[0]), cpu[0])
            _same(_host(cuda[1]), cpu[1])


# =============================================================================================
# 2. GradScaler.clip_grad_norm_ against unscale_ + torch.nn.utils.clip_grad_norm_


def _unscale_through_float32_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor, kernel: Callable
) -> None:
    """``kernel`` (torch's check-and-unscale) for gradients of a dtype it has no kernel for on
    their device: run on float32 copies (widening is exact, inf and NaN included, so found_inf
    is set as it would be), each result rounded back to the gradient's dtype (to nearest even).
    For bfloat16 that is torch's per-element definition, v * inv_scale in float32 opmath
    stored as bfloat16 (its CPU kernel; test_oracle_bf16_unscale_is_torchs_cpu_kernel)."""
    wide = [g.float() for g in grads]
    kernel(wide, found_inf, inv_scale)
    for g, w in zip(grads, wide, strict=True):
        g.copy_(w)


def _torch_lacks_unscale_kernel(grad: torch.Tensor) -> bool:
    """torch._amp_foreach_non_finite_check_and_unscale_ has no bfloat16 kernel on CUDA
    (NotImplementedError); its CPU kernel has one."""
    return grad.is_cuda and grad.dtype == BF16


class TorchScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler, the oracle, with the kernel torch lacks supplied: gradients of a
    (device, dtype) torch has no unscale kernel for are unscaled through float32 copies
    (_unscale_through_float32_); every other group, and everything else of the scaler (grouping,
    found_inf per device, skip and update), is torch's own."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        torch_kernel = torch._amp_foreach_non_finite_check_and_unscale_

        def kernel(grads, found, inv):  # called once per (device, dtype) group
            if grads and _torch_lacks_unscale_kernel(grads[0]):
                _unscale_through_float32_(grads, found, inv, torch_kernel)
            else:
                torch_kernel(grads, found, inv)

        with unittest.mock.patch.object(
            torch, "_amp_foreach_non_finite_check_and_unscale_", kernel
        ):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


FusedScaler = ampfused.GradScaler


def clip_grads_with_norm_(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """torch.nn.utils.clip_grads_with_norm_ with the multiply of torch's CPU kernels on every
    device: each element times the float32 coefficient in float32, rounded once to the
    gradient's dtype, as ampfused's clip multiplies (README, deliberate differences).  On CUDA,
    torch's mixed-dtype _foreach_mul_ loads the 0-dim float32 coefficient as bfloat16 (float16)
    for such gradients first, a second rounding (seen on an H100: bfloat16 parameters off in the
    third significant digit after one AdamW step)."""
    real = torch._foreach_mul_

    def mul_(tensors, other):  # noqa: ANN001, ANN202
        low = tensors and tensors[0].is_cuda and tensors[0].dtype in (torch.float16, BF16)
        if low and torch.is_tensor(other):
            for t in tensors:
                t.copy_(t.float() * other)
        else:
            real(tensors, other)

    with unittest.mock.patch.object(torch, "_foreach_mul_", mul_):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def test_oracle_bf16_unscale_is_torchs_cpu_kernel():
    """Where torch has a bfloat16 unscale kernel (the CPU), the oracle's CUDA stand-in equals it
    bit for bit, found_inf included: every bfloat16 bit pattern (subnormals, -0.0, infs, NaNs),
    finite ones alone and with the rest, by an inv_scale of 1 (passed through), a power of two
    (exact, down into the subnormals), float32(1 / 1000) (rounded) and 2**20 (overflows)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(BF16)
    finite = every[every.isfinite()]
    for inv in (1.0, 2.0**-14, float(_f32(1 / 1000)), 2.0**20):
        for values in (finite, every):
            theirs = [values.clone(), values[:7].clone()]
            ours = [t.clone() for t in theirs]
            found_theirs, found_ours = torch.zeros(()), torch.zeros(())
            inv_scale = _f32(inv)
            torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv_scale)
            _unscale_through_float32_(
                ours, found_ours, inv_scale, torch._amp_foreach_non_finite_check_and_unscale_
            )
            for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                _same(a, b, f"inv {inv}: tensor {k}")
            _same(found_ours, found_theirs, f"inv {inv}: found_inf")
            assert float(found_ours) == (0.0 if values is finite else 1.0)


@pytest.mark.parametrize("mix", ["bf16", "mixed"])
def test_oracle_scaler_is_torchs_where_it_stands_in(monkeypatch, mix):
    """The oracle scaler, its stand-in used for every bfloat16 group as on CUDA, trains exactly
    as torch's own scaler on the CPU: clean, inf and NaN iterations (the inf and NaN in a
    bfloat16 gradient with "bf16", in a float32 one with "mixed"), two groups."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "_torch_lacks_unscale_kernel", lambda g: g.dtype == BF16)
    plain = torch.amp.GradScaler("cpu", **SCALER_KW)
    runs = {
        "torch": _build("torch", plain, "cpu", "adamw", mix),
        "oracle": _build("oracle", TorchScaler("cpu", **SCALER_KW), "cpu", "adamw", mix),
    }
    for i, inject in enumerate(INJECT):
        _set_grads(runs, i, inject)
        for run in runs.values():
            run.scaler.unscale_(run.opt)
        _assert_runs_equal(runs["torch"], runs["oracle"], f"iteration {i}: unscaled")
        _step_all(runs)
        _assert_runs_equal(runs["torch"], runs["oracle"], f"iteration {i}: stepped")


# The parameters of a parity run: two groups, a parameter whose gradient stays None, zero-size
# gradients (test_gradients_of_several_items has gradients of several table rows).
SHAPES = [(16, 8), (8,), (0,), (33, 7), (5,), (2, 0, 3), (9,)]
FROZEN = (9,)  # the shape of the parameter whose .grad stays None
GROUP_SPLIT = 3  # params [0, 3) in group 0, the rest in group 1
MIXES = {"fp32": (F32,), "bf16": (BF16,), "mixed": (F32, BF16)}
OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01),
    "adam_fused": lambda groups: torch.optim.Adam(groups, lr=0.01, fused=True),
}
# growth_interval 1: every clean step grows the scale, every skipped one backs off.
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**14, "growth_interval": 1}

# Tolerance of the total against torch's.  Ours: float32 squares summed in float32 within an
# item of 65,536 elements (at most 44 roundings on any path, tests/test_grad_stats.py), the items
# in float64, one rounding to float32: within 23 float32 ulps relative.  torch's: float32
# accumulation per tensor in its own chunked order, then the norm of the per-tensor norms, also
# in float32: a few tens of ulps more for these sizes.  1e-5 (~170 ulps) covers both with room,
# while a wrong element, a missed scale or a doubly-counted tensor is off by far more.  torch
# rounds to bfloat16 the per-tensor norms of bfloat16 gradients, their squares in the norm of
# the stacked norms, and the total when every gradient is bfloat16: three roundings of at most
# 2**-9 relative each, so 2**-7 then.
TOTAL_RTOL = {"fp32": 1e-5, "bf16": 2.0**-7, "mixed": 2.0**-7}
# The norm that clips each norm type's gradients (their unscaled norms are about 1.2 (2), 0.15
# (inf), 24 (1) and 0.5 (3)): a factor well below 1.
ACTIVE_MAX_NORM = {2.0: 0.3, INF: 0.05, 1.0: 5.0, 3.0: 0.2}


@dataclass
class Run:
    """One copy of the parameters with its optimizer and scaler."""

    name: str
    scaler: torch.amp.GradScaler
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    model: nn.Module | None = None

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]


def _build(
    name: str, scaler: torch.amp.GradScaler, device: str, opt: str, mix: str, shapes=SHAPES
) -> Run:
    gen = torch.Generator().manual_seed(0)
    dtypes = MIXES[mix]
    params = [
        nn.Parameter(
            torch.randn(s, generator=gen, dtype=F64).to(dtypes[i % len(dtypes)]).to(device)
        )
        for i, s in enumerate(shapes)
    ]
    split = min(GROUP_SPLIT, len(params))
    groups = [{"params": params[:split]}, {"params": params[split:], "lr": 0.002}]
    return Run(name, scaler, params, OPTIMIZERS[opt](groups))


def _runs(device: str, opt: str, mix: str, shapes=SHAPES, **scaler_kw: Any) -> dict[str, Run]:
    kw = {**SCALER_KW, **scaler_kw}
    return {
        "torch": _build("torch", TorchScaler(device, **kw), device, opt, mix, shapes),
        "exact": _build("exact", TorchScaler(device, **kw), device, opt, mix, shapes),
        "fused": _build("fused", FusedScaler(device, **kw), device, opt, mix, shapes),
    }


def _set_grads(runs: dict[str, Run], i: int, inject: str | None = None) -> None:
    """The same scaled gradients in every run: unscaled values ~0.05 * N(0, 1) times the
    current scale; `inject` puts an inf or NaN into one of them (the last element of the
    first)."""
    gen = torch.Generator().manual_seed(100 + i)
    any_run = next(iter(runs.values()))
    scale = float(any_run.scaler.get_scale()) if any_run.scaler.is_enabled() else 1.0
    values = [
        None if p.shape == FROZEN else torch.randn(p.shape, generator=gen, dtype=F64) * 0.05 * scale
        for p in any_run.params
    ]
    for run in runs.values():
        run.scaler.scale(torch.ones((), device=run.params[0].device))  # creates the scale
        for p, v in zip(run.params, values, strict=True):
            p.grad = None if v is None else v.to(p.dtype).to(p.device)
        if inject is not None:
            run.grads()[0].view(-1)[-1] = {"inf": INF, "nan": NAN}[inject]


def _expected_clip(run: Run, max_norm: float, norm_type: float, scaled: bool = True):
    """reference.clip_grad_norm_ on copies of run's gradients (still scaled when `scaled`):
    (total, clipped gradients)."""
    grads = [g.clone() for g in run.grads()]
    scale = run.scaler._scale.clone() if scaled else None
    return reference.clip_grad_norm_(grads, scale, max_norm, norm_type), grads


def _clip_all(
    runs: dict[str, Run], max_norm: float, norm_type: float, unscaled: bool = False, **kw: Any
) -> dict[str, torch.Tensor]:
    """Clips every run its way; checks the fused run against the reference and returns the
    totals.  `unscaled`: unscale_ was called already."""
    fused = runs["fused"]
    table_norm = norm_type in (2.0, INF)
    expected = _expected_clip(fused, max_norm, norm_type, not unscaled) if table_norm else None
    versions = [g._version for g in fused.grads()]
    totals = {"fused": fused.scaler.clip_grad_norm_(fused.opt, max_norm, norm_type, **kw)}
    writes = [g._version - v for g, v in zip(fused.grads(), versions, strict=True)]
    if expected is not None:
        ref_total, ref_grads = expected
        _same(totals["fused"], ref_total.to(fused.params[0].device), "fused total")
        for k, (g, r) in enumerate(zip(fused.grads(), ref_grads, strict=True)):
            _same(g, r, f"fused grad {k}")
        # one read pass, one multiply pass (unscale and clip together): written once
        assert writes == [1] * len(writes), writes
    else:
        assert writes == [1 if unscaled else 2] * len(writes), writes  # unscale_, then torch's
    for name in ("torch", "exact"):
        run = runs[name]
        if not unscaled:
            run.scaler.unscale_(run.opt)
        if name == "exact" and expected is not None:
            total = expected[0].to(run.params[0].device)
            clip_grads_with_norm_(run.params, max_norm, total)
        else:
            total = torch.nn.utils.clip_grad_norm_(run.params, max_norm, norm_type, **kw)
        totals[name] = total
    return totals


def _shapes(norm_type: float) -> list[tuple[int, ...]]:
    """SHAPES, without the empty gradients for the inf norm: torch's _foreach_norm refuses an
    empty tensor's inf norm, and so does the scaler's clip (test_inf_norm_of_empty_gradients)."""
    return [s for s in SHAPES if math.prod(s)] if norm_type == INF else SHAPES


def _step_all(runs: dict[str, Run]) -> None:
    for run in runs.values():
        run.scaler.step(run.opt)
        run.scaler.update()


def _snapshot(run: Run) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, p in enumerate(run.params):
        out[f"param {k}"] = p.detach().clone()
        if p.grad is not None:
            out[f"grad {k}"] = p.grad.clone()
        for key, v in run.opt.state.get(p, {}).items():
            if v is not None:
                out[f"state {k} {key}"] = torch.as_tensor(v).clone()
    out["scale"] = run.scaler._scale.clone()
    out["growth_tracker"] = run.scaler._growth_tracker.clone()
    return out


def _assert_runs_equal(a: Run, b: Run, where: str) -> None:
    sa, sb = _snapshot(a), _snapshot(b)
    assert list(sa) == list(sb), where
    for key in sa:
        _same(sb[key], sa[key], f"{where}: {b.name} vs {a.name}, {key}")


def _assert_close_to_torch(runs: dict[str, Run], totals, mix: str, where: str) -> None:
    t, f = runs["torch"], runs["fused"]
    # the same skip decision and scale update
    assert torch.equal(f.scaler._scale, t.scaler._scale), where
    assert torch.equal(f.scaler._growth_tracker, t.scaler._growth_tracker), where
    torch.testing.assert_close(
        totals["fused"].double(), totals["torch"].double(), rtol=TOTAL_RTOL[mix], atol=0,
        equal_nan=True, msg=lambda m: f"{where}: total norm against torch's: {m}",
    )  # fmt: skip
    for k, (pf, pt) in enumerate(zip(f.params, t.params, strict=True)):
        # The clip factors differ in their last bits (torch's in bfloat16 arithmetic for
        # bfloat16 gradients), so the updates do: a float32 parameter by far less than 1e-5, a
        # bfloat16 one by a rounding in each of the two steps taken (a bfloat16 ulp is 2**-7
        # relative at most).
        rtol, atol = (2.0**-6, 1e-3) if pf.dtype == BF16 else (1e-5, 1e-5)
        torch.testing.assert_close(
            pf, pt, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{where}: param {k}: {m}"
        )


# Iterations: clean, inf (skipped, backs off), NaN (skipped), clean.
INJECT = [None, "inf", "nan", None]


def _train(runs, mix, max_norm, norm_type, pow2_scale=True) -> list[torch.Tensor]:
    """The four iterations of INJECT in every run, compared after each; returns fused totals."""
    history = []
    for i, inject in enumerate(INJECT):
        _set_grads(runs, i, inject)
        before = _snapshot(runs["fused"])
        totals = _clip_all(runs, max_norm, norm_type)
        _step_all(runs)
        where = f"iteration {i} ({inject or 'clean'})"
        if pow2_scale:
            _assert_runs_equal(runs["exact"], runs["fused"], where)
        _assert_close_to_torch(runs, totals, mix, where)
        after = _snapshot(runs["fused"])
        if inject is None:
            assert float(after["scale"]) == 2.0 * float(before["scale"]), where
        else:  # skipped: parameters and optimizer state untouched, the scale backed off
            for key in before:
                if not key.startswith(("grad", "scale", "growth")):
                    _same(after[key], before[key], f"{where}: {key}")
            assert float(after["scale"]) == 0.5 * float(before["scale"]), where
        assert totals["fused"].dtype == F32 and totals["fused"].shape == ()
        history.append(totals["fused"])
    return history


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_parity_with_torch(device, opt, mix, norm_type):
    runs = _runs(device, opt, mix, shapes=_shapes(norm_type))
    totals = _train(runs, mix, ACTIVE_MAX_NORM[norm_type], norm_type)
    assert float(totals[0]) > ACTIVE_MAX_NORM[norm_type]  # the clip was active
    assert float(totals[1]) == INF and math.isnan(float(totals[2]))
    if norm_type == INF and mix == "fp32":
        # torch's inf norm is a max, exact in any order: torch's pair is matched bit for bit
        _assert_runs_equal(runs["torch"], runs["fused"], "inf norm, float32")


@pytest.mark.parametrize("mix", list(MIXES))
def test_parity_max_norm_not_reached(device, mix):
    # clip_coef clamped to 1: the gradients are only unscaled, exactly as torch's unscale_ does
    runs = _runs(device, "adamw", mix)
    totals = _train(runs, mix, 1e6, 2.0)
    assert float(totals[3]) < 1e6
    _assert_runs_equal(runs["torch"], runs["fused"], "max_norm not reached")


@pytest.mark.parametrize("norm_type", [1.0, 3.0])
@pytest.mark.parametrize("mix", ["fp32", "mixed"])
def test_other_norms_are_torchs(device, mix, norm_type):
    """Norms the table has no statistics for: unscale_ + torch's clip, so torch bit for bit."""
    runs = _runs(device, "sgd", mix)
    totals = _train(runs, mix, ACTIVE_MAX_NORM[norm_type], norm_type)
    assert float(totals[0]) > ACTIVE_MAX_NORM[norm_type]
    _assert_runs_equal(runs["torch"], runs["fused"], f"norm {norm_type}")


def test_parity_scale_not_a_power_of_two(device):
    # inv_scale = float32(1 / 1000) is inexact: ours rounds g * (inv * coef) once, torch rounds
    # g * inv and then * coef; so the reference (checked inside _clip_all) is the oracle, and
    # torch is close.
    runs = _runs(device, "adamw", "mixed", init_scale=1000.0)
    _train(runs, "mixed", 1.0, 2.0, pow2_scale=False)


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
def test_gradients_of_several_items(device, norm_type):
    # 65,536 elements make a row of the statistics table: one and two rows per gradient
    shapes = [(3,), (65536,), (65537,)]
    runs = _runs(device, "adamw", "mixed", shapes=shapes)
    for i, inject in enumerate([None, "inf"]):
        _set_grads(runs, i, inject)
        totals = _clip_all(runs, 1.0, norm_type)
        _step_all(runs)
        _assert_runs_equal(runs["exact"], runs["fused"], f"iteration {i}")
        _assert_close_to_torch(runs, totals, "mixed", f"iteration {i}")


def test_many_tiny_tensors(device):
    runs = _runs(device, "sgd", "fp32", shapes=[(7,)] * 1000)
    for i in range(2):
        _set_grads(runs, i)
        totals = _clip_all(runs, 0.5, 2.0)
        _step_all(runs)
        _assert_runs_equal(runs["exact"], runs["fused"], f"iteration {i}")
        _assert_close_to_torch(runs, totals, "fp32", f"iteration {i}")


@pytest.mark.parametrize("inject", [None, "inf"])
@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0], ids=["l2", "inf", "l1"])
def test_after_unscale_only_clips(device, norm_type, inject):
    # init_scale 1000: a second unscale would show
    runs = _runs(device, "adamw", "fp32", shapes=_shapes(norm_type), init_scale=1000.0)
    _set_grads(runs, 0, inject)
    for run in runs.values():
        run.scaler.unscale_(run.opt)
    _same(runs["fused"].grads()[1], runs["torch"].grads()[1])  # the same unscale_
    max_norm = ACTIVE_MAX_NORM[norm_type]
    totals = _clip_all(runs, max_norm, norm_type, unscaled=True)
    _step_all(runs)
    _assert_runs_equal(runs["exact"], runs["fused"], "after unscale_")
    _assert_close_to_torch(runs, totals, "fp32", "after unscale_")
    if inject:
        assert float(totals["fused"]) == INF
    else:
        assert float(totals["fused"]) > max_norm


def test_clip_after_step_raises(device):
    runs = _runs(device, "sgd", "fp32")
    _set_grads(runs, 0)
    fused = runs["fused"]
    fused.scaler.clip_grad_norm_(fused.opt, 1.0)
    fused.scaler.step(fused.opt)
    with pytest.raises(RuntimeError, match=r"^clip_grad_norm_\(\) is being called after step\(\)"):
        fused.scaler.clip_grad_norm_(fused.opt, 1.0)
    fused.scaler.update()
    _set_grads(runs, 1)
    fused.scaler.clip_grad_norm_(fused.opt, 1.0)  # a new iteration may clip again


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_parameters_in_the_optimizers_place_are_refused(enabled):
    """torch.nn.utils.clip_grad_norm_'s first argument is the parameters; ours is the optimizer.
    Handed the parameters (or the model), the scaler says so, as a TypeError, having read and
    changed nothing; the corrected call then clips as if the wrong one had not been made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = FusedScaler("cpu", init_scale=8.0, enabled=enabled)
    scaler.scale(model(torch.randn(4, 3)).square().sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    wrong = {
        "model.parameters()": (model.parameters(), r"a generator \(model\.parameters\(\)\?\)"),
        "a list of parameters": (list(model.parameters()), r"a list of tensors"),
        "the model": (model, r"a module \(Sequential: the model\?\)"),
        "None": (None, "None"),
    }
    for label, (arg, given) in wrong.items():
        with pytest.raises(TypeError) as info:
            scaler.clip_grad_norm_(arg, 0.5)
        message = str(info.value)
        assert message.startswith(
            "clip_grad_norm_(optimizer, max_norm): expected the optimizer whose gradients to "
            "clip, got "
        ), (label, message)
        assert re.search(given, message), (label, message)
        assert message.endswith("; pass the optimizer: scaler.clip_grad_norm_(optimizer, 0.5)")
        # (no stage recorded for the argument; a disabled scaler keeps no stages)
        assert not getattr(scaler, "_per_optimizer_states", {}), label
        for p, g in zip(model.parameters(), grads, strict=True):
            _same(p.grad, g, label)
    total = scaler.clip_grad_norm_(opt, 0.5)
    unscaled = [g / 8.0 if enabled else g for g in grads]
    want = torch.linalg.vector_norm(torch.stack([g.norm() for g in unscaled]))
    assert float(total) == pytest.approx(float(want), rel=1e-6)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_disabled_scaler_is_torchs_clip(device, norm_type):
    runs = {
        "fused": _build("fused", FusedScaler(device, enabled=False), device, "sgd", "mixed"),
        "torch": _build("torch", TorchScaler(device, enabled=False), device, "sgd", "mixed"),
    }
    _set_grads(runs, 0)
    fused, plain = runs["fused"], runs["torch"]
    total = fused.scaler.clip_grad_norm_(fused.opt, 0.5, norm_type)
    _same(total, torch.nn.utils.clip_grad_norm_(plain.params, 0.5, norm_type))
    _step_all(runs)
    for pf, pt in zip(fused.params, plain.params, strict=True):
        _same(pf, pt)


def test_bf16_guard_without_scaling(device):
    # scaling=False: the scale stays 1, the pass only checks; clip_grad_norm_ clips by the
    # reference total and skips steps with inf/NaN.
    guard = FusedScaler(device, scaling=False, growth_interval=1)
    run = _build("fused", guard, device, "adamw", "bf16")
    plain = _build("plain", TorchScaler(device, enabled=False), device, "adamw", "bf16")
    for i, inject in enumerate([None, "nan", None]):
        _set_grads({"fused": run, "plain": plain}, i, inject)
        before = _snapshot(run)
        ref_total, ref_grads = _expected_clip(run, 0.5, 2.0, scaled=False)
        total = guard.clip_grad_norm_(run.opt, 0.5)
        _same(total, ref_total.to(run.params[0].device))
        for g, r in zip(run.grads(), ref_grads, strict=True):
            _same(g, r)
        guard.step(run.opt)
        guard.update()
        assert float(guard.get_scale()) == 1.0
        if inject:
            assert math.isnan(float(total))
            for k, p in enumerate(run.params):
                _same(p, before[f"param {k}"], f"iteration {i}: param {k}")
        else:
            # a plain loop clipping by the same total (torch's formula, its CPU multiply)
            clip_grads_with_norm_(plain.params, 0.5, total)
            plain.opt.step()
            for k, (p, q) in enumerate(zip(run.params, plain.params, strict=True)):
                _same(p, q, f"iteration {i}: param {k}")


class Net(nn.Module):
    """Named parameters for watch(); two optimizer groups: [fc1.*], [fc2.*, head.*]."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.fc1(x).relu()).relu())

    def groups(self) -> list[dict]:
        rest = [*self.fc2.parameters(), *self.head.parameters()]
        return [{"params": list(self.fc1.parameters())}, {"params": rest}]


def _net_backward(runs: dict[str, Run], device: str, bad: dict[str, float] | None = None):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1)).to(device)
    for run in runs.values():
        assert run.model is not None
        run.scaler.scale(run.model(x).square().sum()).backward()
        for pname, value in (bad or {}).items():
            run.model.get_parameter(pname).grad.view(-1)[-1] = value


def _net_runs(device: str, watch: bool) -> dict[str, Run]:
    runs = {}
    for name, cls in (("torch", TorchScaler), ("fused", FusedScaler)):
        torch.manual_seed(0)
        net = Net().to(device)
        scaler = cls(device, init_scale=2.0**10)
        if watch and cls is FusedScaler:
            scaler.watch(net)
        opt = torch.optim.SGD(net.groups(), lr=0.1)
        runs[name] = Run(name, scaler, list(net.parameters()), opt, net)
    return runs


@pytest.mark.parametrize("first", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["clip", "unscale_then_clip"])
@pytest.mark.parametrize("watch", [False, True], ids=["positions", "watch_names"])
def test_error_if_nonfinite(device, watch, unscale_first, first):
    runs = _net_runs(device, watch)
    # fc1.* is clean; fc2.weight is the first gradient with inf/NaN, head.bias has another
    _net_backward(runs, device, {"fc2.weight": first, "head.bias": INF if first != INF else NAN})
    errors = {}
    for name, run in runs.items():
        if unscale_first or name == "torch":
            run.scaler.unscale_(run.opt)
        with pytest.raises(RuntimeError) as info:
            if name == "torch":
                torch.nn.utils.clip_grad_norm_(run.params, 1.0, error_if_nonfinite=True)
            else:
                run.scaler.clip_grad_norm_(run.opt, 1.0, error_if_nonfinite=True)
        errors[name] = str(info.value)
    assert errors["fused"].startswith(errors["torch"]), errors
    offender = "fc2.weight" if watch else "optimizer.param_groups[1]['params'][0] (shape (8, 8))"
    assert errors["fused"][len(errors["torch"]) :] == f" (first gradient with inf/NaN: {offender})"
    # the gradients are left as torch leaves them: unscaled, not clipped (NaN where NaN)
    for k, (gf, gt) in enumerate(zip(runs["fused"].grads(), runs["torch"].grads(), strict=True)):
        _same(gf, gt, f"grad {k}")
    before = _snapshot(runs["fused"])
    _step_all(runs)  # skipped in both
    _assert_runs_equal(runs["torch"], runs["fused"], "after the error")
    for k in range(len(runs["fused"].params)):
        _same(_snapshot(runs["fused"])[f"param {k}"], before[f"param {k}"])


def test_error_if_nonfinite_other_norms_and_finite(device):
    runs = _net_runs(device, watch=True)
    _net_backward(runs, device, {"fc1.bias": INF})
    for run in runs.values():
        run.scaler.unscale_(run.opt)
    with pytest.raises(RuntimeError) as theirs:
        torch.nn.utils.clip_grad_norm_(runs["torch"].params, 1.0, 1.0, error_if_nonfinite=True)
    fused = runs["fused"]
    with pytest.raises(RuntimeError) as ours:  # torch's route: torch's message
        fused.scaler.clip_grad_norm_(fused.opt, 1.0, 1.0, error_if_nonfinite=True)
    assert str(ours.value) == str(theirs.value)
    # finite gradients: no error, the plain clip
    runs = _net_runs(device, watch=False)
    _net_backward(runs, device)
    total = runs["fused"].scaler.clip_grad_norm_(runs["fused"].opt, 0.1, error_if_nonfinite=True)
    assert math.isfinite(float(total)) and float(total) > 0.1


@pytest.mark.parametrize("unscale_first", [False, True], ids=["clip", "unscale_then_clip"])
def test_watch_report_comes_from_the_clip_pass(device, unscale_first):
    runs = _net_runs(device, watch=True)
    del runs["torch"]
    _net_backward(runs, device)
    fused = runs["fused"]
    scaled = [g.clone() for g in fused.grads()]
    inv = reference.inv_scale_of(fused.scaler._scale.clone().cpu())
    if unscale_first:
        fused.scaler.unscale_(fused.opt)
    total = fused.scaler.clip_grad_norm_(fused.opt, 0.1)
    assert float(total) > 0.1  # clipped: post-clip norms would be 0.1
    report = fused.scaler.report()
    assert report is not None
    assert report.total_norm == float(total)  # the same float32 bits, from the same rows
    norms = fused.scaler.grad_norms()
    assert norms["grad_2.0_norm_total"] == float(total)
    # one pass recorded (not the clip's and another), pre-clip: the unscaled gradients' norms
    names = [n for n, _ in Net().named_parameters()]
    assert [g.name for g in report.grads] == names
    rows = reference.grad_stats(scaled, inv, check_only=not unscale_first)
    per_grad, _ = reference.reduce_grad_stats(rows, [g.numel() for g in scaled])
    for g, sum_sq in zip(report.grads, per_grad[:, SUM_SQ].tolist(), strict=True):
        assert g.norm == float(_f32(math.sqrt(sum_sq))), g.name
        assert norms[f"grad_2.0_norm/{g.name}"] == g.norm
    fused.scaler.step(fused.opt)
    fused.scaler.update()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_two_devices_take_torchs_route(norm_type):
    """Gradients on two GPUs: unscale_ + torch's clip (found_inf per device), torch bit for
    bit."""
    shapes = _shapes(norm_type)
    runs = {}
    for name, cls in (("torch", TorchScaler), ("fused", FusedScaler)):
        run = _build(name, cls("cuda", **SCALER_KW), "cuda", "adamw", "fp32", shapes)
        for p in run.params[GROUP_SPLIT:]:
            p.data = p.data.to("cuda:1")
        runs[name] = run
    for i, inject in enumerate([None, "inf", None]):
        _set_grads(runs, i, inject)
        totals = {}
        for name, run in runs.items():
            if name == "torch":
                run.scaler.unscale_(run.opt)
                totals[name] = torch.nn.utils.clip_grad_norm_(run.params, 0.5, norm_type)
            else:
                totals[name] = run.scaler.clip_grad_norm_(run.opt, 0.5, norm_type)
        _same(totals["fused"], totals["torch"])
        _step_all(runs)
        _assert_runs_equal(runs["torch"], runs["fused"], f"iteration {i}")


def test_inf_norm_of_empty_gradients(device):
    """torch's clip_grad_norm_(norm_type=inf) raises on an empty gradient (_foreach_norm has no
    identity for the max): the scaler's clip raises the same error, with the gradients left
    unscaled, as torch's unscale_ + clip_grad_norm_ leaves them."""
    runs = _runs(device, "sgd", "fp32")
    _set_grads(runs, 0)
    assert any(g.numel() == 0 for g in runs["fused"].grads())
    for name in ("fused", "torch"):
        run = runs[name]
        with pytest.raises(RuntimeError, match="infinity norm on an empty tensor"):
            if name == "torch":
                run.scaler.unscale_(run.opt)
                torch.nn.utils.clip_grad_norm_(run.params, 0.05, INF)
            else:
                run.scaler.clip_grad_norm_(run.opt, 0.05, INF)
    for k, (a, b) in enumerate(zip(runs["fused"].grads(), runs["torch"].grads(), strict=True)):
        _same(a, b, f"grad {k}")
