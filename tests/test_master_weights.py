"""float16/bfloat16 models with float32 master weights: the ``unscale_into_`` op,
``ampfused.MasterWeights`` with ``ampfused.GradScaler``, and ``GradScaler(allow_fp16=...)``.

Oracles: :func:`ampfused.reference.unscale_into_` for the op (bytes compared, NaN payloads
included), :func:`ampfused.reference.master_weights_step` (the recipe in plain PyTorch, stepped
by ``torch.amp.GradScaler`` over float32 masters) for the wrapper, torch's own
``GradScaler._unscale_grads_(..., allow_fp16=True)`` for the in-place float16 unscale.  Every
comparison is bit for bit except the convergence test, which states its tolerance.

Sections:
1. the op (values, specials and where they sit, sizes around vector and chunk boundaries,
   layouts, many tensors, found_inf, opcheck, bad inputs);
2. MasterWeights + GradScaler against the recipe (SGD, AdamW, fused Adam; growth and a skipped
   step; bfloat16; float32 parameters mixed in; clipping; no scaler; scaling=False);
3. convergence against autocast with float32 parameters;
4. checkpoints;
5. the optimizer API;
6. the float16 ValueError and allow_fp16.
"""

from __future__ import annotations

import copy
import glob
import inspect
import io
import math
import os
import sys
import warnings

import pytest
import torch
from torch import nn
from torch._prims_common import (
    is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense,
)

import ampfused
from ampfused import ops, reference

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
LOW = (F16, BF16)
INTO_DTYPES = (F16, BF16, F32)
INT_OF = {F16: torch.int16, BF16: torch.int16, F32: torch.int32, F64: torch.int64}
NAN, INF = float("nan"), float("inf")
CHUNK = 65536  # elements per work item (csrc/launch_table.h kChunkSize)
# Float32 sentinel written into every out before a call: a NaN with a payload no conversion
# produces, so an element the op failed to write (or wrote when it must not) shows in the bytes.
SENTINEL_BITS = 0x7FA5A5A5


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The storage bits of t as integers (same shape and strides), so NaN payloads and -0.0
    compare exactly with torch.equal."""
    return t.detach().view(INT_OF[t.dtype])


def assert_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        diff = (a != e).nonzero()
        first = tuple(diff[0].tolist())
        raise AssertionError(
            f"{what}: {diff.shape[0]} elements differ, first at {first}: "
            f"{actual[first].item()!r} (bits {hex(a[first].item())}) vs "
            f"{expected[first].item()!r} (bits {hex(e[first].item())})"
        )


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread unless a test asks for `parallel`: these tests run small models
    where a second OpenMP thread only waits (on a loaded 2-core machine a step took 35x longer
    with two threads than with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def parallel(one_thread):
    """Two intra-op threads, and every CPU pass over 256 KB split across them (by default a
    pass splits where earlier splits paid: csrc/cpu/parallel.h)."""
    torch.set_num_threads(2)
    before = torch.ops.ampfused._cpu_split_config("always", 0, True)
    yield
    torch.ops.ampfused._cpu_split_config(before, 0, True)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Exponent ranges (base 2) of the random finite values, subnormals included; float16 stays
# below its 65504 maximum.
EXPONENTS = {F16: (-26, 15), BF16: (-135, 126), F32: (-150, 126)}


def rand_values(n: int, dtype: torch.dtype, g: torch.Generator, device: str) -> torch.Tensor:
    """n finite values of dtype over its whole exponent range, with -0.0 every 61 elements."""
    lo, hi = EXPONENTS[dtype]
    v = torch.randn(n, generator=g, dtype=F64)
    v = v * torch.exp2(torch.randint(lo, hi, (n,), generator=g, dtype=F64))
    v = v.to(dtype)
    v[torch.isinf(v)] = 1.0
    v[::61] = -0.0
    return v.to(device)


def all_bit_patterns(dtype: torch.dtype, device: str) -> torch.Tensor:
    """Every 16-bit pattern once (65536 elements: exactly one chunk): every float16 or bfloat16
    value, both zeros, subnormals, infinities, quiet and signalling NaNs of every payload."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(device)


