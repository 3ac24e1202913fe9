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

import math

import pytest
import torch
from torch._prims_common import (
    is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense,
)

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
def test_finite_values_match_reference(device, dtype, inv):
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
def test_every_16_bit_pattern(device, dtype, inv):
    """All 65536 float16 (bfloat16) bit patterns, NaNs of every payload included: the output
    bytes equal the reference's (torch's copy_ widens, then one float32 multiply), NaN bytes
    included, for inv 1 and not 1."""
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
def test_one_special_anywhere(device, dtype, special, n):
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


def test_many_tensors(device):
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
def test_found_inf_is_set_never_cleared(device, n):
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
            r"out\[1\] must have the shape and strides of grads\[1\]",
        ),
        "strides": case(
            t,
            torch.empty(6, 4, dtype=F32, device=device),
            RuntimeError,
            r"out\[1\] must have the shape and strides of grads\[1\]",
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
        "sparse": pytest.param(
            case(
                sparse,
                torch.empty(3, dtype=F32, device=device).to_sparse(),
                NotImplementedError,
                r"grads\[1\] and out\[1\] must be dense",
            ),
            marks=pytest.mark.xfail(
                strict=True,
                reason="unscale_into_ has no kernel on the Sparse dispatch keys (the other ops "
                "register one in csrc/unscale.cpp for this): the dispatcher's 'Could not run "
                "... SparseCPU' NotImplementedError comes first and names no argument",
            ),
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
        "out_none": pytest.param(
            case(f16, None, TypeError, r"out\[1\]"),
            marks=pytest.mark.xfail(
                strict=True,
                reason="ops._call names a None only in grads: a None in out reaches torch's "
                "schema parser, which raises a RuntimeError naming no element",
            ),
        ),
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
