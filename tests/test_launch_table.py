"""The CUDA launch's work list (csrc/launch_table.*), tested on the CPU through the private op
``ampfused::_launch_table``, and the CUDA passes that depend on it: multi-launch passes and CUDA
graph capture (skipped without a GPU).

The work list is plain host code: every tensor is cut into items of at most ``CHUNK`` elements
(16 bytes: data pointer, element count, dtype), zero-size tensors give none, and the items go to
the kernel by value, up to a launch capacity; every launch but the last is full and of the
largest capacity, the last takes the smallest capacity that holds what is left."""

from __future__ import annotations

import struct

import pytest
import torch

import ampfused  # noqa: F401  (loads the private ops)

CHUNK = 65536
CAPACITIES = (256, 2032)
# c10::ScalarType codes
SCALAR_TYPE = {torch.float16: 5, torch.float32: 6, torch.float64: 7, torch.bfloat16: 15}


Launch = tuple[int, list[tuple[int, int, int]]]


def decode(tensors: list[torch.Tensor]) -> tuple[int, list[Launch]]:
    """Decodes ``_launch_table``: (uniform dtype code or -1, per launch (capacity, [(data
    pointer, numel, dtype code)]))."""
    raw = torch.ops.ampfused._launch_table(tensors).numpy().tobytes()
    (uniform,) = struct.unpack_from("<q", raw, 0)
    out, pos = [], 8
    while pos < len(raw):
        capacity, count = struct.unpack_from("<qq", raw, pos)
        pos += 16
        # (pointer, numel, dtype, island): no island in these passes
        items = [struct.unpack_from("<QIhH", raw, pos + 16 * i) for i in range(count)]
        assert all(item[3] == 0 for item in items)
        items = [item[:3] for item in items]
        pos += 16 * count
        out.append((capacity, items))
    return uniform, out


def launches(tensors: list[torch.Tensor]) -> list[Launch]:
    return decode(tensors)[1]