def scalar(value: float, device: str, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.full((), value, dtype=dtype, device=device)


def sentinel_like(g: torch.Tensor) -> torch.Tensor:
    """A float32 out for g (its shape and strides), filled with the sentinel NaN."""
    out = torch.empty_like(g, dtype=F32)
    out.view(torch.int32).fill_(SENTINEL_BITS)
    return out


def run_both(grads, inv: float, device: str, found0: float = 0.0, outs=None):
    """The op and the reference on the same inputs; returns (ours, ref) as (outs, found)."""
    before = [bits(g).clone() for g in grads]
    outs = [sentinel_like(g) for g in grads] if outs is None else outs
    ref_outs = [o.clone() for o in outs]
    found, ref_found = scalar(found0, device), scalar(found0, device)
    inv_t = scalar(inv, device)
    ops.unscale_into_(grads, outs, found, inv_t)
    reference.unscale_into_(grads, ref_outs, ref_found, inv_t.clone())
    for i, (g, b) in enumerate(zip(grads, before, strict=True)):
        assert torch.equal(bits(g), b), f"grads[{i}] was written"
    assert inv_t.item() == inv
    return (outs, found), (ref_outs, ref_found)


def f16_nan_widened(h: torch.Tensor) -> torch.Tensor:
    """float32 bits of float16 NaNs (bits h, int32 0..0xFFFF) as the CPU kernel widens them:
    sign and payload kept, the payload moved up 13 bits, the quiet bit set (F16C's rule, which
    the scalar tail follows too)."""
    return ((h >> 15) << 31) | 0x7FC00000 | ((h & 0x3FF) << 13)


def assert_out_matches(o: torch.Tensor, r: torch.Tensor, g: torch.Tensor, what: str) -> None:
    """out o against the reference's r, for gradient g.  Bytes equal everywhere, except at
    float16 NaNs: their payload bits are the converter's (unscale_math.h: F16C and torch's
    copy_ of a short tensor disagree), so there o must be a NaN that the op wrote, and on the
    CPU exactly f16_nan_widened of the input."""
    if g.dtype != F16 or not bool(torch.isnan(g).any()):
        assert_bits(o, r, what)
        return
    nan = torch.isnan(g)
    assert_bits(o[~nan], r[~nan], what)
    assert bool(torch.isnan(r[nan]).all()), what
    got = bits(o)[nan]
    if o.device.type == "cpu":
        expected = f16_nan_widened(bits(g)[nan].to(torch.int32) & 0xFFFF)
        assert torch.equal(got, expected), f"{what}: float16 NaN widened to other bits"
    else:
        assert bool(torch.isnan(o[nan]).all()) and not bool((got == SENTINEL_BITS).any()), what


def assert_matches_reference(grads, inv: float, device: str, found0: float = 0.0) -> float:
    (outs, found), (ref_outs, ref_found) = run_both(grads, inv, device, found0)
    for i, (o, r, g) in enumerate(zip(outs, ref_outs, grads, strict=True)):
        assert_out_matches(o, r, g, f"out[{i}] ({dtype_id(g.dtype)}, numel {g.numel()})")
    assert_bits(found, ref_found, "found_inf")
    return found.item()


# ============================================================================================
# 1. The op: ampfused::unscale_into_

# inv_scale values: 1 (the cast only, no multiply), a power of two (exact unless it underflows),
# 257/512 and 1/65535 (every product rounds), 2**10 (> 1: the largest finite values overflow to
# inf in the output, while found_inf, a test of the input, stays 0).
INVS = (1.0, 2.0**-10, 257 / 512, float(torch.tensor(1 / 65535, dtype=F32)), 2.0**10)
SIZES = (1, 7, 8, 9, 15, 16, 17, 63, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 9)


@pytest.mark.parametrize("inv", INVS, ids=lambda v: f"inv{v:.6g}")
@pytest.mark.parametrize("dtype", INTO_DTYPES, ids=dtype_id)
def test_finite_values_match_reference(parallel, device, dtype, inv):
    g = gen(1)
    grads = [rand_values(n, dtype, g, device) for n in SIZES]
    grads.insert(3, torch.empty(0, dtype=dtype, device=device))
    # The largest finite values and the smallest subnormals, at the ends of a tensor.
    big = grads[-1]
    big[0], big[-1] = torch.finfo(dtype).max, -torch.finfo(dtype).max
    big[1], big[-2] = torch.finfo(dtype).smallest_normal / 4, -torch.finfo(dtype).smallest_normal
    assert assert_matches_reference(grads, inv, device) == 0.0
    if dtype == F32 and inv > 1:  # the overflow happened, and is not what found_inf reports
        (outs, found), _ = run_both([big], inv, device)
        assert outs[0][0].item() == INF and outs[0][-1].item() == -INF and found.item() == 0.0


@pytest.mark.parametrize("inv", (1.0, 2.0**-10, 257 / 512), ids=lambda v: f"inv{v:.6g}")
@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_every_16_bit_pattern(parallel, device, dtype, inv):
    """All 65536 float16 (bfloat16) bit patterns, NaNs of every payload included, for inv 1
    and not 1: the output bytes equal the reference's (torch's copy_ widens, then one float32
    multiply), NaN bytes included except float16 NaNs' (assert_out_matches); on the CPU the
    bytes are also checked against the widening rule written out on the bits."""
    x = all_bit_patterns(dtype, device)
    assert assert_matches_reference([x], inv, device) == 1.0
    if device == "cpu":
        # The rule itself, on the bits, independently of the reference: widening is exact and a
        # NaN keeps its sign and payload (bfloat16: its 16 bits become the high half; float16:
        # f16_nan_widened, quiet bit set); a multiply by inv keeps a NaN's bits on x86.
        (outs, _), _ = run_both([x], inv, device)
        h = bits(x).to(torch.int32) & 0xFFFF
        nan = torch.isnan(x)
        expected = (x.double() * inv).float()  # exact widening, one rounding of the product
        expected = bits(expected).clone()
        if dtype == F16:
            expected[nan] = f16_nan_widened(h)[nan]
        elif inv == 1.0:
            expected[nan] = (h << 16)[nan]  # a bfloat16 NaN widens as is, signalling ones too
        else:
            expected[nan] = (h << 16)[nan] | 0x00400000  # the multiply quiets signalling NaNs
        assert torch.equal(bits(outs[0]), expected)


SPECIALS = {"nan": NAN, "inf": INF, "-inf": -INF}


@pytest.mark.parametrize("n", (9, CHUNK + 9))
@pytest.mark.parametrize("special", list(SPECIALS), ids=str)
@pytest.mark.parametrize("dtype", INTO_DTYPES, ids=dtype_id)
def test_one_special_anywhere(parallel, device, dtype, special, n):
    """One inf/NaN among finite values, at the first, a middle, the last position of the
    vector part, the scalar tail, and on both sides of each chunk boundary; in the first, the
    middle or the last tensor of the list: found_inf becomes 1.0 and the outputs match."""
    positions = {0, n // 2, n - 1, (n // 8) * 8 - 1, (n // 8) * 8}
    positions |= {p for c in range(CHUNK, n, CHUNK) for p in (c - 1, c)}
    g = gen(2)
    clean = [rand_values(m, dtype, g, device) for m in (5, n, 3)]
    for k, pos in enumerate(sorted(positions)):
        grads = [t.clone() for t in clean]
        which = k % 3 if grads[k % 3].numel() > pos else 1
        grads[which][pos] = SPECIALS[special]
        found = assert_matches_reference(grads, (2.0**-10, 1.0)[k % 2], device)
        assert found == 1.0, (pos, which)


def dense_layouts(dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Non-overlapping and dense tensors that are not plain contiguous ones."""
    g = gen(3)

    def r(*shape):
        return rand_values(math.prod(shape), dtype, g, device).view(*shape)

    base = r(CHUNK + 40)
    return {
        "transposed": r(33, 17).t(),
        "permuted": r(3, 5, 7, 4).permute(2, 0, 3, 1),
        "channels_last": r(2, 3, 5, 7).contiguous(memory_format=torch.channels_last),
        "offset": base[13 : 13 + 8 * 3 + 5],
        "offset_past_chunk": base[35:],  # crosses a chunk boundary, misaligned for F16C
        "rows": r(9, 12)[2:7],  # a storage offset of whole rows
        "scalar": r(1).view(()),
    }


@pytest.mark.parametrize("inv", (1.0, 257 / 512), ids=lambda v: f"inv{v:.6g}")
@pytest.mark.parametrize("dtype", INTO_DTYPES, ids=dtype_id)
def test_dense_layouts_and_views(device, dtype, inv):
    layouts = dense_layouts(dtype, device)
    grads = list(layouts.values())
    for name, t in layouts.items():
        assert is_non_overlapping_and_dense(t), name
    layouts["permuted"][2, 1, 3, 0] = NAN
    (outs, found), (ref_outs, ref_found) = run_both(grads, inv, device)
    for name, o, r, gr in zip(layouts, outs, ref_outs, grads, strict=True):
        assert o.stride() == gr.stride(), name
        assert_out_matches(o, r, gr, name)
    assert found.item() == 1.0 == ref_found.item()
    # Element (i, j, ...) of out is element (i, j, ...) of grads, whatever the memory order.
    assert torch.equal(outs[0], grads[0].float() * inv)


def test_out_views_write_only_their_elements(device):
    """Outs that are views into larger float32 buffers (a storage offset, a transpose) are
    written in their elements and nowhere else."""
    g = gen(4)
    grads = [rand_values(37, F16, g, device), rand_values(6 * 11, BF16, g, device).view(6, 11).t()]
    buf = torch.empty(200, dtype=F32, device=device)
    buf.view(torch.int32).fill_(SENTINEL_BITS)
    outs = [buf[3:40], buf[50:116].view(6, 11).t()]
    before = bits(buf).clone()
    ref_outs = [torch.empty_like(o).copy_(o) for o in outs]
    found = scalar(0.0, device)
    ops.unscale_into_(grads, outs, found, scalar(2.0**-3, device))
    reference.unscale_into_(grads, ref_outs, scalar(0.0, device), scalar(2.0**-3, device))
    for o, r in zip(outs, ref_outs, strict=True):
        assert_bits(o, r)
    untouched = torch.ones(200, dtype=torch.bool, device=device)
    untouched[3:40] = False
    untouched[50:116] = False
    assert torch.equal(bits(buf)[untouched], before[untouched])


def test_zero_sized_and_empty_lists(device):
    found = scalar(0.0, device)
    inv = scalar(0.5, device)
    ops.unscale_into_([], [], found, inv)
    assert found.item() == 0.0
    grads = [torch.empty(0, dtype=dt, device=device) for dt in INTO_DTYPES]
    grads.append(torch.empty(3, 0, 5, dtype=F16, device=device))
    ops.unscale_into_(grads, [torch.empty_like(x, dtype=F32) for x in grads], found, inv)
    assert found.item() == 0.0
    ops.unscale_into_(
        grads, [torch.empty_like(x, dtype=F32) for x in grads], scalar(1.0, device), inv
    )


def test_many_tensors(parallel, device):
    """More work items than one CUDA launch carries (1024): 1100 small tensors plus a few
    multi-chunk ones, dtypes interleaved; an inf only in a tensor past the first launch."""
    g = gen(5)
    sizes = [1 + (i * 37) % 300 for i in range(1100)] + [3 * CHUNK + 5, CHUNK]
    grads = [rand_values(n, INTO_DTYPES[i % 3], g, device) for i, n in enumerate(sizes)]
    assert assert_matches_reference(grads, 2.0**-10, device) == 0.0
    grads[1090][-1] = INF
    assert assert_matches_reference(grads, 2.0**-10, device) == 1.0
    grads[1090][-1] = 1.0
    grads[-2][2 * CHUNK + 1] = NAN  # the last launch's items
    assert assert_matches_reference(grads, 1.0, device) == 1.0


@pytest.mark.parametrize("n", (9, 3 * CHUNK + 1))
def test_found_inf_is_set_never_cleared(parallel, device, n):
    """found_inf: 1.0 after inf/NaN, otherwise left as it was (the caller zeroes it)."""
    g = gen(6)
    finite = [rand_values(n, F16, g, device), rand_values(n, BF16, g, device)]
    for start in (0.0, 1.0, 0.25):
        (_, found), _ = run_both(finite, 0.5, device, found0=start)
        assert found.item() == start
    bad = [t.clone() for t in finite]
    bad[1][n // 2] = -INF
    for start in (0.0, 1.0, 0.25):
        (_, found), _ = run_both(bad, 0.5, device, found0=start)
        assert found.item() == 1.0


def opcheck_cases(device: str) -> dict[str, tuple]:
    def case(with_inf: bool, inv: float):
        g = gen(7)
        grads = [rand_values(n, dt, g, device) for n, dt in ((5, F16), (12, BF16), (9, F32))]
        grads.append(rand_values(24, F16, g, device).view(4, 6).t())
        grads.append(torch.empty(0, dtype=BF16, device=device))
        if with_inf:
            grads[1][3] = INF
        outs = [torch.empty_like(x, dtype=F32) for x in grads]
        return (grads, outs, scalar(0.0, device), scalar(inv, device))

    return {
        "finite": case(False, 2.0**-7),
        "inf": case(True, 2.0**-7),
        "inv_one": case(False, 1.0),
        "empty": ([], [], scalar(0.0, device), scalar(1.0, device)),
    }


@pytest.mark.parametrize("case", list(opcheck_cases("cpu")))
def test_opcheck(device, case):
    result = torch.library.opcheck(
        torch.ops.ampfused.unscale_into_.default, opcheck_cases(device)[case]
    )
    assert result and all(v == "SUCCESS" for v in result.values()), result


def bad_input_cases(device: str) -> dict[str, tuple]:
    """name -> (grads, outs, found_inf, inv_scale, exception type, message pattern).  The bad
    tensor is the last one of a list whose first gradient holds an inf, so a call that wrote
    before checking shows in found_inf or in the outs."""

    def good():
        g = rand_values(10, F16, gen(8), device)
        g[4] = INF
        return g, sentinel_like(g)

    def case(bad_g, bad_o, exc, match, found=None, inv=None, n_out=None):
        g0, o0 = good()
        grads, outs = [g0, bad_g], [o0, bad_o]
        if n_out is not None:
            outs = outs[:n_out]
        found = scalar(0.0, device) if found is None else found
        inv = scalar(0.5, device) if inv is None else inv
        return grads, outs, found, inv, exc, match

    f16 = torch.ones(6, dtype=F16, device=device)
    t = torch.ones(4, 6, dtype=F16, device=device).t()
    strided = torch.ones(12, dtype=F16, device=device)[::2]
    expanded = torch.ones(1, dtype=F16, device=device).expand(5)
    storage = torch.zeros(6, dtype=F32, device=device)
    sparse = torch.ones(3, dtype=F16, device=device).to_sparse()
    return {
        "length": case(f16, None, RuntimeError, r"out has 1 tensors but grads has 2", n_out=1),
        "out_float16": case(
            f16,
            torch.empty(6, dtype=F16, device=device),
            NotImplementedError,
            r"out\[1\] has dtype",
        ),
        "out_float64": case(
            f16,
            torch.empty(6, dtype=F64, device=device),
            NotImplementedError,
            r"out\[1\] has dtype",
        ),
        "grads_float64": case(
            torch.ones(6, dtype=F64, device=device),
            torch.empty(6, dtype=F32, device=device),
            NotImplementedError,
            r"grads\[1\] has dtype Double",
        ),
        "grads_int": case(
            torch.ones(6, dtype=torch.int32, device=device),
            torch.empty(6, dtype=F32, device=device),
            NotImplementedError,
            r"grads\[1\] has dtype Int",
        ),
        "shape": case(
            f16,
            torch.empty(2, 3, dtype=F32, device=device),
            RuntimeError,
            r"out\[1\] must have the shape of grads\[1\]",
        ),
        "strides": case(
            t,
            torch.empty(6, 4, dtype=F32, device=device),
            RuntimeError,
            r"out\[1\] must have the strides of grads\[1\]",
        ),
        "gaps": case(
            strided,
            torch.empty_strided((6,), (2,), dtype=F32, device=device),
            RuntimeError,
            r"grads\[1\] has gaps or overlapping elements",
        ),
        "overlapping": case(
            expanded,
            torch.empty(1, dtype=F32, device=device).expand(5),
            RuntimeError,
            r"grads\[1\] has gaps or overlapping elements",
        ),
        "sparse": case(
            sparse,
            torch.empty(3, dtype=F32, device=device).to_sparse(),
            NotImplementedError,
            r"grads\[1\] and out\[1\] must be dense",
        ),
        "alias_float32": (
            lambda g: case(g, g, RuntimeError, r"out\[1\] shares memory with grads\[1\]")
        )(torch.ones(6, dtype=F32, device=device)),
        "alias_float16_view": case(
            storage.view(F16)[:6],
            storage,
            RuntimeError,
            r"out\[1\] shares memory with grads\[1\]",
        ),
        "grads_none": case(
            None, torch.empty(6, dtype=F32, device=device), TypeError, r"grads\[1\]"
        ),
        "out_none": case(f16, None, TypeError, r"out\[1\]"),
        "found_inf_float64": case(
            f16,
            torch.empty(6, dtype=F32, device=device),
            RuntimeError,
            r"found_inf must be a Float tensor",
            found=scalar(0.0, device, F64),
        ),
        "found_inf_two_elements": case(
            f16,
            torch.empty(6, dtype=F32, device=device),
            RuntimeError,
            r"found_inf must have exactly one element",
            found=torch.zeros(2, device=device),
        ),
        "inv_scale_float16": case(
            f16,
            torch.empty(6, dtype=F32, device=device),
            RuntimeError,
            r"inv_scale must be a Float tensor",
            inv=scalar(0.5, device, F16),
        ),
        "inv_scale_float64": case(
            f16,
            torch.empty(6, dtype=F32, device=device),
            RuntimeError,
            r"inv_scale must be a Float tensor",
            inv=scalar(0.5, device, F64),
        ),
    }


def _bad_case_params():
    return [
        pytest.param(name, marks=c.marks) if isinstance(c, type(pytest.param(0))) else name
        for name, c in bad_input_cases("cpu").items()
    ]


@pytest.mark.parametrize("name", _bad_case_params())
def test_bad_inputs(device, name):
    """Each bad input raises the documented type with a message naming the argument, and the
    rejected call writes nothing: outs, found_inf, grads and inv_scale keep their bytes."""
    c = bad_input_cases(device)[name]
    grads, outs, found, inv, exc, match = c.values[0] if hasattr(c, "values") else c
    tensors = [
        t for t in [*grads, *outs, found, inv] if t is not None and t.layout == torch.strided
    ]
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        ops.unscale_into_(grads, outs, found, inv)
    for t, b in zip(tensors, before, strict=True):
        if t.dtype in INT_OF:
            assert torch.equal(bits(t), bits(b))
        else:
            assert torch.equal(t, b)


def test_sparse_grad_refused_with_torchs_type(device):
    g = torch.ones(3, dtype=F16, device=device).to_sparse()
    found = scalar(0.0, device)
    with pytest.raises(NotImplementedError):
        ops.unscale_into_([g], [torch.empty(3, dtype=F32, device=device)], found, found.clone())
    assert found.item() == 0.0


@pytest.mark.cuda
def test_bad_inputs_devices():
    """Tensors of two devices in one call: RuntimeError naming the argument, nothing written."""
    g = torch.ones(4, dtype=F16, device="cuda")
    out = sentinel_like(g)
    found = scalar(0.0, "cuda")
    with pytest.raises(RuntimeError, match=r"grads\[0\] is on cpu and out\[0\] on cuda"):
        ops.unscale_into_([g.cpu()], [out], found, scalar(1.0, "cuda"))
    with pytest.raises(RuntimeError, match=r"inv_scale is on cpu"):
        ops.unscale_into_([g], [out], found, scalar(1.0, "cpu"))
    assert int(bits(out)[0]) == SENTINEL_BITS and found.item() == 0.0


# ============================================================================================
# 2. MasterWeights + ampfused.GradScaler against the recipe (reference.master_weights_step)

SCALER_KW = {"init_scale": 2.0**12, "growth_interval": 2}
STEPS = 8
INF_STEP = 2  # an inf gradient: a skipped step and a back-off, between growths
OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
}


class Net(nn.Module):
    """A small MLP; with mixed=True a float32 gain stays float32 when the rest is cast."""

    def __init__(self, mixed: bool = False, hidden: int = 16) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, hidden)
        self.l2 = nn.Linear(hidden, 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 3)) if mixed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.l2(torch.tanh(self.l1(x))).float()
        return y * self.gain if self.gain is not None else y


def make_net(
    dtype: torch.dtype, device: str, mixed: bool = False, seed: int = 0, hidden: int = 16
) -> Net:
    torch.manual_seed(seed)
    net = Net(mixed, hidden)
    net.l1.to(device=device, dtype=dtype)
    net.l2.to(device=device, dtype=dtype)
    return net.to(device)


def batch(i: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(100 + i)
    x = torch.randn(32, 6, generator=g).to(device=device, dtype=dtype)
    y = torch.randn(32, 3, generator=g).to(device)
    return x, y


def loss_of(net: Net, i: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    x, y = batch(i, dtype, device)
    return (net(x) - y).pow(2).mean()


def backward(net: Net, scaler, i: int, dtype: torch.dtype, device: str) -> None:
    loss = loss_of(net, i, dtype, device)
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if i == INF_STEP:
        with torch.no_grad():
            net.l2.weight.grad[1, 3] = INF


def twin(net: Net) -> tuple[Net, list[torch.Tensor], list[torch.Tensor]]:
    """A copy of net and float32 masters of its low-precision parameters (the recipe's)."""
    ref = copy.deepcopy(net)
    params = list(ref.parameters())
    masters = [
        p.detach().float().requires_grad_(p.requires_grad) if p.dtype in LOW else p for p in params
    ]
    return ref, params, masters


def assert_same_value(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), what
        if a.dtype in INT_OF:
            assert_bits(a, b, what)
        else:
            assert torch.equal(a, b), what
    else:
        assert a == b, (what, a, b)


def assert_optimizer_state(opt, masters, opt_ref, masters_ref) -> None:
    for i, (m, mr) in enumerate(zip(masters, masters_ref, strict=True)):
        st, st_ref = opt.state.get(m, {}), opt_ref.state.get(mr, {})
        assert st.keys() == st_ref.keys(), (i, st.keys(), st_ref.keys())
        for k in st:
            assert_same_value(st[k], st_ref[k], f"state[{i}][{k!r}]")


def assert_same_training(net, opt, scaler, ref, masters_ref, opt_ref, scaler_ref, where) -> None:
    for i, (p, pr) in enumerate(zip(net.parameters(), ref.parameters(), strict=True)):
        assert_bits(p, pr, f"{where}: param {i}")
    for i, (m, mr) in enumerate(zip(opt.master_params, masters_ref, strict=True)):
        assert m.dtype == F32
        assert_bits(m, mr, f"{where}: master {i}")
    assert_optimizer_state(opt, opt.master_params, opt_ref, masters_ref)
    if scaler is not None:
        assert_bits(scaler._scale, scaler_ref._scale, f"{where}: scale")
        assert scaler._get_growth_tracker() == scaler_ref._get_growth_tracker(), where


def snapshot(net, opt) -> list[torch.Tensor]:
    tensors = [*net.parameters(), *opt.master_params]
    for m in opt.master_params:
        tensors += [v for v in opt.state.get(m, {}).values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in tensors]


def assert_snapshot(before: list[torch.Tensor], net, opt, where: str) -> None:
    after = snapshot(net, opt)
    assert len(before) == len(after), where
    for i, (a, b) in enumerate(zip(after, before, strict=True)):
        assert_bits(a, b, f"{where}: tensor {i} changed")


@pytest.mark.parametrize("mixed", (False, True), ids=("low", "mixed"))
@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_matches_recipe_with_torch_scaler(device, opt_name, dtype, mixed):
    """8 steps with growth and one inf: ampfused.MasterWeights + ampfused.GradScaler equal the
    recipe stepped by torch.amp.GradScaler over float32 masters, bit for bit: the model's
    parameters, the masters, the optimizer state, the scale and the growth tracker.  The inf
    step leaves parameters, masters and optimizer state as they were."""
    build = OPTIMIZERS[opt_name]
    net = make_net(dtype, device, mixed)
    ref, params_ref, masters_ref = twin(net)
    opt = ampfused.MasterWeights(build(net.parameters()))
    opt_ref = build(masters_ref)
    scaler = ampfused.GradScaler(device, **SCALER_KW)
    scaler_ref = torch.amp.GradScaler(device, **SCALER_KW)
    scales = []
    for i in range(STEPS):
        backward(net, scaler, i, dtype, device)
        backward(ref, scaler_ref, i, dtype, device)
        before = snapshot(net, opt)
        scaler.step(opt)
        reference.master_weights_step(scaler_ref, opt_ref, params_ref, masters_ref)
        if i == INF_STEP:
            assert_snapshot(before, net, opt, "the inf step")
        scaler.update()
        scaler_ref.update()
        assert_same_training(net, opt, scaler, ref, masters_ref, opt_ref, scaler_ref, f"step {i}")
        scales.append(scaler.get_scale())
        opt.zero_grad()
        opt_ref.zero_grad()
        ref.zero_grad()
    # The run saw growth, the back-off, and the parameters moved.
    assert scales[1] > scales[0] and scales[INF_STEP] < scales[INF_STEP - 1], scales
    assert not torch.equal(net.l1.weight, make_net(dtype, device, mixed).l1.weight)
    if mixed:  # the float32 parameter is its own master, stepped in place
        assert opt.master_params[0] is net.gain and net.gain.dtype == F32
        assert not torch.equal(net.gain, torch.linspace(0.5, 1.5, 3, device=device))


def _python_walk(monkeypatch) -> None:
    """MasterWeights takes its Python walk (the one that allocates and explains) every step."""
    monkeypatch.setattr(ampfused.master_weights._C, "masters_pass", lambda *args: None)


@pytest.mark.parametrize("set_to_none", (True, False), ids=("set_to_none", "zeroed"))
@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_walk_in_cpp_equals_python_walk(device, dtype, set_to_none, monkeypatch):
    """The scaler's pass into the masters (csrc/master_gather.cpp) leaves what the Python walk
    leaves, bit for bit, over steps with growth, an inf step, a parameter without a gradient
    (frozen) and a float32 parameter that is its own master; and it is the one taken."""
    nets = [make_net(dtype, device, mixed=True) for _ in range(2)]
    opts = [ampfused.MasterWeights(OPTIMIZERS["adamw"](net.parameters())) for net in nets]
    scalers = [ampfused.GradScaler(device, **SCALER_KW) for _ in nets]
    real = ampfused.master_weights._C.masters_pass
    taken = []

    def spy(*args):
        found = real(*args)
        taken.append(found is not None)
        return found

    for i in range(STEPS):
        found = []
        for k, (net, opt, scaler) in enumerate(zip(nets, opts, scalers, strict=True)):
            net.l1.bias.requires_grad_(i < 3)  # no gradient from step 3 on
            with monkeypatch.context() as m:
                if k == 0:
                    m.setattr(ampfused.master_weights._C, "masters_pass", spy)
                else:
                    _python_walk(m)
                backward(net, scaler, i, dtype, device)
                scaler.unscale_(opt)
                found.append([f.item() for f in scaler._found_infs()])
                scaler.step(opt)
                scaler.update()
        assert found[0] == found[1] == [float(i == INF_STEP)], (i, found)
        a, b = opts
        assert a._cast_from.keys() == b._cast_from.keys(), i
        for key in a._cast_from:
            ga, va, oa, ma = a._cast_from[key]
            gb, vb, ob, mb = b._cast_from[key]
            assert (va, ma) == (vb, mb) and ga is a.model_params[key].grad, (i, key)
            assert oa is a.master_params[key].grad, (i, key)
        for ma_, mb_ in zip(a.master_params, b.master_params, strict=True):
            assert (ma_.grad is None) == (mb_.grad is None), i
            if ma_.grad is not None:
                assert_bits(ma_.grad, mb_.grad, f"step {i}: a master's gradient")
        assert_same_training(
            *nets[:1], a, scalers[0], nets[1], b.master_params, b, scalers[1], f"step {i}"
        )
        for opt in opts:
            opt.zero_grad(set_to_none)
    # (Under a torch function mode, e.g. --device-audit's, both runs take the Python walk.)
    assert taken and (all(taken) or torch._C._is_torch_function_mode_enabled()), taken


@pytest.mark.parametrize("case", ("conv1_channels_last", "conv_channels_last", "linear_t"))
def test_walk_in_cpp_with_any_strides(device, case, monkeypatch):
    """Gradients whose strides are not the contiguous ones get masters' gradients of the same
    strides, in the C++ walk as in the Python one, with the same training bit for bit: a
    channels_last Conv2d with one input channel (contiguous, with a size-1 dimension's stride
    of its own), one with four (dense, not contiguous), a transposed Linear weight."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        if case == "linear_t":
            m = nn.Linear(4, 1).to(device=device, dtype=BF16)
            m.weight = nn.Parameter(torch.randn(4, 1, dtype=BF16, device=device).t())
            assert m.weight.stride() == (1, 1)
            return m
        m = nn.Conv2d(1 if case == "conv1_channels_last" else 4, 2, 3)
        return m.to(device=device, dtype=BF16, memory_format=torch.channels_last)

    shape = {"linear_t": (3, 4), "conv1_channels_last": (2, 1, 7, 7)}.get(case, (2, 4, 7, 7))
    x = torch.randn(shape).to(device=device, dtype=BF16)
    runs = []
    for python_walk in (False, True):
        net = build()
        opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        scaler = ampfused.GradScaler(device, init_scale=2.0**8)
        with monkeypatch.context() as m:
            if python_walk:
                _python_walk(m)
            for _ in range(3):
                scaler.scale(net(x).float().square().sum()).backward()
                scaler.step(opt)
                scaler.update()
                for p, mp in zip(opt.model_params, opt.master_params, strict=True):
                    if mp is not p:
                        assert mp.grad.stride() == p.grad.stride()
                opt.zero_grad()
        runs.append([p.detach().clone() for p in (*net.parameters(), *opt.master_params)])
    for a, b in zip(*runs, strict=True):
        assert_bits(a, b, case)


def test_walk_under_a_torch_function_mode_is_python():
    """A torch function mode sees the pass's op: the C++ walk, which calls it below Python,
    steps aside for the Python walk while a mode is set."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    p = nn.Parameter(torch.ones(4, dtype=BF16))
    opt = ampfused.MasterWeights(torch.optim.SGD([p], lr=0.1))
    scaler = ampfused.GradScaler("cpu", init_scale=4.0)
    p.grad = torch.full((4,), 8.0, dtype=BF16)
    scaler.scale(torch.ones(()))
    with Record():
        scaler.unscale_(opt)
    assert "ampfused.unscale_into_" in seen
    assert torch.equal(opt.master_params[0].grad, torch.full((4,), 2.0))


def _count_master_lines(n_params: int) -> int:
    """Python lines executed in ampfused's package during a scaler's unscale_ + step + update
    of a MasterWeights over n_params float16 parameters, after zero_grad and a backward."""
    params = [torch.ones(2, dtype=F16, requires_grad=True) for _ in range(n_params)]
    opt = ampfused.MasterWeights(torch.optim.SGD(params, lr=0.0))
    scaler = ampfused.GradScaler("cpu", init_scale=4.0)
    package = os.path.dirname(ampfused.__file__)
    files = set(glob.glob(os.path.join(package, "*.py")))
    count = 0

    def local(frame, event, arg):
        nonlocal count
        count += event == "line"
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in files else None

    for traced in (False, True):  # the first step allocates the masters' gradients
        opt.zero_grad()
        for p in params:
            p.grad = torch.full((2,), 8.0, dtype=F16)
        scaler.scale(torch.ones(()))
        old = sys.gettrace()
        if traced:
            sys.settrace(tracer)
        try:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        finally:
            sys.settrace(old)
    assert opt.master_params[-1].grad[0].item() == 2.0  # unscaled into the master
    return count


def test_no_per_parameter_python_in_a_step():
    """The pass into the masters, step()'s checks of the model's gradients and versions, and
    the copy back cost no Python line per parameter."""
    few, many = 20, 2000
    _count_master_lines(few)  # warms per-function caches
    assert _count_master_lines(few) == _count_master_lines(many)


@pytest.mark.parametrize("unscale_first", (False, True), ids=("clip", "unscale_then_clip"))
@pytest.mark.parametrize("opt_name", ("adamw", "adam_fused"))
def test_clip_grad_norm_matches_recipe(device, opt_name, unscale_first):
    """scaler.clip_grad_norm_ through MasterWeights clips the masters' float32 gradients: the
    same bits as the recipe with an ampfused.GradScaler on the float32 twin making the same
    calls before its step (the returned total norms included)."""
    build = OPTIMIZERS[opt_name]
    max_norm = 0.05  # below the gradients' norms: every finite step clips
    # Wide enough that a norm reduced in another order (torch's clip_grad_norm_) differs.
    net = make_net(F16, device, mixed=True, hidden=1024)
    ref, params_ref, masters_ref = twin(net)
    opt = ampfused.MasterWeights(build(net.parameters()))
    opt_ref = build(masters_ref)
    scaler = ampfused.GradScaler(device, **SCALER_KW)
    scaler_ref = ampfused.GradScaler(device, **SCALER_KW)

    def clip(s, o):
        if unscale_first:
            s.unscale_(o)
        return s.clip_grad_norm_(o, max_norm)

    for i in range(6):
        backward(net, scaler, i, F16, device)
        backward(ref, scaler_ref, i, F16, device)
        total = clip(scaler, opt)
        totals_ref = []
        scaler.step(opt)
        reference.master_weights_step(
            scaler_ref,
            opt_ref,
            params_ref,
            masters_ref,
            before_step=lambda totals=totals_ref: totals.append(clip(scaler_ref, opt_ref)),
        )
        assert_bits(total, totals_ref[0], f"step {i}: total norm")
        if i != INF_STEP:
            assert total.item() > max_norm
        scaler.update()
        scaler_ref.update()
        assert_same_training(net, opt, scaler, ref, masters_ref, opt_ref, scaler_ref, f"step {i}")
        opt.zero_grad()
        opt_ref.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_without_scaler(device, dtype):
    """No scaler: MasterWeights.step casts the gradients itself (unscaled, unchecked), as the
    recipe does with a disabled torch scaler."""
    net = make_net(dtype, device, mixed=True)
    ref, params_ref, masters_ref = twin(net)
    opt = ampfused.MasterWeights(OPTIMIZERS["adamw"](net.parameters()))
    opt_ref = OPTIMIZERS["adamw"](masters_ref)
    off = torch.amp.GradScaler(device, enabled=False)
    for i in range(4):
        loss_of(net, i, dtype, device).backward()
        loss_of(ref, i, dtype, device).backward()
        opt.step()
        reference.master_weights_step(off, opt_ref, params_ref, masters_ref)
        assert_same_training(net, opt, None, ref, masters_ref, opt_ref, None, f"step {i}")
        opt.zero_grad()
        opt_ref.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize("opt_name", ("adamw", "adam_fused"))
def test_scaling_false(device, opt_name):
    """GradScaler(scaling=False): the gradients are cast (scale 1), checked, and the inf step
    skipped; the same bits as the recipe with GradScaler(scaling=False) on the float32 twin."""
    build = OPTIMIZERS[opt_name]
    net = make_net(BF16, device)
    ref, params_ref, masters_ref = twin(net)
    opt = ampfused.MasterWeights(build(net.parameters()))
    opt_ref = build(masters_ref)
    scaler = ampfused.GradScaler(device, scaling=False)
    scaler_ref = ampfused.GradScaler(device, scaling=False)
    for i in range(4):
        backward(net, scaler, i, BF16, device)
        backward(ref, scaler_ref, i, BF16, device)
        before = snapshot(net, opt)
        scaler.step(opt)
        reference.master_weights_step(scaler_ref, opt_ref, params_ref, masters_ref)
        if i == INF_STEP:
            assert_snapshot(before, net, opt, "the inf step")
        scaler.update()
        scaler_ref.update()
        assert scaler.get_scale() == 1.0
        assert_same_training(net, opt, scaler, ref, masters_ref, opt_ref, scaler_ref, f"step {i}")
        opt.zero_grad()
        opt_ref.zero_grad()
        ref.zero_grad()


# ============================================================================================
# 3. Convergence: float16 parameters with masters vs float32 parameters under autocast


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = gen(0)
    x = torch.randn(64, 8, generator=g)
    w = torch.randn(8, 1, generator=g) / 2
    return x, torch.sin(x @ w * 2) + 0.3 * x[:, :1] ** 2


def train_regression(kind: str, steps: int, lr: float, momentum: float) -> torch.Tensor:
    """Losses of a 2-layer MLP trained with loss scaling, by kind: "masters" (model.half(),
    MasterWeights), "autocast" (float32 parameters, float16 autocast), "fp16" (model.half(),
    the optimizer stepping float16 parameters, GradScaler(allow_fp16=True))."""
    x, y = regression_data()
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if kind != "autocast":
        net.half()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    if kind == "masters":
        opt = ampfused.MasterWeights(opt)
    scaler = ampfused.GradScaler("cpu", allow_fp16=kind == "fp16")
    losses = []
    for _ in range(steps):
        if kind == "autocast":
            with torch.autocast("cpu", dtype=F16):
                out = net(x)
        else:
            out = net(x.half())
        loss = (out.float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_converges_like_autocast():
    """200 steps of SGD with momentum: the float16 model with float32 masters tracks the
    float32 model under float16 autocast.  Both run the forward pass in float16 on the same
    float16-rounded weights (autocast rounds the float32 weights as the copy-back does), so they
    differ only by float16 kernels' rounding of activations and gradients: measured at most
    0.3% apart on any step and 0.03% on the last 20.  Allowed: 3% per step, 1% at the end.
    A broken path is far outside (masters not copied back: the loss stays near its start)."""
    masters = train_regression("masters", 200, lr=0.02, momentum=0.9)
    autocast = train_regression("autocast", 200, lr=0.02, momentum=0.9)
    assert masters[-20:].mean() < 0.05 * masters[0]  # it trained
    rel = (masters - autocast).abs() / autocast
    assert rel.max() < 0.03, rel.max()
    assert abs(masters[-20:].mean() / autocast[-20:].mean() - 1) < 0.01


def test_pure_float16_stalls_where_masters_do_not():
    """With a small learning rate most SGD updates are below half a float16 ulp of the weights,
    so a float16 optimizer loses them (GradScaler(allow_fp16=True)'s documented risk) while the
    masters accumulate them: measured, the float16 run keeps 1.4% more loss after 200 steps and
    makes 25% less progress.  Asserted: 0.5% more loss, 10% less progress."""
    masters = train_regression("masters", 200, lr=2e-4, momentum=0.0)
    fp16 = train_regression("fp16", 200, lr=2e-4, momentum=0.0)
    assert masters[0] == fp16[0]
    assert fp16[-1] > 1.005 * masters[-1], (fp16[-1], masters[-1])
    assert (fp16[0] - fp16[-1]) < 0.9 * (masters[0] - masters[-1])


# ============================================================================================
# 4. Checkpoints


def train_steps(net, opt, scaler, steps, dtype: torch.dtype, device: str) -> None:
    for i in steps:
        backward(net, scaler, i, dtype, device)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def setup(device: str, seed: int = 0, dtype: torch.dtype = F16, mixed: bool = True):
    net = make_net(dtype, device, mixed=mixed, seed=seed)
    opt = ampfused.MasterWeights(OPTIMIZERS["adamw"](net.parameters()))
    return net, opt, ampfused.GradScaler(device, **SCALER_KW)


def saved(*objs) -> list[dict]:
    buf = io.BytesIO()
    torch.save([o.state_dict() for o in objs], buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_checkpoint_round_trip(device):
    """Train 3 steps, save model, MasterWeights and scaler state dicts, train 5 more (the inf
    step among them); a fresh model (other initial weights), wrapper and scaler loaded from the
    checkpoint and trained the same 5 steps end bit-identical: parameters, masters, optimizer
    state, scale and growth tracker."""
    net, opt, scaler = setup(device)
    train_steps(net, opt, scaler, range(3), F16, device)
    model_sd, opt_sd, scaler_sd = saved(net, opt, scaler)
    assert set(opt_sd["master_weights"]) == {1, 2, 3, 4}  # gain (index 0) is float32
    assert all(m.dtype == F32 for m in opt_sd["master_weights"].values())
    train_steps(net, opt, scaler, range(3, 8), F16, device)

    net2, opt2, scaler2 = setup(device, seed=5)
    net2.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    scaler2.load_state_dict(scaler_sd)
    train_steps(net2, opt2, scaler2, range(3, 8), F16, device)
    assert_same_training(net2, opt2, scaler2, net, opt.master_params, opt, scaler, "resumed")


def test_masters_are_saved_not_rederived(device):
    """The saved masters carry the bits the float16 parameters lost: loading them (and not
    re-widening the parameters) is what makes the resumed run exact."""
    net, opt, scaler = setup(device)
    train_steps(net, opt, scaler, range(3), F16, device)
    (opt_sd,) = saved(opt)
    lost = [m for m in opt.master_params if m.dtype == F32 and m is not net.gain]
    assert any(not torch.equal(m, m.half().float()) for m in lost)
    net2, opt2, _ = setup(device, seed=5)
    opt2.load_state_dict(opt_sd)
    for m, m2 in zip(opt.master_params, opt2.master_params, strict=True):
        if m is not net.gain:
            assert_bits(m2, m)
    # ... and the model's parameters were set from them (rounded), gain through its state.
    for p, m in zip(net2.parameters(), opt2.master_params, strict=True):
        if p is not net2.gain:
            assert_bits(p, m.to(p.dtype))


def test_load_plain_optimizer_state_dict(device):
    """A state dict without masters (saved from the plain optimizer, or with the masters left
    out) loads: the wrapped optimizer takes the state, the masters come from the model's
    current parameters."""
    net, opt, scaler = setup(device)
    train_steps(net, opt, scaler, range(2), F16, device)
    (opt_sd,) = saved(opt)
    del opt_sd["master_weights"]
    net2, opt2, _ = setup(device, seed=5)
    opt2.load_state_dict(opt_sd)
    for p, m in zip(net2.parameters(), opt2.master_params, strict=True):
        assert_bits(m, p.detach().float() if p.dtype in LOW else p)
    assert_optimizer_state(opt2, opt2.master_params, opt, opt.master_params)

    # A plain AdamW that stepped the float16 parameters: its float16 state is cast to the
    # masters' float32 by the optimizer's own loading rule.
    net3 = make_net(F16, device)
    plain = torch.optim.AdamW(net3.parameters(), lr=1e-2)
    loss_of(net3, 0, F16, device).backward()
    plain.step()
    (plain_sd,) = saved(plain)
    net4, opt4, _ = setup(device, seed=5, mixed=False)
    net4.load_state_dict(net3.state_dict())
    opt4.load_state_dict(plain_sd)
    for p, m, p3 in zip(net4.parameters(), opt4.master_params, net3.parameters(), strict=True):
        assert_bits(m, p3.detach().float())
        st, st3 = opt4.state[m], plain.state[p3]
        assert st["exp_avg"].dtype == F32 and torch.equal(st["exp_avg"], st3["exp_avg"].float())
        assert_bits(p, p3)


def test_load_mismatched_masters_raises(device):
    net, opt, scaler = setup(device)
    train_steps(net, opt, scaler, range(2), F16, device)
    (opt_sd,) = saved(opt)
    _, fresh, _ = setup(device, seed=5)
    before = snapshot(*fresh_pair(fresh))

    other = dict(opt_sd, master_weights=dict(opt_sd["master_weights"]))
    other["master_weights"][0] = other["master_weights"].pop(1)  # another parameter's index
    with pytest.raises(ValueError, match=r"holds masters for parameters \[0, 2, 3, 4\]"):
        fresh.load_state_dict(other)
    shaped = dict(opt_sd, master_weights=dict(opt_sd["master_weights"]))
    shaped["master_weights"][2] = torch.zeros(3, 3, device=device)
    with pytest.raises(ValueError, match=r"loaded master 2 has shape \(3, 3\)"):
        fresh.load_state_dict(shaped)
    # a checkpoint of a model made low precision differently (the gain float16 too)
    all_low = dict(opt_sd, master_weights={**opt_sd["master_weights"], 0: torch.zeros(3)})
    with pytest.raises(ValueError, match=r"MasterWeights keeps masters for \[1, 2, 3, 4\]"):
        fresh.load_state_dict(all_low)
    assert_snapshot(before, *fresh_pair(fresh), "a refused load")


def fresh_pair(opt):
    """(a stand-in module holding opt's model parameters, opt) for snapshot()."""
    holder = nn.Module()
    for i, p in enumerate(opt.model_params):
        holder.register_parameter(f"p{i}", p)
    return holder, opt


# ============================================================================================
# 5. The optimizer API


def test_is_an_optimizer_with_the_wrapped_groups(device):
    net = make_net(F16, device, mixed=True)
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    opt = ampfused.MasterWeights(inner)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults
    assert opt.model_params == list(net.parameters())
    for p, m, in_group in zip(
        net.parameters(), opt.master_params, inner.param_groups[0]["params"], strict=True
    ):
        assert m is in_group
        if p.dtype == F16:
            assert m.dtype == F32 and m.shape == p.shape and torch.equal(m, p.float())
            assert m.requires_grad and m is not p
        else:
            assert m is p
    assert repr(opt) == f"MasterWeights({inner!r})"
    assert repr(opt).startswith("MasterWeights(SGD (")


def test_lr_scheduler_drives_the_lr(device):
    """StepLR on the wrapper changes the wrapped optimizer's lr, and the masters move by it:
    plain SGD's update, master - lr * grad, computed here from the master's float32 gradient."""
    net = make_net(F16, device)
    # foreach=False: SGD's update is then param.add_(grad, alpha=-lr), the expression below.
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1, foreach=False))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = ampfused.GradScaler(device, init_scale=2.0**8, growth_interval=1000)
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        for i in range(5):
            backward(net, scaler, i + 10, F16, device)
            before = [m.detach().clone() for m in opt.master_params]
            lr = opt.optimizer.param_groups[0]["lr"]
            scaler.step(opt)
            scaler.update()
            for m, b in zip(opt.master_params, before, strict=True):
                assert torch.equal(m, b.add(m.grad, alpha=-lr))
            lrs.append(lr)
            opt.zero_grad()
            sched.step()
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.025]


@pytest.mark.parametrize("set_to_none", (True, False))
def test_zero_grad_clears_model_and_master_grads(device, set_to_none):
    net = make_net(F16, device, mixed=True)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1))
    scaler = ampfused.GradScaler(device)
    backward(net, scaler, 0, F16, device)
    scaler.step(opt)
    scaler.update()
    assert all(m.grad is not None for m in opt.master_params)
    opt.zero_grad(set_to_none=set_to_none)
    for t in [*net.parameters(), *opt.master_params]:
        if set_to_none:
            assert t.grad is None
        else:
            assert t.grad is not None and not bool(t.grad.any())
    # The next iteration is unscaled afresh (the zeroed masters' gradients are not stepped).
    backward(net, scaler, 1, F16, device)
    scaler.unscale_(opt)
    for m, p in zip(opt.master_params, net.parameters(), strict=True):
        assert m.grad is not None and bool(m.grad.any())
        if m is not p:
            assert torch.equal(m.grad, p.grad.float() * (1 / scaler.get_scale()))


def test_add_param_group_gets_masters(device):
    net = make_net(F16, device)
    extra = nn.Linear(3, 2).half().to(device)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1))
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.5})
    group = opt.optimizer.param_groups[-1]
    assert group["lr"] == 0.5 and len(opt.param_groups) == 2
    for p, m in zip(extra.parameters(), group["params"], strict=True):
        assert m.dtype == F32 and torch.equal(m, p.float())
    assert opt.model_params[-2:] == list(extra.parameters())
    assert opt.master_params[-2:] == group["params"]
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [net.l1.weight]})
    scaler = ampfused.GradScaler(device)
    x = torch.randn(4, 6, device=device).half()
    loss = extra(net(x)[:, :3].half()).float().pow(2).mean()
    scaler.scale(loss).backward()
    before = extra.weight.detach().clone()
    scaler.step(opt)
    assert not torch.equal(extra.weight, before)
    assert_bits(extra.weight, group["params"][0].detach().half())


