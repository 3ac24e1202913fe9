"""Every CUDA kernel of csrc/cuda/, executed on the CPU by the host execution layer.

tests/host_cuda.py builds the kernels and launchers of csrc/cuda/ with the C++ compiler over
csrc/host_cuda/runtime.h (real barriers, seeded thread and warp orders, 32-lane shuffles, blocks
in flight together) as the ops ``torch.ops.ampfused_host.*``.  Each test runs one op three ways
on copies of the same inputs: that CUDA code, the CPU kernels (``torch.ops.ampfused``) and
:mod:`ampfused.reference`, and requires the same bits from all three in every tensor the op may
write (gradients, found_inf, the scale state, the statistics table, the clip outputs), and no
change to any byte outside those tensors' elements (the rest of a view's storage, and a guard
around every copied storage).  The layer itself reports an element access outside its work
item, a plain access to a workspace word that the launch uses atomically, and interleaves the
blocks in flight at every atomic, fence and workspace access under a relaxed memory model.

Kernels and what drives them here:
- unscale_kernel, all 16 variants (check-only/writing x float-only/mixed x with/without
  statistics x two launch capacities): the unscale family and scaler_pass_;
- the headroom policy's measurement with a gradient's largest element, finite, at each place a
  thread reads it (every element of a scalar head, every lane of a vector, the tail), and the
  update rule on random policies, headrooms and states near its rounding boundaries;
- the launchers' plan: one and several launches (epilogues kSetFlag, kAccumulate, kFinish), the
  shared per-stream workspace and its re-zeroing, a private one under graph capture (held
  half-run while eager passes run), passes of two host threads queued on one stream;
- the last-block hand-off under many seeded interleavings, with up to 8 blocks in flight;
- clip_factor_kernel (zero sums of squares, max_norm down to 0); unscale_into_kernel (both
  capacities); finish_pass through scaler_update_.

What this cannot show (nvcc's code generation beyond FMA contraction, the GPU's memory model
beyond the workspace words, real concurrency inside a block, speed) stays for a GPU: .ci/gpu.
Code that nvcc's device pass alone compiles (__CUDA_ARCH__) would never run here:
test_no_device_only_branch_escapes_the_layer keeps csrc/ free of it.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ampfused import ops, reference

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
CHUNK = ops.CHUNK_SIZE
INF, NAN = math.inf, math.nan
SMALL, LARGE = 256, 2032  # launch capacities (csrc/launch_table.h, kLaunchCapacities)

# (seed, blocks in flight, resident blocks, graph capture): a persistent grid of one block; of
# three blocks, two at a time; of seven, three at a time, with the capture path's workspace.
SCHEDULES = {
    "grid1": (11, 1, 1, False),
    "grid3-inflight2": (22, 2, 3, False),
    "grid7-inflight3-captured": (33, 3, 7, True),
}


@pytest.fixture(scope="module")
def host():  # noqa: ANN201
    import host_cuda

    return host_cuda.load()


@pytest.fixture(params=list(SCHEDULES))
def schedule(request: pytest.FixtureRequest, host) -> str:  # noqa: ANN001
    host.configure(*SCHEDULES[request.param])
    return request.param


# ------------------------------------------------------------------------------------ helpers
GUARD = 64  # bytes of 0xA5 before and after every copied storage (a multiple of 16)
INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class Arena:
    """Copies of tensors with their values, dtypes, storage offsets and strides (a misaligned or
    strided view stays one, at the same alignment), their storages laid one after another in
    one storage, each with GUARD bytes of 0xA5 before and after it, so a write past a tensor's
    storage lands in a guard."""

    def __init__(self, ts: list[torch.Tensor]) -> None:
        pieces, self.at, pos = [], [], GUARD
        guard = torch.full((GUARD,), 0xA5, dtype=torch.uint8)
        for t in ts:
            raw = _bytes(t.untyped_storage())
            pad = -raw.numel() % GUARD
            pieces += [guard, raw, torch.full((pad,), 0xA5, dtype=torch.uint8)]
            self.at.append(pos)
            pos += raw.numel() + pad + GUARD
        self.bytes = torch.cat([*pieces, guard]) if ts else guard.clone()
        self.meta = [
            (t.dtype, t.element_size(), t.storage_offset(), t.size(), t.stride()) for t in ts
        ]
        self.elements = self._views(self.bytes, as_int=True)

    def _views(self, buf: torch.Tensor, as_int: bool = False) -> list[torch.Tensor]:
        """The tensors over `buf` (an arena's bytes), or their elements seen as integers."""
        flat: dict[torch.dtype, torch.Tensor] = {}
        out = []
        for (dtype, elem, offset, size, stride), a in zip(self.meta, self.at, strict=True):
            dtype = INT_OF_SIZE[elem] if as_int else dtype
            if dtype not in flat:
                flat[dtype] = buf.view(dtype)
            out.append(flat[dtype].as_strided(size, stride, offset + a // elem))
        return out

    def copy(self) -> list[torch.Tensor]:
        """A fresh copy of the tensors (in a fresh storage)."""
        return self._views(self.bytes.clone())

    def assert_outside_unchanged(self, ts: list[torch.Tensor], what: str) -> None:
        """No byte of the copy `ts` (made by copy()) outside its tensors' elements, guards
        included, changed: with the elements put back as they were, the bytes are the
        original's."""
        if not ts:
            return
        now = _bytes(ts[0].untyped_storage()).clone()
        for restored, original in zip(self._views(now, as_int=True), self.elements, strict=True):
            restored.copy_(original)
        if not torch.equal(now, self.bytes):
            raise AssertionError(
                f"{what}: {int((now != self.bytes).sum())} bytes outside the tensors' elements "
                "changed: a write out of bounds"
            )


def copy_of(t: torch.Tensor) -> torch.Tensor:
    return Arena([t]).copy()[0]


def arenas_of(args: list[Any]) -> list[Arena | None]:
    """An Arena per tensor or list argument (one storage per list), None for the others."""
    return [
        Arena(a) if isinstance(a, list) else Arena([a]) if torch.is_tensor(a) else None
        for a in args
    ]


def copy_args(args: list[Any], arenas: list[Arena | None]) -> list[Any]:
    out = []
    for a, arena in zip(args, arenas, strict=True):
        out.append(a if arena is None else arena.copy() if isinstance(a, list) else arena.copy()[0])
    return out


def copies(args: list[Any]) -> list[Any]:
    """Copies of an op's arguments: each list in one storage, each tensor in its own."""
    return copy_args(args, arenas_of(args))


def tensors_of(args: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, list):
            out += a
        elif torch.is_tensor(a):
            out.append(a)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return t.reshape(-1).view(torch.uint8)
    return t.contiguous().view(INT_OF_SIZE[t.element_size()])


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str, any_nan: bool = False) -> None:
    """Bit equality; with `any_nan`, a NaN matches any NaN (the reference computes with torch's
    ops, whose NaN payloads and signs differ from the kernels' where a NaN is multiplied)."""
    a, b = bits(got), bits(want)
    if any_nan and got.is_floating_point():
        both = got.isnan() & want.isnan()
        a, b = a.masked_fill(both.reshape(a.shape), 0), b.masked_fill(both.reshape(b.shape), 0)
    if torch.equal(a, b):
        return
    diff = (a != b).nonzero()
    first = diff[0].tolist()
    raise AssertionError(
        f"{what}: {len(diff)} of {a.numel()} elements differ, first at {first}: "
        f"{got[tuple(first)].item()!r} vs {want[tuple(first)].item()!r}"
    )


def run_three(host, name: str, args: list[Any], oracles: tuple[str, ...] | None = None):  # noqa: ANN001, ANN201
    """Runs op `name` as the host-executed CUDA code, then each oracle, on copies of `args`;
    asserts every tensor argument ends with the same bits, and that no run changed a byte of
    a tensor's storage outside its view, nor the guards around it.  Returns the host run's
    arguments.
    By default the oracles are the CPU kernels and the reference; past 300 tensors the CPU
    kernels only (the reference's Python loop would dominate; test_ops.py holds the CPU kernels
    to the reference on such sets)."""
    if oracles is None:
        oracles = ("cpu",) if len(tensors_of(args)) > 300 else ("cpu", "reference")
    impls: dict[str, Callable[..., Any]] = {
        "cuda (host)": getattr(host, name),
        "cpu": getattr(torch.ops.ampfused, name),
        "reference": getattr(reference, name),
    }
    runs = {}
    arenas = arenas_of(args)
    for impl in ("cuda (host)", *oracles):
        runs[impl] = copy_args(args, arenas)
        impls[impl](*runs[impl])
        for k, (a, arena) in enumerate(zip(runs[impl], arenas, strict=True)):
            if arena is not None:
                arena.assert_outside_unchanged(
                    a if isinstance(a, list) else [a], f"{name} ({impl}), argument {k}"
                )
    for oracle in oracles:
        for k, (got, want) in enumerate(
            zip(tensors_of(runs["cuda (host)"]), tensors_of(runs[oracle]), strict=True)
        ):
            what = f"{name}: tensor argument {k} ({tuple(want.shape)}) vs {oracle}"
            assert_same(got, want, what, any_nan=oracle == "reference")
    return runs["cuda (host)"]


def state(scale: float = 2.0**16, tracker: int = 0, hysteresis_left: int = 1) -> torch.Tensor:
    s = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    s[0:1].view(F32).fill_(scale)
    s[1], s[2] = tracker, hysteresis_left
    s[3:] = torch.arange(3, ops.STATE_SIZE, dtype=torch.int32) * 7  # counters carried along
    return s


def fresh_state(scale: float, hysteresis: int = 1) -> torch.Tensor:
    """A new scaler's state (reference.initial_state): nothing measured, no ceiling, no cap."""
    s = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    reference.state_from_list(reference.initial_state(scale, hysteresis), s)
    return s


# ------------------------------------------------------------------------------- gradient sets
def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Scaled gradients: wide magnitudes, exact zeros and float16 subnormals among them.
    v = torch.randn(n, generator=g, dtype=F64) * torch.exp2(
        torch.randint(-20, 12, (n,), generator=g)
    )
    v[torch.rand(n, generator=g) < 0.05] = 0.0
    return v.to(dtype)


def _sizes(dtype: torch.dtype) -> list[torch.Tensor]:
    sizes = (1, 3, 4, 7, 8, 9, 17, 511, 4096 + 3, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 5)
    return [_values(n, dtype, k) for k, n in enumerate(sizes)]


def _views() -> list[torch.Tensor]:
    """Misaligned, strided, transposed and zero-size views of every dtype."""
    out = []
    for k, dtype in enumerate((F16, BF16, F32, F64)):
        base = _values(3 * CHUNK + 40, dtype, 100 + k)
        out.append(base[1 : CHUNK + 3])  # misaligned start, crosses a chunk
        out.append(base[CHUNK + 7 : 2 * CHUNK + 100])  # odd offset and length
        out.append(base[2 * CHUNK + 200 : 2 * CHUNK + 200 + 6 * 50].view(50, 6)[:, ::2])  # strided
        out.append(_values(70 * 33, dtype, 200 + k).view(70, 33).t())  # transposed, dense
        out.append(base[:0])
        out.append(_values(0, dtype, 0).view(0, 4))
    return out


def _many(n: int, dtypes: tuple[torch.dtype, ...], seed: int) -> list[torch.Tensor]:
    """n small gradients (one item each), then a large one: n + 4 items."""
    out = [_values(13 + k % 11, dtypes[k % len(dtypes)], seed + k) for k in range(n)]
    return out + [_values(3 * CHUNK + 2, dtypes[0], seed - 1)]


GRAD_SETS: dict[str, Callable[[], list[torch.Tensor]]] = {
    "float32-sizes": lambda: _sizes(F32),  # the float-only kernel
    "float16-sizes": lambda: _sizes(F16),
    "bfloat16-sizes": lambda: _sizes(BF16),
    "float64-sizes": lambda: _sizes(F64),
    "mixed-views": _views,
    "empty": lambda: [],
    "small-capacity": lambda: _many(SMALL - 4, (F16, F32, BF16), 1000),  # exactly 256 items
    "large-capacity": lambda: _many(SMALL - 3, (F32,), 2000),  # 257 items, float-only
    "two-launches": lambda: _many(LARGE - 3, (F32, F16, BF16, F64), 3000),  # 2033 items
    "three-launches-float32": lambda: _many(2 * LARGE + 1, (F32,), 5000),
}
STATS_SETS = {"float32-sizes", "bfloat16-sizes", "mixed-views", "empty", "two-launches"}


def with_specials(grads: list[torch.Tensor], pattern: str) -> list[torch.Tensor]:
    """Copies of `grads` with inf/-inf/NaN placed as `pattern` says: "clean", none; "early" and
    "late", at the first, last, middle and chunk-boundary elements of every third gradient;
    "single", one NaN in the whole list, at an element no block's thread 0 visits (so a block
    that forgets to combine its threads' flags misses it)."""
    grads = [copy_of(g) for g in grads]
    if pattern == "clean":
        return grads
    if pattern == "single":
        big = max(range(len(grads)), key=lambda k: grads[k].numel(), default=None)
        if big is not None and grads[big].numel() > 1:
            g = grads[big]
            i = g.numel() * 2 // 3 + 1
            if g.numel() > 3 * 4 * 512:  # past the first vectors of a thread 0
                i = (i // 2048) * 2048 + 700 if (i // 2048) * 2048 + 700 < g.numel() else i
            g[tuple(torch.unravel_index(torch.tensor(i), g.shape))] = NAN
        return grads
    for k, g in enumerate(grads):
        if g.numel() == 0 or k % 3 != (0 if pattern == "early" else 2):
            continue
        idx = [0, g.numel() - 1, g.numel() // 2, min(CHUNK, g.numel() - 1)]
        vals = [INF, -INF, NAN, INF] if pattern == "early" else [NAN, INF, -INF, NAN]
        for i, v in zip(idx, vals, strict=True):
            g[tuple(torch.unravel_index(torch.tensor(i), g.shape))] = v
    return grads


# ------------------------------------------------------------------------- the unscale family
@pytest.mark.parametrize("specials", ["clean", "early", "single"])
@pytest.mark.parametrize("grad_set", list(GRAD_SETS))
def test_unscale_family(host, schedule: str, grad_set: str, specials: str) -> None:  # noqa: ANN001
    grads = with_specials(GRAD_SETS[grad_set](), specials)
    found = torch.zeros(1)
    for inv in (1.0, 2.0**-16, 0.37):
        run_three(host, "non_finite_check_and_unscale_", [grads, found, torch.tensor([inv])])
    run_three(host, "non_finite_check_", [grads, torch.zeros(1)])
    already = torch.ones(1)  # set, never cleared
    run_three(host, "non_finite_check_", [grads, already])
    for check_only in (False, True):
        for accumulate in (False, True):
            args = [
                grads,
                torch.full((1,), 7.0),
                torch.tensor([3.0**9]),
                torch.tensor([4], dtype=torch.int32),
            ]
            args += [torch.full((1,), -1.0), torch.full((1,), -1, dtype=torch.int32)]
            run_three(host, "unscale_update_scale_", args + [2.0, 0.5, 5, check_only, accumulate])


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=str)
def test_items_shorter_than_their_peel(host, dtype: torch.dtype) -> None:  # noqa: ANN001
    """Views at every element offset within a 16-byte line, of every length up to two lines
    (items shorter than, as long as and longer than the scalar head before their first 16-byte
    boundary), and tensors whose last chunk is shorter than its head: every element access
    stays in its item (the layer checks each) and no byte outside a view changes (a flat
    gradient buffer's next gradient lives there)."""
    host.configure(dtype.itemsize, 3, 5, False)
    per_line = 16 // dtype.itemsize
    base = _values(CHUNK + 4 * per_line, dtype, 9)
    views = [base[o : o + n] for o in range(per_line) for n in range(1, 2 * per_line + 1)]
    # The last chunk (CHUNK elements on, as aligned as the view) one element shorter than the
    # head that alignment asks for.
    views += [base[o : o + CHUNK + per_line - o - 1] for o in range(1, per_line - 1)]
    views = with_specials(views, "early")
    run_three(host, "non_finite_check_and_unscale_", [views, torch.zeros(1), torch.tensor([0.37])])
    nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    for table in (None, _stats_table(views)):
        args = [views, torch.zeros(1), state(2.0**10), nxt, table, 2.0, 0.5, 3, -INF, INF, 1]
        run_three(host, "scaler_pass_", args + [False, False], ("cpu",))
    if dtype != F64:
        out = [torch.full(v.shape, -7.0) for v in views]
        run_three(host, "unscale_into_", [views, out, torch.zeros(1), torch.tensor([0.37])])


@pytest.mark.parametrize("grad_set", list(GRAD_SETS))
def test_scaler_pass(host, schedule: str, grad_set: str) -> None:  # noqa: ANN001
    grads = with_specials(GRAD_SETS[grad_set](), "late" if "launch" in grad_set else "clean")
    # (the last: the headroom policy, whose pass measures the magnitude across blocks)
    policies = [
        (2.0, 0.5, 3, -INF, INF, 1, 0.0),
        (2.0, 0.25, 1, 2.0**15, 2.0**16, 3, 0.0),
        (2.0, 0.5, 3, 1.0, INF, 1, 8.0),
    ]
    # The magnitude is measured in a clean copy (an inf/NaN makes it +inf), its largest element
    # in the first gradient: in a multi-launch pass, in a launch that only accumulates.
    measured = [copy_of(g) for g in GRAD_SETS[grad_set]()]
    if measured and measured[0].numel():
        measured[0].view(-1)[0] = 2.0**20
    for *policy, headroom in policies:
        for check_only in (False, True):
            for accumulate in (False, True):
                nxt = torch.full((ops.STATE_SIZE,), -5, dtype=torch.int32)
                nxt[9] = 0x3F800000 if accumulate else -5  # (an earlier pass's magnitude: 1.0)
                pass_grads = measured if headroom else grads
                args = [pass_grads, torch.full((1,), 9.0), state(2.0**16, 2, 2), nxt, None]
                args += [*policy, check_only, accumulate, headroom]
                run_three(host, "scaler_pass_", args)


def _stats_table(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.full((ops.grad_stats_rows(grads), len(ops.STAT_FIELDS)), -3.0, dtype=F64)


@pytest.mark.parametrize("specials", ["clean", "single"])
@pytest.mark.parametrize("grad_set", sorted(STATS_SETS))
def test_scaler_pass_with_statistics(host, schedule: str, grad_set: str, specials: str) -> None:  # noqa: ANN001
    if grad_set == "two-launches" and (schedule, specials) != ("grid3-inflight2", "single"):
        pytest.skip("two-launch statistics run once (some 2,000 items of 512 fibers each)")
    grads = with_specials(GRAD_SETS[grad_set](), specials)
    for check_only, headroom in ((False, 0.0), (True, 0.0), (False, 8.0)):
        args = [
            grads,
            torch.zeros(1),
            state(2.0**10),
            torch.zeros(ops.STATE_SIZE, dtype=torch.int32),
        ]
        args += [_stats_table(grads), 2.0, 0.5, 2000, -INF, INF, 1, check_only, False, headroom]
        out = run_three(host, "scaler_pass_", args)
        # The table feeds clip_factor_ as the scaler's clip does.
        table, nxt = out[4], out[3]
        for norm_type in (2.0, INF):
            for max_norm in (1e-3, 1e9):
                clip = [
                    table,
                    nxt,
                    torch.full((1,), -1.0),
                    torch.full((1,), -1.0),
                    max_norm,
                    norm_type,
                ]
                run_three(host, "clip_factor_", clip)


def test_statistics_rows_at_launch_boundaries(host) -> None:  # noqa: ANN001
    """A three-launch pass with statistics: the rows of items 2031/2032 and 4063/4064 (the
    launches' first_item) come from different launches."""
    host.configure(44, 2, 4, False)
    grads = [_values(5 + k % 3, (F32, BF16)[k % 2], k) for k in range(2 * LARGE + 10)]
    grads[LARGE - 1][0] = INF  # the last item of launch 0
    grads[2 * LARGE][1] = NAN  # the first item of launch 2
    args = [grads, torch.zeros(1), state(), torch.zeros(ops.STATE_SIZE, dtype=torch.int32)]
    run_three(
        host, "scaler_pass_", args + [_stats_table(grads), 2.0, 0.5, 3, -INF, INF, 1, False, False]
    )
    assert host.counters()[0] == 3, host.counters()


# ------------------------------------------------------ the headroom policy's measurement and rule
VEC_BYTES = 16  # the kernel's vector (csrc/cuda/multi_tensor_apply.cuh, kVecBytes)
BLOCK = 512  # threads per block (kBlockSize): vector i of an item is thread i % BLOCK's
HALF_MAX = reference.HALF_MAX


def _finite_max(dtype: torch.dtype, rng: random.Random) -> float:
    """A largest value finite in `dtype` (float16's below 65504), of a random mantissa and
    sign: a float16 set measures a finite magnitude only below float16's largest value."""
    top = 2.0**15 if dtype == F16 else 2.0**40
    v = top * (1.0 + 0.95 * rng.random())
    return float(torch.tensor(-v if rng.random() < 0.5 else v).to(dtype).item())


def _placements(dtype: torch.dtype) -> list[tuple[str, int, int, int]]:
    """(where, view offset in elements past a 16-byte boundary, view length, index) for the
    largest element: at every element of the scalar head of every misaligned offset; at every
    lane of a vector, in even and odd threads of several warps and at each of the kUnroll
    loads in flight (vector i, u = i // BLOCK); at every element of the scalar tail."""
    vec = VEC_BYTES // dtype.itemsize
    nvec, tail = 3 * BLOCK + 70, vec - 1
    out = []
    for offset in range(1, vec):
        head = vec - offset
        out += [("head", offset, head + 5 * vec + tail, j) for j in range(head)]
    for offset in (0, vec - 1):
        head = (vec - offset) % vec
        length = head + nvec * vec + tail
        for lane in range(vec):
            for i in (
                2 * lane + 1,
                32 * (lane + 1) + 2 * lane,
                BLOCK * (1 + lane % 3) + 2 * lane + 7,
            ):
                out.append((f"lane {lane} of vector {i}", offset, length, head + i * vec + lane))
            out.append(
                (f"lane {lane} of the last vector", offset, length, head + (nvec - 1) * vec + lane)
            )
        out += [("tail", offset, length, head + nvec * vec + j) for j in range(tail)]
    return out


def _planted(
    dtype: torch.dtype, offset: int, length: int, index: int, value: float, seed: int
) -> torch.Tensor:
    """A view of `length` elements starting `offset` elements past a 16-byte boundary, values
    below |value| / 2 in magnitude, `value` at `index`."""
    base = _values(offset + length + 8, dtype, seed)
    base.clamp_(-abs(value) / 2, abs(value) / 2)
    view = base[offset : offset + length]
    assert view.data_ptr() % VEC_BYTES == offset * dtype.itemsize % VEC_BYTES
    view[index] = value
    return view


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=str)
def test_magnitude_wherever_the_largest_element_sits(host, dtype: torch.dtype) -> None:  # noqa: ANN001
    """The headroom policy's measurement, one scaler_pass_ per place of a gradient's largest
    element (_placements: every element of each misaligned view's scalar head, every lane of a
    vector in even and odd threads, in several warps and at each unrolled load, every element of
    the tail), its value finite in the dtype (a float16 one below 65504), in writing and
    check-only passes, some with statistics: the state's magnitude must be the reference's,
    |largest element|, and every tensor the same bits three ways.  A head measured after it is
    unscaled in place, a vector's lanes measured in part, a block maximum that drops odd
    threads: each measures less, and the cap and the scale follow it."""
    rng = random.Random(dtype.itemsize)
    host.configure(dtype.itemsize, 2, 3, False)
    policy = (2.0, 0.5, 3, -INF, INF, 1)
    magnitude = ops.STATE_FIELDS.index("magnitude")
    for k, (where, offset, length, index) in enumerate(_placements(dtype)):
        value = _finite_max(dtype, rng)
        grads = [_planted(dtype, offset, length, index, value, k)]
        want = reference.magnitude(grads)
        assert want == abs(value) or dtype == F64, (want, value)  # (float64: rounded to float32)
        # (with statistics, every other placement, writing and check-only in turn: 512 fibers
        # each summing their lanes make those passes the slow ones)
        modes = [(False, False), (True, False)] + ([(k % 4 == 0, True)] if k % 4 < 2 else [])
        for check_only, stats in modes:
            case = (
                f"{dtype}, largest element {value} at {where} (view offset {offset}, index "
                f"{index}), check_only={check_only}, statistics={stats}"
            )
            table = _stats_table(grads) if stats else None
            nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
            args = [grads, torch.zeros(1), fresh_state(2.0**12), nxt, table, *policy]
            args += [check_only, False, 8.0]
            alone = copies(args)  # the host layer's measurement first, for the message
            host.scaler_pass_(*alone)
            got = alone[3][magnitude : magnitude + 1].view(F32).item()
            assert got == want, f"{case}: measured {got}, want {want}"
            run_three(host, "scaler_pass_", args)


# ------------------------------------------------------------------------------ scale islands
ISLAND_INV = (2.0**-3, 2.0**5, 1.0, 2.0**-20)  # island k's 1 / f at k - 1


def _island_set(form: str) -> tuple[list[torch.Tensor], tuple[int, ...], float]:
    """Gradients of several islands and none, mixed dtypes, misaligned views, several items
    and ("many") several launches, the largest element of all in an island (a float16 item,
    lane 5 of a vector of an odd thread); returns them, each one's island, and the largest
    finite |v| at the global scale (an island's times its inverse factor)."""
    if form == "many":  # (three launches of small gradients)
        grads = [_values(3 + k % 4, (F32, F16, BF16)[k % 3], k) for k in range(2 * LARGE + 9)]
    else:
        grads = [
            _values(CHUNK + 77, F32, 1),
            _values(1000, F16, 2)[3:],  # (misaligned: a scalar head)
            _values(2 * CHUNK + 5, BF16, 3),
            _values(517, F64, 4),
            _values(4096, F16, 5),
            _values(300, F32, 6)[1:],
        ]
    islands = tuple((0, 1, 2, 0, 3, 4)[k % 6] for k in range(len(grads)))
    for g in grads:
        g.clamp_(-1000.0, 1000.0)
    big = [k for k, i in enumerate(islands) if i and grads[k].dtype == F16][0]
    grads[big][(33 * 8 + 5) % grads[big].numel()] = 30000.0
    # (an island's gradients at the global scale: times its inverse factor)
    at_global = max(
        float(g.double().abs().max()) * (ISLAND_INV[i - 1] if i else 1.0)
        for g, i in zip(grads, islands, strict=True)
    )
    return grads, islands, at_global


@pytest.mark.parametrize("form", ["items", "many"])
def test_islands_each_gradient_at_its_own_factor(host, schedule: str, form: str) -> None:  # noqa: ANN001
    """Scale islands in the pass (scaler_pass_'s islands/island_inv): each gradient unscaled by
    the pass's inverse scale times its island's, the statistics of those truly unscaled values,
    the measured magnitude at the global scale (the largest element, planted in an island,
    reaches it divided by the island's factor), in writing, check-only and statistics passes:
    the same bits three ways.  An item handed the pass's inverse alone, or its island's
    neighbour's, or measured at its island's scale, differs."""
    if form == "many" and schedule != "grid3-inflight2":
        pytest.skip("three launches of small gradients run in one schedule")
    grads, islands, at_global = _island_set(form)
    inv = torch.tensor(ISLAND_INV, dtype=F32)
    magnitude = ops.STATE_FIELDS.index("magnitude")
    for check_only, stats in ((False, False), (True, True), (False, True)):
        table = _stats_table(grads) if stats else None
        args = [
            grads,
            torch.zeros(1),
            fresh_state(2.0**4),
            torch.zeros(ops.STATE_SIZE, dtype=torch.int32),
        ]
        args += [table, 2.0, 0.5, 3, -INF, INF, 1, check_only, False, 8.0, islands, inv]
        out = run_three(host, "scaler_pass_", args)
        got = out[3][magnitude : magnitude + 1].view(F32).item()
        # (with statistics: from the items' unscaled abs-max, times the scale)
        assert got == _f32(at_global) if not stats else 0 < got <= at_global, (check_only, got)
        assert got > 1000.0  # (the island's largest element, at the global scale, is the top)


def test_islands_are_checked_before_anything_is_written(host) -> None:  # noqa: ANN001
    """A bad islands/island_inv argument is refused, naming it, by the CPU and host-executed
    CUDA kernels alike, before any gradient is written."""
    grads = [torch.full((5,), 8.0), torch.full((3,), 8.0)]
    inv = torch.tensor([0.5], dtype=F32)
    bad = [
        ((1,), inv, RuntimeError, "one island per gradient"),
        ((0, 2), inv, RuntimeError, "islands\\[1\\] is 2"),
        ((0, -1), inv, RuntimeError, "islands\\[1\\] is -1"),
        ((0, 1), None, TypeError, "island_inv is None"),
        ((0, 1), inv.double(), RuntimeError, "island_inv must be a contiguous 1-D float32"),
        ((0, 1), torch.ones(2, 2, dtype=F32), RuntimeError, "1-D float32"),
    ]
    for impl in (host.scaler_pass_, torch.ops.ampfused.scaler_pass_):
        for islands, island_inv, error, match in bad:
            g = [t.clone() for t in grads]
            nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
            with pytest.raises(error, match=match):
                impl(g, torch.zeros(1), state(), nxt, None, 2.0, 0.5, 3, -INF, INF, 1, False,
                     False, 0.0, islands, island_inv)  # fmt: skip
            assert all(torch.equal(a, b) for a, b in zip(g, grads, strict=True))
            assert not nxt.any()


def _f32(x: float) -> float:
    """x rounded to float32, as a Python float."""
    return torch.tensor(x, dtype=F64).to(F32).item()


def _ulps(x: float, k: int) -> float:
    """The float32 `k` units in the last place above (below, k < 0) the positive float32 x."""
    b = torch.tensor(x, dtype=F32).view(torch.int32).item() + k
    return torch.tensor(b, dtype=torch.int32).view(F32).item()


def _rule_case(rng: random.Random) -> tuple[float, list[Any], tuple, float, float]:
    """One iteration's verdict, state, policy, headroom and measured magnitude, at random and
    near the rule's boundaries: a cap on or a few float32 ulps beside the scale times a power
    of the growth factor, history entries and a ceiling there too, bounds at or beside the
    scale, the tracker one short of the growth interval, hysteresis used up (hysteresis_left
    0, as after every backoff) or not, counters and the count since the last backoff at their
    wrap and window edges."""
    growth = rng.choice([2.0, 2.0, 1.5, 3.0, 4.0, 1.0001, 1.0 + 3.0 * rng.random()])
    backoff = rng.choice([0.5, 0.5, 0.25, 0.9, 0.999, 0.05 + 0.9 * rng.random()])
    interval = rng.choice([1, 2, 3, 5, 2000])
    hysteresis = rng.choice([1, 1, 2, 3, 5])
    headroom = rng.choice(
        [0.0, 8.0, 10.0, 1.0, 3.5, 1.0 + 99.0 * rng.random(), 1e4 * rng.random() + 1]
    ) * rng.choice([1.0, -1.0])  # (< 0: a learned margin, up to -headroom)
    scale = _f32(2.0 ** rng.randint(-30, 40) * rng.choice([1.0, 1.0, 1.0 + rng.random()]))

    def near(x: float) -> float:
        x = _f32(x)
        return _ulps(x, rng.randint(-2, 2)) if 0 < x < 3e38 else x

    target = near(scale * growth ** rng.randint(-3, 3))  # a cap near a factor's boundary
    at_target = near(HALF_MAX * scale / (max(_f32(abs(headroom)), 1.0) * target))
    magnitude = rng.choice(
        [0.0, 1e-30, 3e38, _f32(HALF_MAX * 2.0 ** rng.uniform(-20, 0)), at_target, at_target]
    )
    low = rng.choice(
        [-INF, -INF, scale, near(scale), near(scale * backoff), _f32(scale * rng.random())]
    )
    high = rng.choice(
        [INF, INF, scale, near(scale), near(scale * growth), _f32(scale * 8 * rng.random())]
    )
    if low > high:
        low, high = high, low
    policy = (growth, backoff, interval, low, high, hysteresis)
    counters = [rng.choice([0, rng.randint(0, 100), 2**31 - 1, -(2**31)]) for _ in range(6)]
    tracker = max(0, rng.choice([0, interval - 1, interval - 2, rng.randint(0, interval)]))
    since = rng.choice(
        [2**31 - 1, 0, reference.CEILING_WINDOW - 1, reference.CEILING_WINDOW, interval - 1]
        + [rng.randint(1, 3) * interval - 1, rng.randint(0, 100)]
    )
    ceiling = rng.choice(
        [INF, INF, scale, near(scale), near(scale * growth), near(scale / backoff)]
    )
    history = [
        rng.choice(
            [INF, INF, INF, target, near(target), scale, near(scale * growth)]
            + [-scale, -near(scale * backoff)]  # (an overflow's bound)
        )
        for _ in range(reference.HISTORY)
    ]
    # the learned margin: none yet, its least, its most, beside them, or between
    most = _f32(max(abs(headroom), 1.0))
    margin = rng.choice(
        [0.0, 0.0, reference.MARGIN_LEAST, near(reference.MARGIN_LEAST), most, near(most)]
        + [_f32(1.0 + 3.0 * rng.random())]
    )
    left = rng.randint(0, hysteresis)  # 0: used up (after a backoff, or hysteresis overflows)
    st = [scale, tracker, left, *counters, 0.0, ceiling, since]
    found = rng.choice([0.0, 0.0, 0.0, 1.0, 2.0, NAN])
    return found, st + history + [margin], policy, headroom, magnitude


def _state_tensor(values: list[Any]) -> torch.Tensor:
    """reference.update_state's list as the ops' int32 state."""
    s = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
    reference.state_from_list(values, s)
    return s


def test_update_rule_on_random_states_near_its_boundaries(host) -> None:  # noqa: ANN001
    """scaler_update_ (the update of the last block of every scaler pass) on random policies,
    headrooms (not only 8), states and magnitudes near the rule's rounding and comparison
    boundaries (_rule_case), held three ways: every field of the next state, bit for bit.  The
    cap is float64 arithmetic rounded once to float32: a float32 computation of it differs from
    it by an ulp in many of these cases (headroom 10, magnitude 6369.6167 at scale 65536:
    67396.047 against 67396.055); an overflow with hysteresis used up backs off."""
    host.configure(5, 1, 1, False)
    rng = random.Random(36)
    cases = [_rule_case(rng) for _ in range(1500)]
    pinned = reference.initial_state(65536.0)
    cases.append((0.0, pinned, (2.0, 0.5, 2000, -INF, INF, 1), 10.0, 6369.61669921875))
    for hysteresis in (1, 2, 3):  # hysteresis used up: overflow after a backoff
        used_up = reference.initial_state(2.0**10, hysteresis)
        used_up[2] = 0
        for headroom in (0.0, 8.0, -8.0):
            cases.append((1.0, used_up, (2.0, 0.5, 3, -INF, INF, hysteresis), headroom, 0.0))
    magnitude = ops.STATE_FIELDS.index("magnitude")
    for found, st, policy, headroom, measured in cases:
        nxt = torch.full((ops.STATE_SIZE,), -5, dtype=torch.int32)
        nxt[magnitude : magnitude + 1].view(F32).fill_(measured)
        args = [torch.tensor([found]), _state_tensor(st), nxt, *policy, headroom]
        run_three(host, "scaler_update_", args)


@pytest.mark.parametrize("seed", range(3))
def test_update_rule_over_runs_of_overflows(host, seed: int) -> None:  # noqa: ANN001
    """Iterations through scaler_pass_, each pass's next state the next one's state, with runs
    of consecutive overflowing iterations longer than the hysteresis (each backoff leaves
    hysteresis_left at 0, and every later overflow of the run must back off again), clean runs
    whose magnitude moves near the cap's boundaries, random policies and headrooms: every
    iteration's tensors three ways."""
    rng = random.Random(100 + seed)
    host.configure(seed, 2, 3, False)
    _, _, (growth, _, interval, _, _, hysteresis), headroom, _ = _rule_case(rng)
    policy = (growth, rng.choice([0.5, 0.25, 0.9]), interval, -INF, INF, hysteresis)
    st = fresh_state(2.0**12, hysteresis)
    base = _values(300, F32, seed)
    backoffs = 0
    for i in range(60):
        run = (i // 6) % 2 == 1  # six overflowing iterations, six clean, ...
        grads = [base * rng.uniform(0.5, 2.0)]
        if run:
            grads[0][rng.randrange(300)] = rng.choice([INF, -INF, NAN])
        nxt = torch.full((ops.STATE_SIZE,), -5, dtype=torch.int32)
        args = [grads, torch.zeros(1), st, nxt, None, *policy, rng.random() < 0.3, False]
        out = run_three(host, "scaler_pass_", args + [headroom])
        before, after = reference.state_to_list(st), reference.state_to_list(out[3])
        if run and before[2] == 0:
            assert after[0] < before[0] or after[8] > before[8], (i, before, after)
            backoffs += 1
        st = out[3].clone()
    assert backoffs >= 5, backoffs  # overflows with hysteresis used up really happened


# ----------------------------------------------------------------- the launchers' hand-off
def test_launch_counts(host) -> None:  # noqa: ANN001
    """The plan the tests above rely on: how many launches each set takes, and that blocks ran."""
    expected = {"empty": 1, "small-capacity": 1, "large-capacity": 1, "two-launches": 2}
    expected["three-launches-float32"] = 3
    for name, launches in expected.items():
        host.configure(5, 2, 3, False)
        grads = GRAD_SETS[name]()
        nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
        host.scaler_pass_(
            grads, torch.zeros(1), state(), nxt, None, 2.0, 0.5, 3, -INF, INF, 1, False, False
        )
        got = host.counters()
        assert got[0] == launches, (name, got)
        assert got[1] >= launches and got[2] >= got[1], (name, got)  # blocks ran, barriers opened


def test_shared_workspace_is_left_zeroed(host) -> None:  # noqa: ANN001
    """One-launch hand-off passes on one stream share a workspace that each pass's last block
    re-zeroes: a clean pass after an overflowing one must find nothing, on every schedule."""
    sizes = [_values(n, F32, n) for n in (3, 17, CHUNK + 1, 2 * CHUNK + 5)]
    for seed in range(4):
        host.configure(seed, 1 + seed % 3, 1 + seed, False)
        for grads in (with_specials(sizes, "early"), sizes, with_specials(sizes, "late"), sizes):
            for _ in range(2):
                nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
                args = [grads, torch.full((1,), 5.0), state(), nxt, None]
                run_three(
                    host, "scaler_pass_", args + [2.0, 0.5, 3, -INF, INF, 1, True, False], ("cpu",)
                )


@pytest.mark.parametrize(("blocks", "in_flight"), [(4, 3), (16, 8)])
def test_last_block_hand_off_under_interleavings(host, blocks: int, in_flight: int) -> None:  # noqa: ANN001
    """Passes of `blocks` one-item blocks, `in_flight` at a time, interleaved by the seed at
    every workspace access, atomic and fence (the layer's scheduling points), with writes
    reaching memory late (its relaxed model): each pass's last block must see the flag of every
    block (one item holds a NaN, a different block's each pass) and leave the stream's shared
    workspace zeroed for the next pass.  A counter updated without an atomic, read apart from
    its increment, or incremented before the block's flag is published and fenced fails here;
    small grids make the flagging block one of the last to count, where the races are."""
    clean = [_values(5, F32, k) for k in range(blocks)]
    switched = 0
    for seed in range(48):
        host.configure(1000 * blocks + seed, in_flight, blocks, False)
        grads = [copy_of(g) for g in clean]
        # The headroom policy's magnitude, max-ed across the blocks as the flag is OR-ed: the
        # largest element sits in a different block each pass (measured in a pass without NaN).
        grads[(3 * seed + 1) % blocks][seed % 5] = 2.0**20 + seed
        measured = [copy_of(g) for g in grads]
        if seed % 8 != 7:  # one clean pass in eight
            grads[(5 * seed) % blocks][seed % 5] = NAN
        for accumulate, headroom in ((False, 0.0), (True, 0.0), (False, 8.0)):
            if headroom:
                grads = measured
            nxt = torch.full((ops.STATE_SIZE,), -5, dtype=torch.int32)
            args = [grads, torch.full((1,), 3.0), state(2.0**16, 2, 1), nxt, None]
            args += [2.0, 0.5, 3, -INF, INF, 1, True, accumulate, headroom]
            run_three(host, "scaler_pass_", args)
        launches, blocks_run, _, _, points, switches = host.counters()
        assert (launches, blocks_run) == (3, 3 * blocks) and points >= blocks_run, host.counters()
        switched += switches
    assert switched > 48 * blocks, switched  # the blocks really interleaved


def test_captured_pass_owns_its_workspace(host) -> None:  # noqa: ANN001
    """A pass captured in a graph (one launch) is held with its blocks half run, as a replay on
    another stream may be, while eager passes run on the stream: their results and the
    captured pass's, once finished, must all be intact.  They are only if the captured pass
    holds a workspace of its own (an eager pass would otherwise count the captured pass's
    finished blocks as its own and take its flag)."""
    overflowing = with_specials([_values(9, F32, k) for k in range(7)], "early")
    for g in overflowing:
        g[4] = INF  # every item, so whichever blocks run first set the flag
    clean = [_values(9, F32, 50 + k) for k in range(7)]

    def pass_args(grads: list[torch.Tensor]) -> list[Any]:
        nxt = torch.full((ops.STATE_SIZE,), -5, dtype=torch.int32)
        args = [grads, torch.full((1,), 3.0), state(2.0**16, 2, 1), nxt, None]
        return args + [2.0, 0.5, 3, -INF, INF, 1, False, False]

    for held_blocks in (1, 3, 6):
        host.configure(held_blocks, 2, 7, True)
        captured = copies(pass_args(overflowing))
        host.hold_next_launch(held_blocks)
        host.scaler_pass_(*captured)  # returns with 7 - held_blocks blocks still to run
        host.configure(held_blocks, 2, 7, False)
        for grads in (clean, overflowing, clean):
            run_three(host, "scaler_pass_", pass_args(grads), ("cpu",))
        host.release_held()
        want = copies(pass_args(overflowing))
        torch.ops.ampfused.scaler_pass_(*want)
        for k, (got, exp) in enumerate(zip(tensors_of(captured), tensors_of(want), strict=True)):
            assert_same(got, exp, f"captured pass held after {held_blocks} blocks: tensor {k}")


def test_two_threads_queue_passes_on_one_stream(host) -> None:  # noqa: ANN001
    """Two host threads queue scaler passes on one stream, as two Python threads do on one CUDA
    device: one queues passes of two launches (2033 items) with an inf among the first
    launch's items, the other passes of one launch without any.  The layer runs the launches of both
    one at a time, in the order they were queued (runtime.h), so the one-launch passes run
    between the first pass's launches: each pass must find its own inf and only its own.  A
    pass of several launches that took the stream's shared workspace would hand its first
    launch's flag to the other thread's pass (a false inf there), whose last block re-zeroes
    it (the inf missed here)."""
    from concurrent.futures import ThreadPoolExecutor

    host.configure(36, 2, 3, False)
    two = _many(LARGE - 3, (F32,), 7000)  # 2033 items: two launches
    two[0][3] = INF
    one = [_values(n, F32, n) for n in (5, 300, 2 * CHUNK + 1)]
    policy = [2.0, 0.5, 3, -INF, INF, 1, True, False]  # check-only: the gradients are shared

    def passes(grads: list[torch.Tensor], count: int) -> list[tuple[float, torch.Tensor]]:
        out = []
        for _ in range(count):
            found, nxt = torch.full((1,), -1.0), torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
            host.scaler_pass_(grads, found, state(), nxt, None, *policy)
            out.append((found.item(), nxt))
        return out

    def expected(grads: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
        found, nxt = torch.full((1,), -1.0), torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
        torch.ops.ampfused.scaler_pass_(grads, found, state(), nxt, None, *policy)
        return found.item(), nxt

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(passes, two, 12), pool.submit(passes, one, 24)]
        results = [r.result() for r in runs]
    handovers = host.stream_handovers()
    wrong = []
    for what, grads, got in zip(("two-launch", "one-launch"), (two, one), results, strict=True):
        want_found, want_next = expected(grads)
        for k, (found, nxt) in enumerate(got):
            if found != want_found or not torch.equal(nxt, want_next):
                wrong.append(f"{what} pass {k}: found_inf {found}, want {want_found}")
    assert not wrong, f"{len(wrong)} of 36 passes: " + "; ".join(wrong)
    assert handovers >= 12, handovers  # the threads' launches really interleaved


def test_scaler_update(host) -> None:  # noqa: ANN001
    host.configure(3, 1, 1, False)
    policies = [
        (2.0, 0.5, 3, -INF, INF, 1),
        (2.0, 0.5, 1, 2.0**15, 2.0**17, 2),
        (3.0, 0.125, 2, 1.0, 1.0, 4),
    ]
    for found in (0.0, 1.0, 2.0, NAN):
        for tracker in (0, 1, 2):
            for hyst in (1, 2):
                for scale in (2.0**16, 2.0**127, 2.0**-126):
                    for policy in policies:
                        for headroom in (0.0, 8.0, -8.0):
                            nxt = torch.full((ops.STATE_SIZE,), -1, dtype=torch.int32)
                            nxt[9:10].view(F32).fill_(3e3)  # the magnitude the passes left
                            args = [torch.tensor([found]), state(scale, tracker, hyst), nxt]
                            run_three(host, "scaler_update_", args + [*policy, headroom])


# ---------------------------------------------------------------------------------- clipping
def _table(n_items: int, seed: int, non_finite: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.zeros(1 + n_items, len(ops.STAT_FIELDS), dtype=F64)
    t[0, :3] = torch.tensor([2.0**16, 4.0, 1.0 if non_finite else 0.0])
    t[1:, 0] = torch.rand(n_items, generator=g, dtype=F64) * torch.exp2(
        torch.randint(-30, 30, (n_items,), generator=g)
    )
    t[1:, 1] = torch.rand(n_items, generator=g, dtype=F64) * 1e3
    t[1:, 5] = torch.randint(0, 100, (n_items,), generator=g).to(F64)
    if non_finite and n_items > 3:
        t[3, 2] = 1.0
        t[n_items, 4] = 2.0
    return t


@pytest.mark.parametrize("n_items", [0, 1, 255, 256, 257, 3000])
def test_clip_factor(host, n_items: int) -> None:  # noqa: ANN001
    host.configure(n_items, 1, 1, False)
    for non_finite in (False, True):
        table = _table(n_items, n_items, non_finite)
        for st in (state(2.0**16), state(3.0), None):
            for norm_type in (2.0, INF):
                for max_norm in (0.5, 1e30):
                    args = [
                        table,
                        st,
                        torch.full((1,), -1.0),
                        torch.full((1,), -1.0),
                        max_norm,
                        norm_type,
                    ]
                    run_three(host, "clip_factor_", args)


def _zero_sum_table(
    n_items: int, abs_max: float, counts: tuple[float, float, float]
) -> torch.Tensor:
    """A table whose every sum of squares is 0 (zero gradients, or squares that underflowed
    float32's opmath: |u| below 2^-75), with `abs_max` in the last row and the (pos_inf,
    neg_inf, nan) counts in the first."""
    t = torch.zeros(1 + n_items, len(ops.STAT_FIELDS), dtype=F64)
    t[0, :3] = torch.tensor([2.0**16, 4.0, 1.0 if any(counts) else 0.0])
    t[1:, 5] = 100.0
    t[n_items, 1] = abs_max
    t[1, 2:5] = torch.tensor(counts, dtype=F64)
    return t


def test_clip_factor_when_the_squares_sum_to_zero(host) -> None:  # noqa: ANN001
    """clip_factor_ where the sum of squares is 0 but the largest magnitude is not (the inf norm
    is that magnitude: 1e-30 stays 1e-30), where everything is 0 (the factor is max_norm /
    1e-6, clamped: with max_norm below 1e-6 it is below 1), and with non-finite counts, for
    max_norm down to 0: the total and the factor three ways.  Then the same from gradients whose
    squares underflow, through a check-only pass's statistics as the scaler's clip runs it."""
    host.configure(0, 1, 1, False)
    max_norms = (0.0, 1e-12, 1e-7, 5e-7, 9.999e-7, 1e-6, 1.0000001e-6, 1.0, 1e30)
    for n_items in (1, 3, 300):
        for abs_max in (0.0, 1e-30, 1e-40, 2.0**-75, 1e-7):
            for counts in ((0.0, 0.0, 0.0), (1.0, 0.0, 0.0), (0.0, 0.0, 2.0)):
                table = _zero_sum_table(n_items, abs_max, counts)
                for st in (state(2.0**16), state(3.0), None):
                    for norm_type in (2.0, INF):
                        for max_norm in max_norms:
                            out = [torch.full((1,), -1.0), torch.full((1,), -1.0)]
                            args = [table, st, *out, max_norm, norm_type]
                            run_three(host, "clip_factor_", args)
    for values in (1e-30, 0.0, -(2.0**-80)):
        grads = [torch.full((n,), values, dtype=d) for n, d in ((5, F32), (70, F32), (9, BF16))]
        grads[1][3] = values * 3  # the largest
        table = _stats_table(grads)
        nxt = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
        args = [grads, torch.zeros(1), state(1.0), nxt, table, 2.0, 0.5, 3, -INF, INF, 1]
        out = run_three(host, "scaler_pass_", args + [True, False])
        for norm_type in (2.0, INF):
            for max_norm in max_norms:
                clip = [out[4], out[2], torch.full((1,), -1.0), torch.full((1,), -1.0)]
                total = run_three(host, "clip_factor_", clip + [max_norm, norm_type])[2]
                if norm_type == INF:
                    assert total.item() == _f32(abs(values * 3)), (values, total)


# ------------------------------------------------------------------------------ unscale_into_
INTO_SETS: dict[str, Callable[[], list[torch.Tensor]]] = {
    "sizes": lambda: [
        _values(n, d, n)
        for n in (1, 5, 4099, CHUNK, CHUNK + 1, 2 * CHUNK + 3)
        for d in (F16, BF16, F32)
    ],
    "small-capacity": lambda: [_values(9 + k % 4, (F16, BF16)[k % 2], k) for k in range(128)],
    "large-capacity": lambda: [_values(9 + k % 4, F16, k) for k in range(129)],
    "several-launches": lambda: (
        [_values(9 + k % 4, (F16, BF16, F32)[k % 3], k) for k in range(1030)]
        + [_values(3 * CHUNK, F16, 1)]
    ),
    "views": lambda: [
        _values(CHUNK + 9, F16, 3)[1:],
        _values(2 * CHUNK, BF16, 4)[5:-5],
        _values(0, F32, 0),
    ],
}


@pytest.mark.parametrize("specials", ["clean", "early", "single"])
@pytest.mark.parametrize("into_set", list(INTO_SETS))
def test_unscale_into(host, schedule: str, into_set: str, specials: str) -> None:  # noqa: ANN001
    grads = with_specials(INTO_SETS[into_set](), specials)
    for inv in (1.0, 2.0**-13):
        out = [torch.full(g.shape, -7.0) for g in grads]
        run_three(host, "unscale_into_", [grads, out, torch.zeros(1), torch.tensor([inv])])


# ------------------------------------------------------------------ the layer's own semantics
def test_layer_shuffles_as_cuda_does(host) -> None:  # noqa: ANN001
    host.configure(0, 1, 1, False)
    out = torch.tensor(host.selftest("shuffle")).view(-1, 4)[:64]
    t = torch.arange(64)
    assert torch.equal(out[:, 0], 1000 + (t ^ 1))
    assert torch.equal(out[:, 1], 1000 + (t ^ 16))
    # width 4: a lane whose source lies in a later group of 4 reads its own value (CUDA's rule)
    assert torch.equal(out[:, 2], torch.where(t & 4 == 0, 1000 + t, 1000 + (t ^ 4)))
    warp_sums = (1000 + t).view(2, 32).sum(1).repeat_interleave(32)
    assert torch.equal(out[:, 3], warp_sums)


def test_layer_exposes_a_missing_barrier(host) -> None:  # noqa: ANN001
    """Reads of another warp's shared memory without a barrier see stale values under every
    seed's schedules; with the barrier, never."""
    for seed in range(5):
        host.configure(seed, 1, 1, False)
        assert host.selftest("neighbour")[0] > 0, seed
        assert host.selftest("neighbour_with_barrier")[0] == 0, seed


def test_layer_reports_divergent_barriers_and_deadlocks(host) -> None:  # noqa: ANN001
    host.configure(0, 1, 1, False)
    with pytest.raises(RuntimeError, match="different barriers"):
        host.selftest("divergent")
    with pytest.raises(RuntimeError, match="deadlock"):
        host.selftest("half_warp")


def test_layer_delays_unfenced_stores_between_blocks(host) -> None:  # noqa: ANN001
    """Each of 4 blocks stores to its own word and counts itself finished; the last reads all
    four.  Without a __threadfence before the count some reads see the old value (stores reach
    other blocks late), with it none do; the seeded interleaving really switches blocks."""
    for seed in range(3):
        host.configure(seed, 2, 4, False)
        assert host.selftest("publish")[0] > 0, seed
        assert host.selftest("publish_with_fence")[0] == 0, seed
        assert host.counters()[5] > 0, host.counters()


def test_layer_reports_plain_access_to_an_atomic_word(host) -> None:  # noqa: ANN001
    host.configure(0, 2, 3, False)
    with pytest.raises(RuntimeError, match="non-atomic access to an atomically used address"):
        host.selftest("plain_and_atomic")


def test_layer_reports_out_of_bounds_accesses(host) -> None:  # noqa: ANN001
    """The layer's bounds check itself: one element read past a 5-element float item."""
    host.configure(0, 1, 1, False)
    with pytest.raises(RuntimeError, match="out-of-bounds access: 4 bytes at byte 20 of a work "):
        host.selftest("past_the_item")


def test_layer_contracts_as_nvcc_and_keeps_the_rn_intrinsics_apart(host) -> None:  # noqa: ANN001
    """(1 + 2^-12)^2 - (1 + 2^-11): plain arithmetic is fused here as nvcc fuses it (2^-24,
    the exact result), the _rn intrinsics round each step (0), as on a GPU."""
    import host_cuda

    host.configure(0, 1, 1, False)
    plain, rounded = host.selftest("fma")
    assert rounded == 0
    assert plain == (0x33800000 if host_cuda.CONTRACTS_FMA else 0)


# ----------------------------------------------------------------------- every kernel, executed
def _kernel_names() -> set[str]:
    ns = "ampfused::cuda::{anonymous}::"
    names = {f"{ns}clip_factor_kernel"} | {f"{ns}unscale_into_kernel<{c}>" for c in (128, 1024)}
    for check_only in ("true", "false"):
        for float_only in ("true", "false"):
            # (a pass with statistics measures in its own kernel: no kernel of its own)
            for stats, measure in (("true", "false"), ("false", "false"), ("false", "true")):
                for cap in (SMALL, LARGE):
                    names.add(
                        f"{ns}unscale_kernel<{check_only}, {float_only}, {stats}, {measure}, {cap}>"
                    )
    return names


def test_every_kernel_of_csrc_cuda_is_executed(host) -> None:  # noqa: ANN001
    """Each instantiation of each __global__ function of csrc/cuda/ (27) runs on the host layer,
    held to the CPU kernels: the 24 unscale_kernel variants (check-only or writing, float32-only
    or mixed, with statistics, without, or measuring for the headroom policy, small or large
    launch), clip_factor_kernel and both unscale_into_kernel capacities."""
    host.configure(7, 2, 3, False)
    for dtypes in ((F32,), (F32, F16)):  # the float-only kernel, the mixed one
        for n in (SMALL - 4, SMALL - 3):  # 256 items: the small launch; 257: the large one
            grads = _many(n, dtypes, n)
            for check_only in (False, True):
                for table, headroom in ((None, 0.0), (_stats_table(grads), 0.0), (None, 8.0)):
                    args = [
                        grads,
                        torch.zeros(1),
                        state(),
                        torch.zeros(ops.STATE_SIZE, dtype=torch.int32),
                    ]
                    args += [table, 2.0, 0.5, 3, -INF, INF, 1, check_only, False, headroom]
                    out = run_three(host, "scaler_pass_", args, ("cpu",))
                    if table is not None:
                        stats_out = out
    clip = [stats_out[4], stats_out[3], torch.zeros(1), torch.zeros(1), 1.0, 2.0]
    run_three(host, "clip_factor_", clip)
    for n in (128, 129):
        grads = [_values(5, F16, k) for k in range(n)]
        run_three(
            host,
            "unscale_into_",
            [grads, [torch.zeros(5) for _ in grads], torch.zeros(1), torch.ones(1)],
        )
    launched = {line.rsplit(" ", 1)[0] for line in host.kernels_launched()}
    assert launched >= _kernel_names(), sorted(_kernel_names() - launched)
    assert len(_kernel_names()) == 27


# ------------------------------------------------------------ what the layer cannot execute
# Names that select code by compiler pass: nvcc's device pass (__CUDA_ARCH__ and its kin), nvcc
# itself in either pass (__CUDACC__, __NVCC__), libcu++'s target macros, and the layer's own
# build (AMPFUSED_HOST_CUDA).  Code under any of them runs on a GPU and not here, or here and
# not on a GPU: the three-way tests above cannot see it.
DEVICE_ONLY = re.compile(
    r"\b(__CUDA_ARCH\w*|__CUDACC\w*|__NVCC__|__NVCOMPILER\w*|NV_IF_TARGET|NV_IF_ELSE_TARGET"
    r"|NV_DISPATCH_TARGET|NV_IS_DEVICE|NV_IS_HOST|NV_PROVIDES_SM_\w+|NV_IS_EXACTLY_SM_\w+"
    r"|AMPFUSED_HOST_CUDA)\b"
)
# The conditional groups allowed to use them, with why; a group is its directives and the
# lines they select, comments dropped, whitespace collapsed.  None: the opening directive only
# (the seam, whose every line is runtime plumbing).
ALLOWED_DEVICE_BRANCHES: dict[tuple[str, str], tuple[str | None, str]] = {
    ("unscale_math.h", "#if defined(__CUDACC__)"): (
        "#if defined(__CUDACC__) | #define AMPFUSED_HOST_DEVICE __host__ __device__"
        " | #define AMPFUSED_INLINE __host__ __device__ __forceinline__ | #else"
        " | #define AMPFUSED_HOST_DEVICE | #define AMPFUSED_INLINE inline"
        " __attribute__((always_inline)) | #endif",
        "function qualifiers, no arithmetic",
    ),
    ("unscale_math.h", "#if defined(__CUDA_ARCH__)"): (
        "#if defined(__CUDA_ARCH__) | #define AMPFUSED_CUDA_INTRINSICS 1"
        ' | #elif defined(AMPFUSED_HOST_CUDA) | #include "host_cuda/intrinsics.h"'
        " | #define AMPFUSED_CUDA_INTRINSICS 1 | #else | #define AMPFUSED_CUDA_INTRINSICS 0"
        " | #endif",
        "CUDA's intrinsics on the device, the layer's definitions of them here: the device "
        "branches under AMPFUSED_CUDA_INTRINSICS run in both",
    ),
    ("cuda/runtime.cuh", "#if defined(AMPFUSED_HOST_CUDA)"): (
        None,
        "the seam to a CUDA runtime: host_cuda/runtime.h here, CUDA's runtime on a GPU",
    ),
}


def _logical_lines(text: str) -> list[str]:
    """The lines of a C++ source, comments dropped (string literals kept, a block comment's
    line breaks too), continuation lines joined, whitespace collapsed."""

    def keep(m: re.Match[str]) -> str:
        s = m.group(0)
        return s if s.startswith('"') else "\n" * s.count("\n")

    text = re.sub(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', keep, text, flags=re.S)
    return [" ".join(line.split()) for line in text.replace("\\\n", " ").split("\n")]


def _device_only_uses(path: Path, root: Path) -> list[tuple[str, str, str]]:
    """(file, opening directive, the group's lines joined by " | ") per conditional group
    (#if ... #endif, nested groups inside) with a device-only name in one of its #if/#elif
    directives; (file, line, line) per other line that names one."""
    name = path.relative_to(root).as_posix()
    out: list[tuple[str, str, str]] = []
    stack: list[tuple[str, list[str], list[bool]]] = []  # (opening, lines, [device-only])
    for line in _logical_lines(path.read_text()):
        directive = re.match(r"#\s*(\w+)", line)
        kind = directive.group(1) if directive else None
        named = DEVICE_ONLY.search(line) is not None
        if kind in ("if", "ifdef", "ifndef"):
            stack.append((line, [line], [named]))
            continue
        if stack and line:
            stack[-1][1].append(line)
        if kind in ("elif", "elifdef", "elifndef") and stack:
            stack[-1][2][0] |= named
        elif kind == "endif" and stack:
            opening, lines, device_only = stack.pop()
            if device_only[0]:
                out.append((name, opening, " | ".join(lines)))
            if stack:
                stack[-1][1].extend(lines)
        elif kind != "else" and named:
            out.append((name, line, line))
    return out


def test_no_device_only_branch_escapes_the_layer() -> None:
    """No code of csrc/ is selected by __CUDA_ARCH__, __CUDACC__ or another name that only nvcc
    (or only the host layer) defines, outside ALLOWED_DEVICE_BRANCHES: the layer compiles the
    kernels with the C++ compiler, so such a branch is never executed here, and the CPU
    kernels never compile it either (a GPU-only hysteresis counter that goes below 0, a cap
    computed in float32 on the device only, passed every test).  Arithmetic that must differ
    on a GPU goes under AMPFUSED_CUDA_INTRINSICS, over host definitions of the intrinsics it
    needs (host_cuda/intrinsics.h), which the layer compiles and runs."""
    root = Path(__file__).resolve().parents[1] / "csrc"
    seen: dict[tuple[str, str], int] = {}
    problems = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cuh", ".cu", ".cpp") or "host_cuda" in path.parts:
            continue
        for name, opening, group in _device_only_uses(path, root):
            key = (name, opening)
            seen[key] = seen.get(key, 0) + 1
            allowed = ALLOWED_DEVICE_BRANCHES.get(key)
            if allowed is None or seen[key] > 1:
                problems.append(f"{name}: {opening}")
            elif allowed[0] is not None and group != allowed[0]:
                problems.append(f"{name}: {opening} ... changed to: {group}")
    assert not problems, (
        "code selected by a name that nvcc's device pass, nvcc or the host layer alone defines, "
        "which the host execution layer therefore never runs against the CPU kernels (put "
        "GPU-only arithmetic under AMPFUSED_CUDA_INTRINSICS, with host definitions in "
        "csrc/host_cuda/intrinsics.h; a new seam goes in ALLOWED_DEVICE_BRANCHES with its "
        "reason):\n  " + "\n  ".join(problems)
    )
    assert set(seen) == set(ALLOWED_DEVICE_BRANCHES), set(ALLOWED_DEVICE_BRANCHES) - set(seen)


# ----------------------------------------------------------------------------- the GPU day
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the check itself on a GPU machine")
def test_ci_gpu_stops_at_once_without_a_gpu() -> None:
    """.ci/gpu on a machine without a GPU: exit 2 and a message that says where to run it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        ["bash", str(root / ".ci" / "gpu"), sys.executable],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "no CUDA GPU visible" in r.stderr and "only on a GPU machine" in r.stderr
    assert not (root / "benchmarks" / "results" / "cuda").exists()