def expected_items(tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    items = []
    for t in tensors:
        for start in range(0, t.numel(), CHUNK):
            items.append(
                (
                    t.data_ptr() + start * t.element_size(),
                    min(CHUNK, t.numel() - start),
                    SCALAR_TYPE[t.dtype],
                )
            )
    return items


def all_items(plan) -> list[tuple[int, int, int]]:
    return [item for _, items in plan for item in items]


@pytest.mark.parametrize(
    "numel", [1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1, 3 * CHUNK - 1]
)
def test_items_at_chunk_boundaries(numel):
    t = torch.empty(numel)
    plan = launches([t])
    assert all_items(plan) == expected_items([t])
    assert [n for _, n, _ in all_items(plan)][-1] == numel - (len(all_items(plan)) - 1) * CHUNK


def test_mixed_dtypes_and_views_keep_their_order_pointers_and_dtype():
    base = torch.empty(3 * CHUNK + 5, dtype=torch.float64)
    tensors = [
        torch.empty(7, dtype=torch.float16),
        torch.empty(CHUNK + 3, dtype=torch.bfloat16),
        base[1:],  # misaligned view: items start at its data pointer, not the storage's
        torch.empty(CHUNK, dtype=torch.float32),
    ]
    assert all_items(launches(tensors)) == expected_items(tensors)


def test_zero_size_tensors_give_no_items():
    tensors = [torch.empty(0), torch.empty(3), torch.empty(0, 4), torch.empty(CHUNK + 1)]
    items = all_items(launches(tensors))
    assert items == expected_items(tensors)
    assert len(items) == 3


@pytest.mark.parametrize("tensors", [[], [torch.empty(0)], [torch.empty(0)] * 3], ids=len)
def test_empty_pass_is_one_launch_of_no_items(tensors):
    # The fused pass still has to write found_inf and the scale: one launch, smallest class.
    assert launches(tensors) == [(CAPACITIES[0], [])]


@pytest.mark.parametrize("count", [1, 16, 17, 256, 257, 2031, 2032, 2033, 2032 + 256, 4064, 4065])
def test_launch_capacities(count):
    tensors = [torch.empty(1) for _ in range(count)]
    plan = launches(tensors)
    assert all_items(plan) == expected_items(tensors)
    *full, (last_capacity, last_items) = plan
    for capacity, items in full:  # every launch but the last: full, largest class
        assert (capacity, len(items)) == (CAPACITIES[-1], CAPACITIES[-1])
    assert 0 < len(last_items) <= last_capacity
    smaller = [c for c in CAPACITIES if c < last_capacity]
    assert not smaller or len(last_items) > smaller[-1], "not the smallest class that fits"


def test_big_tensor_spans_launches():
    # One tensor of more items than a launch holds (266 MB, never touched: empty() maps no pages).
    t = torch.empty((CAPACITIES[-1] + 3) * CHUNK - 1, dtype=torch.float16)
    tensors = [torch.empty(5), t]
    plan = launches(tensors)
    assert all_items(plan) == expected_items(tensors)
    assert [(c, len(items)) for c, items in plan] == [
        (CAPACITIES[-1], CAPACITIES[-1]),
        (CAPACITIES[0], 4),
    ]


@pytest.mark.parametrize(
    "dtypes, uniform",
    [
        ((torch.float32, torch.float32), SCALAR_TYPE[torch.float32]),
        ((torch.float16,), SCALAR_TYPE[torch.float16]),
        ((torch.float32, torch.float64), -1),
        ((torch.bfloat16, torch.float32, torch.float32), -1),
        ((), -1),
    ],
    ids=str,
)
def test_uniform_dtype_picks_the_single_dtype_kernel(dtypes, uniform):
    # Only a pass whose items all have one dtype may take the kernel compiled for it alone;
    # zero-size tensors give no item, so their dtype does not count.
    tensors = [torch.empty(3, dtype=dt) for dt in dtypes] + [torch.empty(0, dtype=torch.float64)]
    assert decode(tensors)[0] == uniform


def test_bench_op_reports_a_time():
    tensors = [torch.empty(16) for _ in range(10)]
    for realloc in (False, True):
        assert torch.ops.ampfused._bench_launch_table(tensors, 10, realloc) > 0.0


# --- CUDA: passes of several launches, and CUDA graph capture -------------------------------
# Oracle: the same op on CPU copies (the CPU kernel is checked against torch in test_ops.py;
# torch's own CUDA op has no bfloat16).

GROWTH, BACKOFF, INTERVAL = 2.0, 0.5, 3


class State:
    """The fused pass's one-element state tensors."""

    def __init__(self, device: str = "cuda", scale: float = 2.0**16, tracker: int = 1):
        self.found = torch.full((), 7.0, device=device)  # overwritten by every fused pass
        self.scale = torch.full((), scale, device=device)
        self.tracker = torch.full((), tracker, dtype=torch.int32, device=device)
        self.next_scale = torch.full((), -1.0, device=device)
        self.next_tracker = torch.full((), -1, dtype=torch.int32, device=device)

    def fused(self, grads: list[torch.Tensor], check_only: bool = False) -> None:
        torch.ops.ampfused.unscale_update_scale_(
            grads, self.found, self.scale, self.tracker, self.next_scale, self.next_tracker,
            GROWTH, BACKOFF, INTERVAL, check_only, False,
        )  # fmt: skip

    def values(self) -> tuple[float, float, int]:
        return self.found.item(), self.next_scale.item(), self.next_tracker.item()


MIXED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
FLOAT32 = (torch.float32,)  # takes the float32-only kernel


def grad_set(count: int, seed: int, dtypes=MIXED, device: str = "cuda") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [(i * 37 + 5) % 300 + (CHUNK + 1 if i % 97 == 3 else 0) for i in range(count)]
    cpu = [
        torch.randn(n, generator=g).to(dtypes[i % len(dtypes)]) * 1e3 for i, n in enumerate(sizes)
    ]
    return [t.to(device) for t in cpu]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert torch.equal(bits(a.cpu()), bits(e.cpu())), f"grads[{i}] differs"


def with_inf(grads: list[torch.Tensor], where: int | None) -> list[torch.Tensor]:
    out = [t.clone() for t in grads]
    if where is not None:
        nonempty = [t for t in out if t.numel()]
        nonempty[where][-1] = float("inf")
    return out


def cpu_fused(grads: list[torch.Tensor], check_only: bool = False):
    """(grads after the fused pass, (found, next_scale, next_tracker)), computed on the CPU."""
    cpu, state = [t.cpu() for t in grads], State("cpu")
    state.fused(cpu, check_only)
    return cpu, state.values()


@pytest.mark.cuda
@pytest.mark.parametrize("dtypes", [MIXED, FLOAT32], ids=["mixed", "float32"])
@pytest.mark.parametrize("where", [None, 0, 1000, 2500, -1], ids=lambda w: f"inf@{w}")
@pytest.mark.parametrize("check_only", [False, True], ids=["unscale", "check_only"])
def test_multi_launch_pass_matches_cpu(where, check_only, dtypes):
    # 4,200 tensors, some of two items: two full launches and a third; the inf lands in the
    # first, second or last, so the flag has to cross launches through the workspace.
    grads = with_inf(grad_set(4200, 1, dtypes), where)
    expected, expected_state = cpu_fused(grads, check_only)
    state = State()
    state.fused(grads, check_only)
    assert_same_bits(grads, expected)
    assert state.values() == expected_state
    assert expected_state[0] == float(where is not None)
    # The next pass on this stream starts from a zeroed workspace: no stale flag.
    state.fused(grad_set(4200, 2, dtypes), check_only=True)
    assert state.values()[0] == 0.0


@pytest.mark.cuda
@pytest.mark.parametrize("dtypes", [MIXED, FLOAT32], ids=["mixed", "float32"])
@pytest.mark.parametrize("count", [40, 4200], ids=["one-launch", "multi-launch"])
def test_captured_pass_on_new_tensors_survives_churn(count, dtypes):
    src = grad_set(count, 3, dtypes)
    static_in = [torch.empty_like(t) for t in src]  # never seen by an op before the capture
    state = State()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Allocated inside the capture, as a whole-step capture allocates its gradients.
        work = [t * 1 for t in static_in]
        state.fused(work)
    # Churn: many other gradient sets, allocated, passed through the ops and freed.
    for seed in range(40):
        other = grad_set(50 + seed, 100 + seed)
        State().fused(other)
        torch.ops.ampfused.non_finite_check_and_unscale_(
            other, torch.zeros((), device="cuda"), torch.full((), 0.5, device="cuda")
        )
        del other
    for where in (None, 5, None, -1):  # clean and inf replays alternate: no stale flag
        inputs = with_inf(src, where)
        for s, t in zip(static_in, inputs, strict=True):
            s.copy_(t)
        graph.replay()
        expected, expected_state = cpu_fused(inputs)
        assert_same_bits(work, expected)
        assert state.values() == expected_state
        assert expected_state[0] == float(where is not None)


@pytest.mark.cuda
def test_captured_unscale_sets_found_inf_on_replay():
    src = grad_set(20, 4)
    static_in = [t.clone() for t in src]
    found = torch.zeros((), device="cuda")
    inv = torch.full((), 0.25, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.ampfused.non_finite_check_and_unscale_(static_in, found, inv)
    for where in (None, 3):
        inputs = with_inf(src, where)
        for s, t in zip(static_in, inputs, strict=True):
            s.copy_(t)
        found.zero_()
        graph.replay()
        expected, cpu_found = [t.cpu() for t in inputs], torch.zeros(())
        torch.ops.ampfused.non_finite_check_and_unscale_(expected, cpu_found, inv.cpu())
        assert_same_bits(static_in, expected)
        assert found.item() == cpu_found.item() == float(where is not None)