def test_add_param_group_takes_an_iterator(device):
    """torch's add_param_group takes any iterable, module.parameters() (a generator) too."""
    net = make_net(F16, device)
    extra = nn.Linear(3, 2).half().to(device)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1))
    opt.add_param_group({"params": extra.parameters()})
    assert len(opt.param_groups[-1]["params"]) == 2
    assert opt.model_params[-2:] == list(extra.parameters())


def test_params_without_grad_are_not_stepped(device):
    """A parameter whose .grad is None (unused in the loss, or frozen) gets a master gradient
    of None and is not stepped: master, parameter and optimizer state untouched."""
    torch.manual_seed(0)
    used, unused, frozen = (nn.Linear(4, 4).half().to(device) for _ in range(3))
    frozen.requires_grad_(False)
    params = [*used.parameters(), *unused.parameters(), *frozen.parameters()]
    opt = ampfused.MasterWeights(torch.optim.AdamW(params, lr=0.1))
    masters = opt.master_params
    assert [m.requires_grad for m in masters] == [True] * 4 + [False] * 2
    scaler = ampfused.GradScaler(device, init_scale=2.0**8)
    before = [t.detach().clone() for t in params + masters]
    for _ in range(2):
        x = torch.randn(3, 4, device=device).half()
        scaler.scale(frozen(used(x)).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
    for i in (2, 3, 4, 5):
        assert params[i].grad is None or i < 4 and not bool(params[i].grad.any())
        assert masters[i].grad is None
        assert_bits(params[i], before[i])
        assert_bits(masters[i], before[6 + i])
        assert masters[i] not in opt.state
    for i in (0, 1):
        assert not torch.equal(params[i], before[i]) and masters[i] in opt.state


def test_model_zero_grad_instead_of_optimizer_zero_grad(device):
    """model.zero_grad() (the model's gradients only) between steps: a master whose parameter
    has no gradient in the next step gets none, so its stale gradient is not stepped again."""
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 4).half().to(device), nn.Linear(4, 4).half().to(device)
    opt = ampfused.MasterWeights(torch.optim.SGD([*used.parameters(), *unused.parameters()], 0.1))
    scaler = ampfused.GradScaler(device, init_scale=2.0**8)
    x = torch.randn(3, 4, device=device).half()
    scaler.scale(unused(used(x)).float().sum()).backward()
    scaler.step(opt)
    scaler.update()
    used.zero_grad()
    unused.zero_grad()
    masters = opt.master_params
    before = [m.detach().clone() for m in masters]
    scaler.scale(used(x).float().sum()).backward()
    scaler.step(opt)
    assert masters[2].grad is None and masters[3].grad is None
    assert_bits(masters[2], before[2])
    assert_bits(masters[3], before[3])
    assert not torch.equal(masters[0], before[0])


def test_constructor_errors(device):
    net = make_net(F16, device)
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer, got list"):
        ampfused.MasterWeights(list(net.parameters()))
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already a MasterWeights"):
        ampfused.MasterWeights(opt)
    stepped = torch.optim.Adam(make_net(F16, device).parameters())
    for p in stepped.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    stepped.step()
    with pytest.raises(ValueError, match="already holds state"):
        ampfused.MasterWeights(stepped)


@pytest.mark.parametrize("with_scaler", (False, True))
def test_sparse_gradient_not_implemented(device, with_scaler):
    emb = nn.Embedding(10, 4, sparse=True).half().to(device)
    opt = ampfused.MasterWeights(torch.optim.SGD(emb.parameters(), lr=0.1))
    scaler = ampfused.GradScaler(device) if with_scaler else None
    loss = emb(torch.tensor([1, 3, 3], device=device)).float().sum()
    (scaler.scale(loss) if scaler else loss).backward()
    assert emb.weight.grad.layout == torch.sparse_coo
    before = emb.weight.detach().clone()
    with pytest.raises(
        NotImplementedError, match=r"sparse_coo gradient.*nn.Embedding\(sparse=True\)"
    ):
        scaler.step(opt) if scaler else opt.step()
    assert_bits(emb.weight, before)
    assert_bits(opt.master_params[0], before.float())


# ============================================================================================
# 6. The plain scaler on a float16 model, and allow_fp16


def fp16_sgd(device: str):
    net = make_net(F16, device, mixed=True)
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


@pytest.mark.parametrize("call", ("unscale_", "step", "clip_grad_norm_"))
def test_float16_grads_value_error_points_to_masters_and_autocast(device, call):
    net, opt = fp16_sgd(device)
    scaler = ampfused.GradScaler(device)
    backward(net, scaler, 0, F16, device)
    grads = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"^Attempting to unscale FP16 gradients") as info:
        if call == "clip_grad_norm_":
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            getattr(scaler, call)(opt)
    assert "MasterWeights" in str(info.value) and "autocast" in str(info.value)
    for p, g in zip(net.parameters(), grads, strict=True):
        assert_bits(p.grad, g)


def test_allow_fp16_unscales_in_place_like_torch(device):
    """GradScaler(allow_fp16=True).unscale_ writes the float16 (and float32) gradients in place
    with the bits of torch's own _unscale_grads_(..., allow_fp16=True), found_inf included."""
    for special in (None, NAN):
        net, opt = fp16_sgd(device)
        ref, opt_ref = copy.deepcopy(net), None
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        scaler = ampfused.GradScaler(device, init_scale=2.0**10, allow_fp16=True)
        backward(net, scaler, 0, F16, device)
        backward(ref, scaler, 0, F16, device)
        for m in (net, ref):
            with torch.no_grad():
                m.l1.weight.grad[0, 0] = 6.1e-5  # a float16 normal that unscales to a subnormal
                if special is not None:
                    m.l1.bias.grad[-1] = special
        scaler.unscale_(opt)
        found = scaler._found_inf_per_device(opt)
        inv = scaler._scale.double().reciprocal().float()
        ref_found = torch.zeros((), device=device)
        ref_found = torch.amp.GradScaler._unscale_grads_(
            torch.amp.GradScaler(device), opt_ref, inv, ref_found, True
        )
        for p, pr in zip(net.parameters(), ref.parameters(), strict=True):
            assert_bits(p.grad, pr.grad, str(p.dtype))
        assert net.l1.weight.grad.dtype == F16
        assert sum(v.item() for v in found.values()) == (special is not None)
        assert [v.item() for v in found.values()] == [v.item() for v in ref_found.values()]


def test_allow_fp16_reaches_a_subclass_hooking_unscale_grads(device):
    """A subclass that hooks _unscale_grads_ (as sharded scalers do, to all-reduce found_inf)
    takes torch's unscale path, which asks for allow_fp16=False: the option still holds."""
    calls = []

    class Hooked(ampfused.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            calls.append(allow_fp16)
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    net, opt = fp16_sgd(device)
    ref, opt_ref = copy.deepcopy(net), None
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = Hooked(device, init_scale=2.0**10, allow_fp16=True)
    backward(net, scaler, 0, F16, device)
    backward(ref, scaler, 0, F16, device)
    scaler.unscale_(opt)
    assert calls == [False]
    torch.amp.GradScaler._unscale_grads_(
        torch.amp.GradScaler(device),
        opt_ref,
        scaler._scale.double().reciprocal().float(),
        torch.zeros((), device=device),
        True,
    )
    for p, pr in zip(net.parameters(), ref.parameters(), strict=True):
        assert_bits(p.grad, pr.grad, str(p.dtype))
    with pytest.raises(ValueError, match="^Attempting to unscale FP16 gradients"):
        plain = Hooked(device)
        backward(net, plain, 1, F16, device)
        plain.unscale_(opt)


@pytest.mark.parametrize("value", (1, 0, "yes", None))
def test_allow_fp16_must_be_a_bool(value):
    with pytest.raises(TypeError, match="allow_fp16 must be True or False"):
        ampfused.GradScaler("cpu", allow_fp16=value)


def test_allow_fp16_is_keyword_only():
    param = inspect.signature(ampfused.GradScaler).parameters["allow_fp16"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is False


def test_torch_scaler_does_not_step_on_scaled_gradients(device):
    """torch.amp.GradScaler walks the optimizer's groups (the masters, without gradients before
    a pass of ampfused's scaler or cast_grads()) and finds nothing to unscale: it fails loudly
    rather than let MasterWeights.step cast the scaled float16 gradients and step on them."""
    net = make_net(F16, device)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.05))
    scaler = torch.amp.GradScaler(device, init_scale=2.0**12)
    backward(net, scaler, 10, F16, device)
    before = snapshot(net, opt)
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.step(opt)
    assert_snapshot(before, net, opt, "a refused step")


def test_model_grads_changed_after_the_pass_are_refused(device):
    """torch's idiom clip_grad_norm_(model.parameters()) after scaler.unscale_(optimizer)
    (Accelerate's clip) changes the float16 gradients after they were unscaled into the
    masters: step() refuses, naming the fix, rather than step without the change."""
    net = make_net(F16, device)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1))
    scaler = ampfused.GradScaler(device, **SCALER_KW)
    backward(net, scaler, 0, F16, device)
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    before = snapshot(net, opt)
    with pytest.raises(
        RuntimeError, match=r"changed after the scaler unscaled it.*clip_grad_norm_"
    ):
        scaler.step(opt)
    assert_snapshot(before, net, opt, "a refused step")


def test_cast_grads_then_clip_the_masters_without_a_scaler(device):
    """Without a scaler, cast_grads() fills the masters' gradients before step(), so clipping
    them (as frameworks do through param_groups) takes effect, and step() keeps the clip."""
    net = make_net(BF16, device)
    ref, params_ref, masters_ref = twin(net)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.5))
    opt_ref = torch.optim.SGD(masters_ref, lr=0.5)
    off = torch.amp.GradScaler(device, enabled=False)
    for i in range(3):
        loss_of(net, i, BF16, device).backward()
        loss_of(ref, i, BF16, device).backward()
        opt.cast_grads()
        assert all(m.grad is not None and m.grad.dtype == F32 for m in opt.master_params)
        total = torch.nn.utils.clip_grad_norm_(opt.master_params, 1e-2)

        def clip_ref() -> None:
            torch.nn.utils.clip_grad_norm_(masters_ref, 1e-2)

        opt.step()
        reference.master_weights_step(off, opt_ref, params_ref, masters_ref, before_step=clip_ref)
        assert float(total) > 1e-2  # the clip was active
        assert_same_training(net, opt, None, ref, masters_ref, opt_ref, None, f"step {i}")
        opt.zero_grad()
        opt_ref.zero_grad()
        ref.zero_grad()


def test_cast_grads_then_both_sides_changed_is_refused(device):
    """A model gradient rewritten after cast_grads(), whose master's gradient was clipped in
    between: neither can be chosen silently, so step() refuses."""
    net = make_net(BF16, device)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.5))
    loss_of(net, 0, BF16, device).backward()
    opt.cast_grads()
    torch.nn.utils.clip_grad_norm_(opt.master_params, 1e-2)
    with torch.no_grad():
        net.l1.weight.grad.mul_(2)
    before = snapshot(net, opt)
    with pytest.raises(RuntimeError, match=r"changed after cast_grads\(\).*cannot be reconciled"):
        opt.step()
    assert_snapshot(before, net, opt, "a refused step")


def test_model_grads_changed_after_cast_grads_are_taken(device):
    """A model gradient rewritten after cast_grads() whose master was left alone is cast again
    by step(): the step sees the model's final gradients."""
    net = make_net(BF16, device)
    ref, params_ref, masters_ref = twin(net)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.5))
    opt_ref = torch.optim.SGD(masters_ref, lr=0.5)
    loss_of(net, 0, BF16, device).backward()
    loss_of(ref, 0, BF16, device).backward()
    opt.cast_grads()
    with torch.no_grad():
        net.l1.weight.grad.mul_(2)
        ref.l1.weight.grad.mul_(2)
    opt.step()
    reference.master_weights_step(
        torch.amp.GradScaler(device, enabled=False), opt_ref, params_ref, masters_ref
    )
    assert_same_training(net, opt, None, ref, masters_ref, opt_ref, None, "recast")


def test_model_weights_set_after_wrapping_reach_the_masters(device):
    """A parameter written after wrapping with a new value (an init, model.load_state_dict of
    other weights) gives its master that value; the same value rewritten (a checkpoint's model
    weights loaded after its optimizer state) keeps the master's extra bits."""
    net = make_net(F16, device)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.0))
    master = opt.master_params[0]
    with torch.no_grad():
        master.add_(2.0**-20)  # bits the float16 parameter cannot hold
        kept = master.clone()
        net.l1.weight.copy_(master)  # the same value, rounded
    scaler = ampfused.GradScaler(device, **SCALER_KW)
    backward(net, scaler, 0, F16, device)
    scaler.step(opt)
    scaler.update()
    assert_bits(master, kept, "same value rewritten")
    with torch.no_grad():
        net.l1.weight.fill_(0.5)
    opt.zero_grad()
    backward(net, scaler, 1, F16, device)
    scaler.step(opt)
    scaler.update()
    assert torch.all(master == 0.5) and torch.all(net.l1.weight == 0.5)


def test_pickle_and_deepcopy_with_a_scheduler(device):
    """An LR scheduler patches the wrapper's step; a pickled or deep-copied wrapper steps its
    own masters, and the original is left alone."""
    import copy
    import pickle

    net = make_net(F16, device)
    opt = ampfused.MasterWeights(torch.optim.SGD(net.parameters(), lr=0.1))
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    loss_of(net, 0, F16, device).backward()
    opt.step()
    for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        before = [m.clone() for m in opt.master_params]
        clone.zero_grad()
        for p in clone.model_params:
            p.grad = torch.ones_like(p)
        clone.step()
        assert all(torch.equal(a, b) for a, b in zip(opt.master_params, before, strict=True))
        assert not torch.equal(clone.master_params[0], before[0])


def test_step_with_closure(device):
    """step(closure) evaluates the closure (with grad enabled), casts its gradients and steps:
    the recipe's bits, and the closure's loss returned."""
    net = make_net(BF16, device, mixed=True)
    ref, params_ref, masters_ref = twin(net)
    opt = ampfused.MasterWeights(OPTIMIZERS["sgd_momentum"](net.parameters()))
    opt_ref = OPTIMIZERS["sgd_momentum"](masters_ref)
    off = torch.amp.GradScaler(device, enabled=False)
    for i in range(3):

        def closure(i=i):
            opt.zero_grad()
            loss = loss_of(net, i, BF16, device)
            loss.backward()
            return loss

        with torch.no_grad():
            loss = opt.step(closure)
        loss_ref = loss_of(ref, i, BF16, device)
        loss_ref.backward()
        reference.master_weights_step(off, opt_ref, params_ref, masters_ref)
        assert torch.equal(loss, loss_ref)
        assert_same_training(net, opt, None, ref, masters_ref, opt_ref, None, f"step {i}")
        opt_ref.zero_grad()
        ref.zero_grad()
