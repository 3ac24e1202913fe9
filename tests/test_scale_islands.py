"""Scale islands (``GradScaler(policy="headroom", islands=...)``, :mod:`ampfused.scale_islands`).

Exactness: an island's backward runs at the global scale times a power of two, so in float32
(where nothing leaves the range) the gradients after ``unscale_`` equal, bit for bit, those of
``torch.amp.GradScaler`` at the same global scale, and before ``unscale_`` each island
parameter's gradient is exactly the reference's times its island's factor (which shows that
factor was in force).  The factors are forced (:func:`force`) to powers of two far from 1 and
different for nested islands.  The shapes: a residual inside and around the island, an output
with two consumers, inputs that need no gradient and keyword tensors, nesting, an island called
twice, a Sequential island, accumulation over two backward passes, two optimizers sharing an
island, and the fused clip.

Where an island's input is read more than once inside it and also outside it, autograd sums
its gradient in another grouping: equal to the same islands at factor 1, within rounding of
torch's (:func:`test_regrouped_sums_differ_only_by_rounding`); the exactness models avoid it.

Then: the refusals (exception type, message naming the fix, nothing changed: no hook left on
the model), checkpoints (state_dict round trip bit for bit, watch() again, a malformed entry
refused before anything changes, deepcopy and pickle), ``islands="auto"`` on a float16 model
with a quiet block, an overflow in the loss and inside an island, and the global scale reading
nothing inside the islands.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import ampfused
from ampfused._scale_state import STATE_SIZE
from ampfused.scale_islands import CHECKPOINT_KEY

F16 = torch.float16


# ------------------------------------------------------------------------------- helpers
def scaler_with(islands: object, **kwargs: object) -> ampfused.GradScaler:
    return ampfused.GradScaler("cpu", policy="headroom", islands=islands, **kwargs)


def island_factor(name: str, factors: dict[str, float]) -> float:
    """A parameter's factor: its innermost island's (1 outside every island); computed from the
    names here, not from the implementation's tables."""
    module = name.rsplit(".", 1)[0]
    holding = [n for n in factors if module == n or module.startswith(n + ".")]
    return factors[max(holding, key=len)] if holding else 1.0


def force(scaler: ampfused.GradScaler, factors: dict[str, float]) -> None:
    """Put each island's scale at the global scale times the given factor (a power of two);
    the factors then in force are checked."""
    islands = scaler._island_set.islands
    assert islands is not None and islands.state is not None, "force after a first iteration"
    wanted = torch.tensor([factors[n] for n in islands.names], dtype=torch.float32)
    islands.scales().copy_(scaler._scale * wanted)
    islands.refresh(scaler._scale)
    assert islands.factors() == factors


def warm_up(scaler: ampfused.GradScaler, model: nn.Module, loss_fn: Callable, opts: list) -> None:
    """One iteration without a step: the scale and each island's state exist after it."""
    scaler.scale(loss_fn(model)).backward()
    for opt in opts:
        scaler.unscale_(opt)
    scaler.update()
    model.zero_grad(set_to_none=True)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for n in want:
        assert torch.equal(got[n], want[n]), f"{what}: {n} differs"


class Exactness:
    """A model with islands and its copy under torch's scaler at the same global scale."""

    def __init__(
        self,
        model: nn.Module,
        islands: list[str],
        factors: dict[str, float],
        loss_fn: Callable,
        make_opts: Callable = lambda m: [torch.optim.SGD(m.parameters(), lr=0.1)],
    ) -> None:
        self.model, self.ref = model, copy.deepcopy(model)
        self.loss_fn, self.factors = loss_fn, factors
        self.opts, self.ref_opts = make_opts(self.model), make_opts(self.ref)
        self.scaler = scaler_with(islands, init_scale=2.0**10)
        self.scaler.watch(self.model, activations=True)
        warm_up(self.scaler, self.model, loss_fn, self.opts)
        assert any(f != 1.0 for f in factors.values())
        self.begin()

    def begin(self) -> None:
        """Before an iteration: the factors forced, torch's scaler (a new one: its optimizers
        hold no scaler state) at the global scale."""
        force(self.scaler, self.factors)
        self.ref_scaler = torch.amp.GradScaler("cpu", init_scale=self.scaler.get_scale())

    def backward(self, *args: object) -> None:
        self.scaler.scale(self.loss_fn(self.model, *args)).backward()
        self.ref_scaler.scale(self.loss_fn(self.ref, *args)).backward()

    def check_scaled(self) -> None:
        """Before unscale_: each island parameter's gradient is the reference's times its
        factor (the factor was in force), every other one is the reference's."""
        want = {n: g * island_factor(n, self.factors) for n, g in grads(self.ref).items()}
        assert_same(grads(self.model), want, "scaled gradients")
        moved = [n for n in want if island_factor(n, self.factors) != 1.0]
        assert moved, "no parameter carried a factor"

    def unscale(self) -> None:
        for opt, ref_opt in zip(self.opts, self.ref_opts, strict=True):
            self.scaler.unscale_(opt)
            self.ref_scaler.unscale_(ref_opt)
        assert_same(grads(self.model), grads(self.ref), "unscaled gradients")

    def iterations(self, seeds: tuple[int, ...]) -> None:
        """A full iteration per seed (the factors hold across the updates between them):
        factors forced, backward, scaled and unscaled gradients and the step compared."""
        for seed in seeds:
            self.begin()
            self.backward(seed)
            self.check_scaled()
            self.unscale()
            self.step()
            self.model.zero_grad(set_to_none=True)
            self.ref.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Step, update, and compare the parameters."""
        for opt, ref_opt in zip(self.opts, self.ref_opts, strict=True):
            self.scaler.step(opt)
            self.ref_scaler.step(ref_opt)
        self.scaler.update()
        self.ref_scaler.update()
        for (n, p), q in zip(self.model.named_parameters(), self.ref.parameters(), strict=True):
            assert torch.equal(p, q), f"parameter {n} after the step"


def mse(model: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 6, generator=g)
    y = torch.randn(16, 3, generator=g)
    return ((model(x) - y) ** 2).mean()


# ------------------------------------------------------------------------------- models
class Residual(nn.Module):
    """x + b(relu(a(x))): the residual addition inside the island."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Around(nn.Module):
    """A residual around the island: h + block(h), block a Sequential reading h once."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.block(h))


class Inside(nn.Module):
    """A residual inside the island: block is x + b(relu(a(x))), its input read only there."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = Residual()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


class Both(nn.Module):
    """h + block(h) with block = Residual: h's gradient sums three contributions, two from
    inside the island (summed first, at the island's scale) and one from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = Residual()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.block(h))


class TwoConsumers(nn.Module):
    """The island's output read by two heads and by the residual path."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Linear(8, 8)
        self.head1 = nn.Linear(8, 3)
        self.head2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.block(self.inp(x))
        return self.head1(z) + torch.tanh(self.head2(z)) + z[:, :3]


class Mixed(nn.Module):
    """An island given a tensor that needs no gradient, an int, a tuple holding a tensor that
    does, and a keyword tensor that does."""

    def forward(
        self, x: torch.Tensor, const: torch.Tensor, k: int, pair: tuple, *, gate: torch.Tensor
    ) -> torch.Tensor:
        return self.lin(x * const + pair[0]) * torch.sigmoid(gate) + k * pair[1]

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)


class WithMixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.side = nn.Linear(6, 8)
        self.block = Mixed()
        self.out = nn.Linear(8, 3)
        self.register_buffer("const", torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, s = self.inp(x), self.side(x)
        pair = (s, torch.ones(8))  # (the second needs no gradient)
        return self.out(self.block(h, self.const, 3, pair, gate=s * 0.5))


class Block(nn.Module):
    """own(relu(inner(h))) + h, inner reading h once."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.own = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.own(torch.relu(self.inner(h))) + h


class NestedNet(nn.Module):
    """block (an island) holds inner (an island) and a Linear of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = Block()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


class Twice(nn.Module):
    """The island module called twice in one forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = Residual()
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(torch.tanh(self.block(self.inp(x)))))


def sequential_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)),
        nn.Linear(8, 3),
    )


# ------------------------------------------------------------------------------- 1. exactness
@pytest.mark.parametrize(
    ("make", "islands", "factors"),
    [
        pytest.param(Inside, ["block"], {"block": 32.0}, id="residual-inside"),
        pytest.param(Around, ["block"], {"block": 32.0}, id="residual-around"),
        pytest.param(Inside, ["block"], {"block": 2.0**-3}, id="factor-below-1"),
        pytest.param(TwoConsumers, ["block"], {"block": 64.0}, id="two-consumers"),
        pytest.param(WithMixed, ["block"], {"block": 16.0}, id="no-grad-and-kwarg-inputs"),
        pytest.param(
            NestedNet,
            ["block.inner", "block"],
            {"block": 8.0, "block.inner": 256.0},
            id="nested",
        ),
        pytest.param(
            NestedNet,
            ["block", "block.inner"],
            {"block": 16.0, "block.inner": 0.25},
            id="nested-inner-lower",
        ),
        pytest.param(Twice, ["block"], {"block": 128.0}, id="called-twice"),
        pytest.param(sequential_net, ["1"], {"1": 32.0}, id="sequential"),
    ],
)
def test_exact_gradients(make: Callable, islands: list[str], factors: dict) -> None:
    torch.manual_seed(0)
    run = Exactness(make(), islands, factors, mse)
    run.iterations((1, 2))


def summed(model: nn.Module, seed: int = 0) -> torch.Tensor:
    return model(torch.randn(16, 6, generator=torch.Generator().manual_seed(seed))).sum()


@pytest.mark.parametrize("island", ["2", "1"], ids=["leaf-at-the-output", "block"])
def test_exact_with_the_outputs_sum_as_loss(island: str) -> None:
    """loss = model(x).sum(): the gradient reaching the last output is expanded (its elements
    share memory); the edges measure it as its elements, and the gradients are exact."""
    torch.manual_seed(0)
    run = Exactness(sequential_net(), [island], {island: 32.0}, summed)
    run.iterations((1, 2))


class SameTwice(nn.Module):
    """An island returning one tensor twice: a container (a Linear inside) or a leaf (its own
    weight); the two are summed outside it."""

    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.leaf = leaf
        if leaf:
            self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        else:
            self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ self.weight if self.leaf else self.lin(x)
        return y, y


class TwiceOut(nn.Module):
    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blk = SameTwice(leaf)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.blk(torch.tanh(self.inp(x)))
        return self.head(a + b)


@pytest.mark.parametrize("leaf", [False, True], ids=["container", "leaf"])
def test_exact_when_an_island_returns_a_tensor_twice(leaf: bool) -> None:
    """One factor per tensor: an output holding the same tensor twice is not scaled twice."""
    torch.manual_seed(0)
    run = Exactness(TwiceOut(leaf), ["blk"], {"blk": 16.0}, mse)
    run.iterations((1, 2))


def test_a_container_islands_last_child_is_traced_at_the_islands_scale() -> None:
    """A container island whose output is its last child's output: the child's traced output
    gradient is at the island's scale (the factor applied before the child's hook), as the
    global magnitude and the report take it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    x = torch.randn(4, 6)
    scaler = scaler_with(["1"], init_scale=2.0**10).watch(model, activations=True)
    warm_up(scaler, model, lambda m: m(x).square().sum(), [torch.optim.SGD(model.parameters())])
    force(scaler, {"1": 16.0})
    scale = scaler.get_scale()
    out = model(x)
    scaler.scale(out.square().sum()).backward()
    rows = {a.module: a for a in scaler._watch.report_activations() if a.direction == "backward"}
    want = 2.0 * out.detach().abs().max().item() * scale  # (d(scale * sum(out^2)) / d out, exact)
    assert rows["1.1"].abs_max == want * 16.0, (rows["1.1"].abs_max, want)


class Checkpointed(nn.Module):
    """Block inside torch.utils.checkpoint (non-reentrant): its forward runs again in backward,
    hooks and all."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return self.head(h)


@pytest.mark.parametrize("islands", [["block"], ["block.own"]], ids=["the-region", "inside-it"])
def test_exact_under_activation_checkpointing(islands: list[str]) -> None:
    """An island in (or being) a checkpointed region: the recomputed forward installs the edge
    hooks again, and each gradient is still scaled once: exact against torch's scaler."""
    torch.manual_seed(0)
    run = Exactness(Checkpointed(), islands, {islands[0]: 64.0}, mse)
    run.iterations((1, 2))


def test_exact_accumulation_over_two_backward_passes() -> None:
    torch.manual_seed(0)
    factors = {"block": 64.0}
    run = Exactness(Around(), ["block"], factors, mse)
    run.backward(1)
    run.backward(2)
    run.check_scaled()
    run.unscale()
    run.step()


def test_exact_two_optimizers_sharing_an_island() -> None:
    torch.manual_seed(0)

    def make_opts(m: nn.Module) -> list:
        first = [m.inp.weight, m.block[0].weight, m.block[2].bias, m.out.bias]
        rest = [p for p in m.parameters() if all(p is not q for q in first)]
        return [torch.optim.SGD(first, lr=0.1), torch.optim.SGD(rest, lr=0.05, momentum=0.9)]

    factors = {"block": 2.0**7}
    run = Exactness(Around(), ["block"], factors, mse, make_opts)
    for seed in (1, 2):
        run.begin()
        run.backward(seed)
        run.check_scaled()
        run.unscale()
        run.step()
        for opt in (*run.opts, *run.ref_opts):
            opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("max_norm", [1e-3, 1e3], ids=["clipping", "not-clipping"])
def test_exact_clip_grad_norm(max_norm: float) -> None:
    """scaler.clip_grad_norm_ with islands (unscale_ by each factor, then clip) against the
    same scaler without islands at the same global scale: the same total norm, the same
    gradients after clipping."""
    torch.manual_seed(0)
    model = Around()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = scaler_with(["block"], init_scale=2.0**10).watch(model, activations=True)
    warm_up(scaler, model, mse, [opt])
    force(scaler, {"block": 2.0**9})
    ref_scaler = ampfused.GradScaler("cpu", init_scale=scaler.get_scale())
    scaler.scale(mse(model, 1)).backward()
    ref_scaler.scale(mse(ref, 1)).backward()
    assert not torch.equal(model.block[0].weight.grad, ref.block[0].weight.grad)  # (f in force)
    total = scaler.clip_grad_norm_(opt, max_norm)
    ref_total = ref_scaler.clip_grad_norm_(ref_opt, max_norm)
    assert torch.equal(total, ref_total), (total, ref_total)
    assert_same(grads(model), grads(ref), "clipped gradients")
    scaler.step(opt)
    ref_scaler.step(ref_opt)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)


def test_regrouped_sums_differ_only_by_rounding() -> None:
    """h + block(h) with block = x + b(relu(a(x))): h's gradient sums three contributions; the
    island sums its two first (the view at its entry), then multiplies by 1/f, then adds the
    outside one, where autograd without islands adds the three in another grouping.  The
    factor changes nothing there (a run at factor 2**6 equals, bit for bit, a run with the same
    islands at factor 1); the grouping may change the last bits against torch's scaler."""
    torch.manual_seed(0)
    model = Both()
    runs = []
    for f in (2.0**6, 1.0):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = scaler_with(["block"], init_scale=2.0**10).watch(m, activations=True)
        warm_up(scaler, m, mse, [opt])
        force(scaler, {"block": f})
        scaler.scale(mse(m, 1)).backward()
        scaled = grads(m)
        scaler.unscale_(opt)
        runs.append((scaler.get_scale(), scaled, grads(m)))
    (scale, scaled, got), (scale_1, scaled_1, got_1) = runs
    assert scale == scale_1
    assert not torch.equal(scaled["block.a.weight"], scaled_1["block.a.weight"])  # (f in force)
    assert_same(got, got_1, "unscaled gradients at factor 64 against factor 1")
    ref = copy.deepcopy(model)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    ref_scaler.scale(mse(ref, 1)).backward()
    ref_scaler.unscale_(torch.optim.SGD(ref.parameters(), lr=0.1))
    for n, g in grads(ref).items():
        torch.testing.assert_close(got[n], g)


# ------------------------------------------------------------------------------- 1b. calls
class Gate(nn.Module):
    """A leaf returning its input as it came, beside its result."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w * x, x


class GateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 8), Gate(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, skip = self.mid(self.inp(x))
        return self.out(torch.tanh(a) + skip)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.own = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(torch.tanh(self.inner(x)))


class InnerAlsoOutside(nn.Module):
    """outer.inner, an island nested in outer by name, also called outside outer."""

    def __init__(self, inside: bool = True) -> None:
        super().__init__()
        self.inside = inside
        self.inp, self.outer, self.out = nn.Linear(6, 8), Outer(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        direct = self.outer.inner(h)
        return self.out(self.outer(h) + direct if self.inside else direct)


class CallsShared(nn.Module):
    """Calls a module it does not hold by name (island `b`, called inside island `a`)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self._shared = [shared]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared[0](torch.tanh(self.lin(x)))


class Siblings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.b, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.a = CallsShared(self.b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.a(self.inp(x)) + self.b(self.inp(x)))


class AlsoMakes(nn.Module):
    """Returns a tensor and what its forward made of it: the first one's gradient holds the
    island's own (through the second) beside what enters from outside."""

    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.leaf = leaf
        if leaf:
            self.w = nn.Parameter(torch.randn(8, 8) / 3)
        else:
            self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x @ self.w if self.leaf else self.lin(x)
        return h, torch.tanh(h)


class AlsoMakesNet(nn.Module):
    def __init__(self, leaf: bool) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 8), AlsoMakes(leaf), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.mid(self.inp(x))
        return self.out(a + b)


class ToComplex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(self.lin(x).reshape(*x.shape[:-1], 4, 2))


class ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 8), ToComplex(), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(self.inp(x)).abs())


@pytest.mark.parametrize(
    ("make", "islands", "factors"),
    [
        pytest.param(GateNet, ["mid"], {"mid": 64.0}, id="leaf-returning-its-input"),
        pytest.param(
            InnerAlsoOutside,
            ["outer", "outer.inner"],
            {"outer": 64.0, "outer.inner": 4.0},
            id="nested-island-also-called-outside-its-parent",
        ),
        pytest.param(
            lambda: InnerAlsoOutside(inside=False),
            ["outer", "outer.inner"],
            {"outer": 64.0, "outer.inner": 4.0},
            id="nested-island-called-only-outside-its-parent",
        ),
        pytest.param(
            Siblings, ["a", "b"], {"a": 64.0, "b": 4.0}, id="island-called-inside-another"
        ),
        pytest.param(
            lambda: AlsoMakesNet(leaf=True),
            ["mid"],
            {"mid": 64.0},
            id="leaf-returning-a-tensor-and-what-it-made-of-it",
        ),
        pytest.param(
            lambda: AlsoMakesNet(leaf=False),
            ["mid"],
            {"mid": 64.0},
            id="block-returning-a-tensor-and-what-it-made-of-it",
        ),
        pytest.param(ComplexNet, ["mid"], {"mid": 64.0}, id="complex-output-block"),
        pytest.param(ComplexNet, ["mid.lin"], {"mid.lin": 64.0}, id="complex-output-leaf"),
    ],
)
def test_exact_wherever_and_however_an_island_is_called(
    make: Callable, islands: list[str], factors: dict
) -> None:
    """An island runs at the global scale times its own factor wherever it is called (outside
    its parent by name, inside an island that is not its parent); a leaf returning its input,
    and complex outputs, keep their factor."""
    torch.manual_seed(0)
    run = Exactness(make(), islands, factors, mse)
    run.iterations((1, 2))


class Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.same: tuple = ()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.same = (q is k, k is v)
        return self.lin(q) + k * v


class SelfAttending(nn.Module):
    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 8), mid, nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        y = self.mid(h, h, h)
        return self.out(y[0] if isinstance(y, tuple) else y)


def seq_mse(model: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 3, generator=g)
    return ((model(x) - y) ** 2).mean()


def test_a_tensor_passed_twice_is_one_tensor_inside() -> None:
    """mha(x, x, x): the island receives one view, so `query is key` holds inside it as without
    islands, and nn.MultiheadAttention takes its self-attention path: exact."""
    torch.manual_seed(0)
    model = SelfAttending(Probe())
    run = Exactness(model, ["mid"], {"mid": 64.0}, seq_mse)
    assert model.mid.same == (True, True)
    torch.manual_seed(0)
    run = Exactness(
        SelfAttending(nn.MultiheadAttention(8, 2, batch_first=True)),
        ["mid"],
        {"mid": 64.0},
        seq_mse,
    )
    run.iterations((1, 2))


def test_autograd_grad_of_the_scaled_loss_carries_the_islands_factor() -> None:
    """torch's gradient-penalty recipe, autograd.grad(scaler.scale(loss), parameters): an island
    parameter's gradient comes at the scale times its factor, and divided by both (the docs'
    recipe) equals torch's divided by its scale, bit for bit."""
    torch.manual_seed(0)
    run = Exactness(Inside(), ["block"], {"block": 32.0}, mse)
    params = dict(run.model.named_parameters())
    got = torch.autograd.grad(run.scaler.scale(mse(run.model, 1)), list(params.values()))
    ref = torch.autograd.grad(run.ref_scaler.scale(mse(run.ref, 1)), list(run.ref.parameters()))
    factors = run.scaler.island_factors()
    for (name, _), g, r in zip(params.items(), got, ref, strict=True):
        divisor = run.scaler.get_scale() * island_factor(name, factors)
        assert torch.equal(g / divisor, r / run.ref_scaler.get_scale()), name


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


class Watched(nn.Module):
    """Puts a user's hook on its island's output (the first tensor of it)."""

    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 8), mid, nn.Linear(8, 3)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mid(torch.tanh(self.inp(x)))
        first = y[0] if isinstance(y, tuple) else y
        first.register_hook(lambda g: self.seen.append(g.clone()))
        return self.out(first + y[1] if isinstance(y, tuple) else first)


@pytest.mark.parametrize("several", [False, True], ids=["one-output", "several-outputs"])
def test_a_hook_on_an_islands_output_sees_what_the_docs_say(several: bool) -> None:
    """One output: the island's scale (its hook runs after the island's); several: the global
    scale (the factor is applied behind the views)."""
    torch.manual_seed(0)
    run = Exactness(Watched(Pair() if several else Outer()), ["mid"], {"mid": 8.0}, mse)
    run.model.seen.clear()
    run.ref.seen.clear()
    run.backward(1)
    (got,), (want,) = run.model.seen, run.ref.seen
    assert torch.equal(got, want if several else want * 8.0)


class InPlaceAfter(nn.Module):
    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(6, 8), mid, nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.inp(x))
        return self.out(h.relu_())


class AddsToInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.bias) * 2.0


class ReluFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act, self.lin = nn.ReLU(inplace=True), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.act(x))


def test_an_in_place_op_on_an_islands_output_outside_it() -> None:
    """An island returning one tensor keeps its factor on that tensor (the hook holds the value
    before an in-place op outside): exact, leaf and block.  One returning several returns views
    made in a Function, whose in-place modification autograd refuses: the gradient would go
    around the factor."""
    for mid in (nn.Linear(8, 8), Outer()):
        torch.manual_seed(0)
        Exactness(InPlaceAfter(mid), ["mid"], {"mid": 64.0}, mse).iterations((1,))
    torch.manual_seed(0)
    model = InPlaceAfter(AlsoMakes(leaf=False))
    model.forward = lambda x: model.out(model.mid(model.inp(x))[0].relu_())  # type: ignore
    scaler = scaler_with(["mid"])
    scaler.watch(model, activations=True)
    with pytest.raises(
        RuntimeError, match="ScaleIslandOutput(Backward)? is a view and is being modified"
    ):
        mse(model)


@pytest.mark.parametrize("mid", [AddsToInput, ReluFirst], ids=["leaf", "block"])
def test_an_island_modifying_its_input_in_place_is_refused(mid: Callable) -> None:
    """Its input's view, modified in place, would take the gradient out around the 1 / f."""
    torch.manual_seed(0)
    model = InPlaceAfter(mid())
    model.forward = lambda x: model.out(model.mid(torch.tanh(model.inp(x))))  # type: ignore
    scaler = scaler_with(["mid"])
    scaler.watch(model, activations=True)
    with pytest.raises(RuntimeError, match="'mid' modified an input in place"):
        mse(model)
    assert not scaler._island_set.islands._open


def test_a_model_moved_after_watch_is_told_to_watch_again() -> None:
    """The islands' factors live on the model's device when watch() is called: a model moved
    afterwards (built on meta, then to_empty) is told to watch again, and trains once it has."""
    with torch.device("meta"):
        model = sequential_net()
    scaler = scaler_with(["1"])
    scaler.watch(model, activations=True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)
    with pytest.raises(RuntimeError, match=r"on cpu, its factors are on meta .*watch\(model"):
        mse(model)
    scaler.watch(model, activations=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert train(model, opt, scaler, range(2), mse) == [False, False]


class SometimesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8))
        self.in_place = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.add_(self.bias) if self.in_place else x + self.bias) * 2.0


def test_an_auto_island_modifying_its_input_in_place_runs_at_the_global_scale() -> None:
    """One that "auto" chose is not refused: from the call that modifies its input it runs at
    the scale around it, that iteration included (its edges read their factors in backward),
    with a warning, and the update leaves it out; the gradients equal torch's."""
    torch.manual_seed(0)
    run = Exactness(InPlaceAfter(SometimesInPlace()), ["mid"], {"mid": 64.0}, mse)
    run.model.forward = lambda x: run.model.out(run.model.mid(run.model.inp(x) * 1.0))
    run.ref.forward = lambda x: run.ref.out(run.ref.mid(run.ref.inp(x) * 1.0))
    run.scaler._island_set.islands.forgiving = True  # (as "auto" makes them)
    run.model.mid.in_place = run.ref.mid.in_place = True
    run.begin()
    with pytest.warns(UserWarning, match="'mid' modified an input in place.*scale around it"):
        run.backward(1)
    run.unscale()
    run.step()
    assert run.scaler.island_factors() == {}
    assert run.scaler._island_set.left_out == {"mid"}


class PinnedInside(nn.Module):
    """A block holding a leaf (`b`) that modifies its input in place once `in_place` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), SometimesInPlace(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x) * 1.0))


def _pinned_run(make: Callable, islands: list[str], factors: dict) -> Exactness:
    """An Exactness run whose islands "auto" would have chosen (pinned, not refused)."""
    torch.manual_seed(0)
    run = Exactness(make(), islands, factors, mse)
    run.scaler._island_set.islands.forgiving = True
    run.begin()
    return run


def _in_place(run: Exactness, on: bool = True) -> None:
    for model in (run.model, run.ref):
        for m in model.modules():
            if isinstance(m, SometimesInPlace):
                m.in_place = on


def test_a_pinned_island_inside_another_runs_at_its_parents_scale() -> None:
    """A nested island pinned runs at its parent's scale (its edges 1), not at the global one:
    exact; the update leaves it out, its parent goes on."""
    run = _pinned_run(
        lambda: InPlaceAfter(PinnedInside()), ["mid", "mid.b"], {"mid": 16.0, "mid.b": 4.0}
    )
    run.model.forward = lambda x: run.model.out(run.model.mid(torch.tanh(run.model.inp(x))))
    run.ref.forward = lambda x: run.ref.out(run.ref.mid(torch.tanh(run.ref.inp(x))))
    _in_place(run)
    with pytest.warns(UserWarning, match="'mid.b' modified an input in place"):
        run.backward(1)
    assert run.scaler._island_set.islands.factors() == {"mid": 16.0, "mid.b": 16.0}
    run.unscale()
    run.step()
    assert list(run.scaler.island_factors()) == ["mid"]
    # the names left out go with the checkpoint (auto does not choose them again)
    saved = run.scaler.state_dict()
    assert saved[CHECKPOINT_KEY]["left_out"] == ["mid.b"]
    again = scaler_with("auto")
    again.load_state_dict(saved)
    assert again._island_set.left_out == {"mid.b"}
    with pytest.raises(ValueError, match="must be what state_dict"):
        again.load_state_dict({**saved, CHECKPOINT_KEY: {**saved[CHECKPOINT_KEY], "left_out": 3}})


def test_a_pin_in_a_later_micro_batch_moves_the_earlier_gradients() -> None:
    """Accumulation: the first backward ran the island at its factor, the second pins it; the
    gradients its parameters got first are moved to the new factor: exact."""
    run = _pinned_run(lambda: InPlaceAfter(SometimesInPlace()), ["mid"], {"mid": 16.0})
    run.model.forward = lambda x: run.model.out(run.model.mid(run.model.inp(x) * 1.0))
    run.ref.forward = lambda x: run.ref.out(run.ref.mid(run.ref.inp(x) * 1.0))
    run.backward(1)
    _in_place(run)
    with pytest.warns(UserWarning, match="modified an input in place"):
        run.backward(2)
    run.unscale()
    run.step()


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0  # (a fresh tensor for the in-place op)


class Loud(nn.Module):
    """Modifies its input in place; its output's gradient passes float16, where it overflows
    at a high scale (inside the island)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.mul_(1.0)).half().float() * 4.0


def test_an_overflow_in_a_pinned_island_backs_the_global_scale_off() -> None:
    """An overflow that starts in an island being pinned is not held as the island's (it is
    leaving): the global scale backs off, step by step as with no island at all."""

    def loss(m: nn.Module, seed: int) -> torch.Tensor:
        return mse(m, seed)

    trails = []
    for islands in (["2"], None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), Scaled(), Loud(), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = ampfused.GradScaler("cpu", policy="headroom", islands=islands, init_scale=2.0**24)
        scaler.watch(model, activations=True)
        if islands:
            scaler._island_set.islands.forgiving = True
        trail: list = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for seed in range(6):
                trail.append(train(model, opt, scaler, range(seed, seed + 1), loss)[0])
                trail.append(scaler.get_scale())
        trails.append(trail)
    assert trails[0] == trails[1] and trails[0][1] < 2.0**24, trails


class Token(nn.Module):
    """Returns one of its parameters as it is (a learned token, a positional table)."""

    def __init__(self, block: bool) -> None:
        super().__init__()
        self.tok = nn.Parameter(torch.randn(16, 8))
        if block:
            self.unused = nn.Linear(2, 2)

    def forward(self) -> torch.Tensor:
        return self.tok


class TokenNet(nn.Module):
    def __init__(self, block: bool) -> None:
        super().__init__()
        self.inp, self.t, self.out = nn.Linear(6, 8), Token(block), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)) + self.t())


@pytest.mark.parametrize("block", [False, True], ids=["leaf", "block"])
def test_an_island_returning_its_parameter_leaves_no_hook_on_it(block: bool) -> None:
    """The factor goes on a view: a hook on the parameter itself would stay there, one more
    each call."""
    torch.manual_seed(0)
    run = Exactness(TokenNet(block), ["t"], {"t": 4.0}, mse)
    run.iterations((1, 2))
    assert not run.model.t.tok._backward_hooks


class CheckpointsInside(nn.Module):
    """A block whose nested island `c` runs under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a, self.c, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.utils.checkpoint.checkpoint(self.c, h, use_reentrant=self.reentrant)
        return self.d(torch.tanh(h))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_exact_with_a_nested_island_checkpointed(reentrant: bool) -> None:
    """Reentrant checkpointing recomputes the nested island alone in backward, no island call
    open: it runs inside its parent, as it did in the forward."""
    torch.manual_seed(0)
    model = InPlaceAfter(CheckpointsInside(reentrant))
    model.forward = lambda x: model.out(model.mid(torch.tanh(model.inp(x))))
    run = Exactness(model, ["mid", "mid.c"], {"mid": 16.0, "mid.c": 4.0}, mse)
    run.ref.forward = lambda x: run.ref.out(run.ref.mid(torch.tanh(run.ref.inp(x))))
    run.iterations((1, 2))


class Remembers(nn.Module):
    """Reads a tensor set on it before its call (not an argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.memory: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.memory is not None
        return self.lin(x) + self.memory


class ReadsAWeight(nn.Module):
    """Reads the weight of a module outside it directly."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self._other = [other]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self._other[0].weight.t()


class Reads(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp, self.enc, self.out = nn.Linear(6, 8), nn.Linear(6, 8), nn.Linear(8, 3)
        self.how = how
        self.mid = Remembers() if how == "tensor" else ReadsAWeight(self.out_proj())

    def out_proj(self) -> nn.Linear:
        self.other = nn.Linear(8, 8)
        return self.other

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "tensor":
            self.mid.memory = self.enc(x)
            return self.out(self.mid(self.inp(x)))
        return self.out(self.mid(self.inp(x)) + self.other(self.enc(x)))


@pytest.mark.parametrize(
    ("how", "match"),
    [("tensor", "made before its call .* not as an input"), ("weight", "other.weight")],
)
def test_a_block_reading_what_is_not_its_own_is_refused(how: str, match: str) -> None:
    """A block island's walk finds a tensor made before its call reaching it other than as an
    input, or a parameter it does not hold: its gradient would carry the wrong factor."""
    torch.manual_seed(0)
    model = Reads(how)
    scaler = scaler_with(["mid"])
    scaler.watch(model, activations=True)
    with pytest.raises(RuntimeError, match=match):
        mse(model)
    # one "auto" chose runs at the global scale from then on, with a warning
    scaler.watch(model, activations=True)
    scaler._island_set.islands.forgiving = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match=match + ".*scale around it from now on"):
        assert train(model, opt, scaler, range(2), mse) == [False, False]
    assert scaler.island_factors() == {}
    assert CHECKPOINT_KEY not in scaler.state_dict()


class MakesALeaf(nn.Module):
    """Makes a leaf that needs a gradient inside its forward (T5's attention does, for its
    position bias, under activation checkpointing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros(8, requires_grad=True)
        return self.lin(x) + bias


def test_a_block_making_a_leaf_of_its_own_is_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), MakesALeaf(), nn.Tanh(), nn.Linear(8, 3))
    Exactness(model, ["1"], {"1": 16.0}, mse).iterations((1, 2))


def test_a_block_called_twice_under_autocast_reads_its_cached_weights() -> None:
    """autocast casts a weight once per region: the second call of a block reads the cast the
    first made (before its call), which is its own."""
    torch.manual_seed(0)
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler_with(["block"])
    scaler.watch(model, activations=True)

    def loss(m: nn.Module, seed: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=F16):
            return mse(m, seed)

    assert train(model, opt, scaler, range(3), loss) == [False, False, False]


# ------------------------------------------------------------------------------- 2. refusals
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(islands=["1"]), ValueError, r"need policy='headroom'.*pass policy='headroom'"),
        (
            dict(islands=["1"], policy="headroom", scaling=False),
            ValueError,
            r"scaling=False.*leave islands out",
        ),
        (dict(islands="bogus", policy="headroom"), ValueError, r"islands=\['bogus'\]"),
        (dict(islands=[3], policy="headroom"), TypeError, r"named_modules\(\); got 3 \(int\)"),
        (dict(islands=["1", 3], policy="headroom"), TypeError, r"got 3 \(int\)"),
        (dict(islands=5, policy="headroom"), TypeError, r"'auto' or module names, got int"),
        (dict(islands=[], policy="headroom"), ValueError, r"islands=\[\].*leave islands out"),
    ],
    ids=[
        "policy-torch",
        "scaling-false",
        "bogus",
        "int",
        "int-among-names",
        "not-iterable",
        "empty",
    ],
)
def test_constructor_refusals(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ampfused.GradScaler("cpu", **kwargs)


def hooks_of(model: nn.Module) -> list[tuple[str, int, int, int]]:
    return [
        (n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for n, m in model.named_modules()
    ]


class TiedOut(nn.Module):
    """block.lin's weight is also head's: shared by the island and a module outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 8)
        self.head.weight = self.block[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inp(x)))[:, :3]


class Stacked(nn.Module):
    """Layers in a ModuleList, called one by one (the list itself never is)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 8), nn.Linear(8, 3)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h)


@pytest.mark.parametrize(
    ("islands", "make", "match"),
    [
        pytest.param(
            ["nope"], Around, r"islands names 'nope', which the model does not have", id="unknown"
        ),
        pytest.param(
            [""], Around, r"the island '' is the whole model.*name the modules inside it", id="root"
        ),
        pytest.param(["block", "block"], Around, r"names a module twice", id="twice"),
        pytest.param(
            ["block"],
            TiedOut,
            r"head\.weight is shared by the island 'block'.*tied weights",
            id="tied",
        ),
        pytest.param(
            ["block.0"], TiedOut, r"head\.weight is shared by the island 'block\.0'", id="tied-leaf"
        ),
        pytest.param(
            ["layers"],
            Stacked,
            r"'layers', a ModuleList with no forward of its own .* name the modules inside it",
            id="container",
        ),
    ],
)
def test_watch_refusals_change_nothing(islands: list, make: Callable, match: str) -> None:
    torch.manual_seed(0)
    model = make()
    hooks = hooks_of(model)
    scaler = scaler_with(islands)
    with pytest.raises(ValueError, match=match):
        scaler.watch(model, activations=True)
    assert hooks_of(model) == hooks, "a refused watch() left hooks on the model"
    assert scaler._watch is None
    with pytest.raises(RuntimeError, match=r"no model is watched"):  # (not run without islands)
        scaler.scale(mse(model)).backward()
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))


MODEL_AND_ACTIVATIONS = r"call watch\(model, activations=True\) with the model itself"


@pytest.mark.parametrize(
    ("watch", "error", "match"),
    [
        pytest.param(lambda s, m: s.watch(m), ValueError, MODEL_AND_ACTIVATIONS, id="model"),
        pytest.param(
            lambda s, m: s.watch(m, activations=False),
            ValueError,
            MODEL_AND_ACTIVATIONS,
            id="activations-false",
        ),
        pytest.param(
            lambda s, m: s.watch(dict(m.named_parameters())),
            ValueError,
            MODEL_AND_ACTIVATIONS,
            id="dict",
        ),
        pytest.param(
            lambda s, m: s.watch(list(m.named_parameters())),
            ValueError,
            MODEL_AND_ACTIVATIONS,
            id="pairs",
        ),
        pytest.param(  # (refused by watch() itself: tracing needs the module)
            lambda s, m: s.watch(dict(m.named_parameters()), activations=True),
            TypeError,
            r"pass the torch\.nn\.Module itself",
            id="dict-activations",
        ),
    ],
)
def test_watch_needs_the_model_and_activations(watch: Callable, error: type, match: str) -> None:
    model = Around()
    hooks = hooks_of(model)
    scaler = scaler_with(["block"])
    with pytest.raises(error, match=match):
        watch(scaler, model)
    assert hooks_of(model) == hooks
    assert scaler._watch is None


def snapshot(model: nn.Module) -> tuple[list, list]:
    return (
        [p.detach().clone() for p in model.parameters()],
        [None if p.grad is None else p.grad.clone() for p in model.parameters()],
    )


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal, NaN payloads included (a float32 gradient compared as int32)."""
    if a is None or b is None:
        return a is b
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_untouched(model: nn.Module, before: tuple[list, list]) -> None:
    params, grads_before = before
    for p, q, g in zip(model.parameters(), params, grads_before, strict=True):
        assert torch.equal(p, q), "a parameter changed"
        assert same_bits(p.grad, g), "a gradient changed"


def fused_adam(params: object) -> torch.optim.Optimizer:
    try:
        return torch.optim.Adam(params, lr=0.1, fused=True)
    except (RuntimeError, ValueError) as e:  # (a torch without CPU fused Adam)
        pytest.skip(f"torch.optim.Adam(fused=True) on the CPU: {e}")


NO_WATCH = r"no model is watched; call scaler\.watch\(model, activations=True\)"
FUSED = r"fused optimizer.*use the optimizer without fused=True, or leave islands out"


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def master_weights(params: object) -> torch.optim.Optimizer:
    return ampfused.MasterWeights(torch.optim.SGD(params, lr=0.1))


@pytest.mark.parametrize(
    ("make_opt", "watched", "call", "error", "match"),
    [
        pytest.param(sgd, False, "step", RuntimeError, NO_WATCH, id="no-watch-step"),
        pytest.param(sgd, False, "unscale_", RuntimeError, NO_WATCH, id="no-watch-unscale_"),
        pytest.param(
            fused_adam, True, "step", NotImplementedError, FUSED, id="fused-step"
        ),  # (unscale_ first: allowed)
    ],
)
def test_step_refusals_change_nothing(
    make_opt: Callable, watched: bool, call: str, error: type, match: str
) -> None:
    torch.manual_seed(0)
    model = Around()
    opt = make_opt(model.parameters())
    scaler = scaler_with(["block"])
    if watched:
        scaler.watch(model, activations=True)
    scaler.scale(mse(model)).backward()
    before = snapshot(model)
    with pytest.raises(error, match=match):
        getattr(scaler, call)(opt)
    assert_untouched(model, before)
    assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"


@pytest.mark.parametrize("call", ["unscale_", "step"])
def test_cuda_graph_capture_is_refused(call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass with islands while a CUDA graph is being captured (simulated here: no GPU) is
    refused before anything changes: a replay would not run the islands' Python hooks."""
    model = Around()
    opt = sgd(model.parameters())
    scaler = scaler_with(["block"]).watch(model, activations=True)
    scaler.scale(mse(model)).backward()
    before = snapshot(model)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(NotImplementedError, match=r"CUDA graph capture with scale islands"):
        getattr(scaler, call)(opt)
    assert_untouched(model, before)
    assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"


def half_mse(model: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 6, generator=g).half()
    y = torch.randn(16, 3, generator=g).half()
    return ((model(x).float() - y.float()) ** 2).mean()


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
def test_master_weights_with_islands_equal_the_run_without(clip: bool) -> None:
    """A float16 model under MasterWeights with an island at 2^5 and 2^-3 times the global
    scale: the masters' gradients (unscaled by each island's own factor), the masters and the
    model after each step equal, bit for bit, those of the same model without islands at the
    same global scale; the island's measured rows are truly unscaled."""
    torch.manual_seed(0)
    model = Around().half()
    ref = copy.deepcopy(model)
    opt = master_weights(model.parameters())
    ref_opt = master_weights(ref.parameters())
    scaler = scaler_with(["block"], init_scale=2.0**10).watch(model, activations=True)
    warm_up(scaler, model, half_mse, [opt])
    for seed, factor in ((1, 2.0**5), (2, 2.0**-3), (3, 2.0**5)):
        scaler._scale.fill_(2.0**4)  # (every float16 gradient normal at either scale)
        force(scaler, {"block": factor})
        ref_scaler = ampfused.GradScaler("cpu", init_scale=scaler.get_scale())
        for m, s in ((model, scaler), (ref, ref_scaler)):
            s.scale(half_mse(m, seed)).backward()
        block = [p.grad for n, p in model.named_parameters() if n.startswith("block.")]
        want = [p.grad * factor for n, p in ref.named_parameters() if n.startswith("block.")]
        assert all(torch.equal(a, b) for a, b in zip(block, want, strict=True))
        for o, s in ((opt, scaler), (ref_opt, ref_scaler)):
            if clip:
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(o.master_params, 0.5)
            s.step(o)
            s.update()
        for a, b in zip(opt.master_params, ref_opt.master_params, strict=True):
            assert torch.equal(a, b) and torch.equal(a.grad, b.grad), seed
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b), seed
        # the watched statistics are of truly unscaled gradients (the islands' update reads
        # them): each parameter's largest, as its master's gradient holds it (unclipped)
        rows = {g.name: g.abs_max for g in scaler.report().grads}
        for (n, _), m in zip(model.named_parameters(), opt.master_params, strict=True):
            assert clip or rows[n] == float(m.grad.abs().max()), (seed, n)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_subclass_overriding_unscale_grads_is_refused() -> None:
    class AllReducing(ampfused.GradScaler):
        def _unscale_grads_(self, *args: object) -> object:
            return super()._unscale_grads_(*args)

    model = Around()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = AllReducing("cpu", policy="headroom", islands=["block"])
    scaler.watch(model, activations=True)
    scaler.scale(mse(model)).backward()
    before = snapshot(model)
    with pytest.raises(NotImplementedError, match=r"overrides _unscale_grads_.*GradScaler itself"):
        scaler.step(opt)
    assert_untouched(model, before)


def test_fused_optimizer_after_unscale() -> None:
    """unscale_ first, then a fused optimizer's step: the gradients are unscaled by each
    island's factor, and the step takes them as they are (as torch's scaler does)."""
    torch.manual_seed(0)
    factors = {"block": 2.0**5}
    run = Exactness(Around(), ["block"], factors, mse, lambda m: [fused_adam(m.parameters())])
    run.backward(1)
    run.check_scaled()
    run.unscale()
    run.step()


# ------------------------------------------------------------------------------- float16 models
QUIET = 2.0**-20  # how far below the rest the quiet block's gradients sit


class Quiet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class QuietNet(nn.Module):
    """quiet's output joins the residual stream multiplied by QUIET, so under float16 autocast
    the gradients inside it sit ~20 binades below the rest, many in float16's subnormals at the
    global scale; tied's too, but tied shares its weight with twin (outside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.quiet = Quiet()
        self.tied = nn.Linear(32, 32)
        self.twin = nn.Linear(32, 32)
        self.twin.weight = self.tied.weight
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.quiet(h) * QUIET
        h = h + self.tied(h) * QUIET
        return self.head(torch.tanh(self.twin(h)))


def f16_loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=g)
    y = torch.randn(64, 8, generator=g)
    with torch.autocast("cpu", dtype=F16):
        out = model(x)
    return ((out.float() - y) ** 2).mean()


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: ampfused.GradScaler,
    steps: range,
    loss_fn: Callable = f16_loss,
) -> list[bool]:
    """Iterations over the given seeds; returns whether each skipped its step."""
    skipped = []
    for seed in steps:
        scaler.scale(loss_fn(model, seed)).backward()
        scaler.unscale_(opt)
        skipped.append(scaler.report().skipped)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return skipped


def factors_of(scaler: ampfused.GradScaler) -> dict[str, float]:
    return scaler.island_factors()


def test_edges_of_many_backward_passes_are_reduced_to_the_same_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Backward passes without an update() (a loop of saliency maps) keep the edge tables to a
    bounded number, reduced per island, edge and dtype: the update then reads what it would
    have read from them all, bit for bit."""
    states = []
    for kept in (10**6, 5):
        monkeypatch.setattr(ampfused.scale_islands, "EDGES_KEPT", kept)
        model, opt, scaler = fresh(["quiet"], seed=0)
        scaler.watch(model, activations=True)
        train(model, opt, scaler, range(2))
        islands = scaler._island_set.islands
        most = 0
        for seed in range(2, 8):
            scaler.scale(f16_loss(model, seed)).backward()
            most = max(most, len(islands.edges))
        scaler.unscale_(opt)
        scaler.update()
        assert (most < 5) == (kept == 5), most
        states.append(islands.state.clone())
    assert torch.equal(states[0], states[1])
    # the reduction itself: the largest magnitude, the summed counts (inf and NaN among them)
    head = [0.0] * 7
    rows = [[1.0, 3.0, 0, 0, 1, 2, 0], [2.0, 5.0, 1, 0, 0, 0, 3], [4.0, 1.0, 0, 2, 0, 1, 1]]
    table = torch.tensor([head, *rows[:2]], dtype=torch.float64)
    islands.edges = [(1, 0, F16, table), (1, 0, F16, torch.tensor([head, rows[2]]).double())]
    islands.edges.append((1, 1, F16, table.clone()))
    islands._compact()
    assert [(k, e, d) for k, e, d, _ in islands.edges] == [(1, 0, F16), (1, 1, F16)]
    assert islands.edges[0][3].tolist() == [head, [7.0, 5.0, 1, 2, 1, 3, 4]]
    assert islands.edges[1][3].tolist() == [head, [3.0, 5.0, 1, 0, 1, 2, 3]]


# ------------------------------------------------------------------------------- 3. checkpoints
def fresh(islands: object, seed: int = 1) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = QuietNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt, scaler_with(islands)


@pytest.mark.parametrize("islands", [["quiet"], "auto"], ids=["named", "auto"])
@pytest.mark.parametrize("order", ["watch-then-load", "load-then-watch"])
def test_state_dict_round_trip(islands: object, order: str) -> None:
    model, opt, scaler = fresh(islands, seed=0)
    scaler.watch(model, activations=True)
    train(model, opt, scaler, range(4))
    saved = factors_of(scaler)
    assert saved and any(f != 1.0 for f in saved.values()), saved
    checkpoint = copy.deepcopy(
        {"scaler": scaler.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
    )
    assert checkpoint["scaler"][CHECKPOINT_KEY]["names"] == list(saved)
    train(model, opt, scaler, range(4, 7))

    model2, opt2, scaler2 = fresh(islands)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    if order == "watch-then-load":
        scaler2.watch(model2, activations=True)
        scaler2.load_state_dict(checkpoint["scaler"])
    else:
        scaler2.load_state_dict(checkpoint["scaler"])
        scaler2.watch(model2, activations=True)
    assert factors_of(scaler2) == saved  # (in force for the next forward pass)
    train(model2, opt2, scaler2, range(4, 7))
    assert scaler2.get_scale() == scaler.get_scale()
    assert factors_of(scaler2) == factors_of(scaler)
    for (n, p), q in zip(model.named_parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q), n
    assert scaler2.state_dict() == scaler.state_dict()


@pytest.mark.parametrize("again", ["watch", "unwatch-watch"])
def test_watching_again_keeps_the_factors(again: str) -> None:
    """watch() again (or unwatch() then watch()) on the same model: the islands' states go on,
    as in a run that did not call it (bit for bit)."""
    model, opt, scaler = fresh(["quiet"], seed=0)
    scaler.watch(model, activations=True)
    model2, opt2, scaler2 = fresh(["quiet"], seed=0)
    scaler2.watch(model2, activations=True)
    train(model, opt, scaler, range(4))
    train(model2, opt2, scaler2, range(4))
    factors = factors_of(scaler)
    assert any(f != 1.0 for f in factors.values())
    if again == "unwatch-watch":
        scaler2.unwatch()
    scaler2.watch(model2, activations=True)
    assert factors_of(scaler2) == factors
    assert hooks_of(model2) == hooks_of(model)  # (the old hooks gone)
    train(model, opt, scaler, range(4, 6))
    train(model2, opt2, scaler2, range(4, 6))
    assert factors_of(scaler2) == factors_of(scaler)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


ROW = [0] * STATE_SIZE


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param("quiet", id="a-string"),
        pytest.param({"names": ["quiet"]}, id="no-states"),
        pytest.param({"names": "quiet", "states": [ROW]}, id="names-not-a-list"),
        pytest.param({"names": ["quiet"], "states": [ROW[:3]]}, id="short-row"),
        pytest.param({"names": ["quiet"], "states": [[0.5] * STATE_SIZE]}, id="floats"),
        pytest.param({"names": ["quiet", "head"], "states": [ROW]}, id="rows-fewer-than-names"),
    ],
)
def test_malformed_checkpoint_changes_nothing(entry: object) -> None:
    model, opt, scaler = fresh(["quiet"], seed=0)
    scaler.watch(model, activations=True)
    train(model, opt, scaler, range(3))
    good = scaler.state_dict()
    bad = copy.deepcopy(good)
    bad["scale"] = good["scale"] * 4  # (would be loaded first, were the entry not checked first)
    bad[CHECKPOINT_KEY] = entry
    factors = factors_of(scaler)
    with pytest.raises(ValueError, match=r"state_dict\['ampfused_islands'\] must be"):
        scaler.load_state_dict(bad)
    assert scaler.state_dict() == good
    assert factors_of(scaler) == factors


@pytest.mark.parametrize("order", ["watched", "not-watched"])
def test_checkpoint_of_other_islands_is_refused(order: str) -> None:
    """A checkpoint whose islands are not the scaler's is refused (ValueError naming both),
    before anything changes, where the scaler's islands are known: named ones, or chosen."""
    model, opt, scaler = fresh(["quiet"], seed=0)
    scaler.watch(model, activations=True)
    train(model, opt, scaler, range(3))
    other = copy.deepcopy(scaler.state_dict())
    other[CHECKPOINT_KEY]["names"] = ["head"]
    model2, opt2, scaler2 = fresh(["quiet"])
    if order == "watched":
        scaler2.watch(model2, activations=True)
    before = scaler2.state_dict()
    with pytest.raises(ValueError, match=r"checkpoint's scale islands are \['head'\]"):
        scaler2.load_state_dict(other)
    assert scaler2.state_dict() == before


@pytest.mark.parametrize(
    "clone", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))], ids=["deepcopy", "pickle"]
)
def test_copy_and_pickle_keep_the_factors(clone: Callable) -> None:
    """A copy holds the islands' argument and rows (no model, no hooks); watched on a model
    loaded with the same weights it goes on as the original, bit for bit."""
    model, opt, scaler = fresh(["quiet"], seed=0)
    scaler.watch(model, activations=True)
    train(model, opt, scaler, range(4))
    factors = factors_of(scaler)
    assert any(f != 1.0 for f in factors.values())
    copied = clone(scaler)
    assert copied._island_set is not scaler._island_set
    model2, opt2, _ = fresh(["quiet"])
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # (else the buffers are shared)
    copied.watch(model2, activations=True)
    assert factors_of(copied) == factors
    train(model, opt, scaler, range(4, 6))
    train(model2, opt2, copied, range(4, 6))
    assert copied.get_scale() == scaler.get_scale()
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_copy_of_the_model_runs_at_the_global_scale_untouched() -> None:
    """copy.deepcopy of a watched model copies the islands' and the tracer's hooks with it; the
    copy is not the island (its parameters are not the scaler's): trained, its gradients equal
    bit for bit those of a copy with no hooks at all, and nothing of it is recorded.  A
    torch.nn.DataParallel replica (marked ``_is_replica``) is refused."""
    model, opt, scaler = fresh(["quiet"], seed=0)
    scaler.watch(model, activations=True)
    train(model, opt, scaler, range(3))
    assert factors_of(scaler)["quiet"] != 1.0
    copied = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    for m in plain.modules():
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    scaler.scale(f16_loss(model, 3)).backward()  # (an iteration open: the copy joins nothing)
    islands, tracer = scaler._island_set.islands, scaler._watch.tracer
    edges, rows = len(islands.edges), len(tracer.now)
    for m in (copied, plain):
        m.zero_grad(set_to_none=True)
        (f16_loss(m, 3) * 1024.0).backward()
    assert (len(islands.edges), len(tracer.now)) == (edges, rows)
    assert_same(grads(copied), grads(plain), "the copy's gradients")
    replica = copy.deepcopy(model)
    replica.quiet._is_replica = True
    with pytest.raises(NotImplementedError, match="DataParallel replica.*DistributedDataParallel"):
        f16_loss(replica, 3)


class LaterQuiet(nn.Module):
    """QuietNet's shape without tied weights, and a gain on `late`'s output that a test lowers
    during training: `late` joins the quiet ones only then."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.quiet = Quiet()
        self.late = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)
        self.gain = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + self.quiet(h) * QUIET
        h = h + self.late(h) * self.gain
        return self.head(torch.tanh(h))


def test_auto_looks_again_and_resumes_across_the_review(tmp_path: Path) -> None:
    """islands="auto" looks again after AUTO_REVIEW[0] updates: a module whose gradients fell
    below the rest since the first choice joins (the first islands keep their factors), and a
    run resumed from a checkpoint taken before the review equals the uninterrupted one bit for
    bit after it."""
    from ampfused.scale_islands import AUTO_REVIEW

    def build() -> tuple:
        torch.manual_seed(0)
        model = LaterQuiet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        return model, opt, scaler_with("auto").watch(model, activations=True)

    def run(model: nn.Module, opt: object, scaler: object, steps: range) -> None:
        for seed in steps:
            model.gain = 1.0 if seed < 3 else QUIET  # (late goes quiet after the first choice)
            train(model, opt, scaler, range(seed, seed + 1))

    model, opt, scaler = build()
    run(model, opt, scaler, range(4))
    first = set(scaler.island_factors())
    assert first and not any(n.startswith("late") for n in first), first
    checkpoint = copy.deepcopy(
        {"scaler": scaler.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
    )
    before = scaler.island_factors()
    end = AUTO_REVIEW[0] + 4
    run(model, opt, scaler, range(4, end))
    after = scaler.island_factors()
    assert "late" in after, after  # (joined at the review)
    assert set(after) - {"late"} == first

    model2, opt2, scaler2 = build()
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    scaler2.load_state_dict(checkpoint["scaler"])
    assert scaler2.island_factors() == before
    run(model2, opt2, scaler2, range(4, end))
    assert scaler2.island_factors() == after
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    assert scaler2.state_dict() == scaler.state_dict()


# ------------------------------------------------------------------------------- 4. auto, overflow
def quiet_rows(report: object) -> list:
    return [
        a
        for a in report.activations
        if a.direction == "backward" and (a.module == "quiet" or a.module.startswith("quiet."))
    ]


def subnormal_share(rows: list) -> float:
    subnormal = sum(a.subnormal for a in rows)
    nonzero = sum(a.numel - a.zeros - a.non_finite for a in rows)
    return subnormal / nonzero


def test_auto_chooses_inside_the_quiet_block_and_lifts_it() -> None:
    """islands="auto" chooses quiet (a block of quiet leaves, with the leaves nested in it),
    never tied (its weight is twin's too); the factors then rise above 1 without a skipped
    step, and the subnormal share of quiet's traced gradients falls."""
    torch.manual_seed(0)
    model = QuietNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler_with("auto").watch(model, activations=True)
    # (the first iteration runs at scale 1; auto chooses once the scale stops moving)
    train(model, opt, scaler, range(3))
    before = subnormal_share(quiet_rows(scaler.report()))
    assert before > 0.3, before  # (the model does what it is for)
    chosen = factors_of(scaler)
    assert chosen, "no island chosen"
    assert all(n == "quiet" or n.startswith("quiet.") for n in chosen), chosen
    assert "quiet" in chosen, chosen  # (the block: relu's gradient between a and b at its scale)
    skipped = train(model, opt, scaler, range(3, 9))
    assert not any(skipped), skipped
    factors = factors_of(scaler)
    assert factors.keys() == chosen.keys()
    assert all(f > 1.0 for f in factors.values()), factors
    after = subnormal_share(quiet_rows(scaler.report()))
    assert after < before / 4, (before, after)
    zeros = [a.zeros / a.numel for a in quiet_rows(scaler.report())]
    assert max(zeros) < 0.6  # (relu's zeros: none more from underflow)


AMPLIFY = 2.0**10  # how far the amplifier's interior gradient sits above its modules'


class Amplifier(nn.Module):
    """A block whose largest gradient is inside it, between its modules: a's output is scaled
    down by AMPLIFY before b, whose weight is AMPLIFY times larger, so the gradient b hands
    back to that product (a float16 tensor no module returns) sits AMPLIFY above a's output
    gradient and the block's own."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        with torch.no_grad():
            self.b.weight.mul_(AMPLIFY)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) / AMPLIFY)


class AmplifierNet(nn.Module):
    """The amplifier joins the residual stream at QUIET, like QuietNet's quiet block."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = Amplifier()
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.block(h) * QUIET)


def amplifier_run(islands: list[str], steps: int = 30) -> tuple[list[bool], dict, float]:
    """The skips, the last factors and the largest interior gradient seen at the block's
    scale (captured in the forward: the product's gradient, what b hands back)."""
    torch.manual_seed(0)
    model = AmplifierNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = scaler_with(islands).watch(model, activations=True)
    largest = [0.0]

    def capture(module: nn.Module, args: tuple) -> None:
        (t,) = args
        if t.requires_grad:
            t.register_hook(lambda g: largest.__setitem__(0, max(largest[0], float(g.abs().max()))))

    model.block.b.register_forward_pre_hook(capture)
    skipped = train(model, opt, scaler, range(steps))
    return skipped, factors_of(scaler), largest[0]


def test_a_block_island_measures_the_gradients_between_its_modules() -> None:
    """An island that is a block: the gradient inside it that no module returns (here AMPLIFY
    above every module's and edge's) bounds its factor, so it never overflows float16 there:
    no skipped step while the factor rises.  Measuring only its modules and edges, the factor
    rises AMPLIFY too far and that gradient overflows."""
    skipped, factors, largest = amplifier_run(["block"])
    assert not any(skipped), skipped
    assert factors["block"] >= 2.0**8, factors  # (it rose: the block sits 2^20 below the rest)
    assert 2.0**9 < largest <= 65504.0 / 16, largest  # (near the island's edge, not past it)


def test_a_block_islands_measure_leaves_a_nested_island_to_its_own() -> None:
    """A leaf island nested in a block runs at its own factor: the block's measurement of its
    interior leaves the nested island's region out (its output gradient, its weight's, its
    input's before the exit), so it reads the same whether a runs at the block's factor or
    2^12 above it; trained, a's factor rises above the block's, and no step is skipped."""
    from ampfused.scale_islands import INTERIOR

    def block_interior(a_factor: float) -> float:
        torch.manual_seed(0)
        model = AmplifierNet()
        scaler = scaler_with(["block", "block.a"], init_scale=2.0**10)
        scaler.watch(model, activations=True)
        warm_up(scaler, model, f16_loss, [torch.optim.SGD(model.parameters(), lr=0.0)])
        force(scaler, {"block": 2.0**4, "block.a": a_factor})
        scaler.scale(f16_loss(model, 1)).backward()
        islands = scaler._island_set.islands
        rows = [t[1:, 1].max() for k, edge, _, t in islands.edges if k == 1 and edge == INTERIOR]
        assert rows, "the block's interior was not measured"
        return float(torch.stack(rows).max())

    assert block_interior(2.0**4) == block_interior(2.0**16)
    skipped, factors, _ = amplifier_run(["block", "block.a"])
    assert not any(skipped), skipped
    assert factors["block.a"] > factors["block"], factors


Carried = collections.namedtuple("Carried", "h")


@dataclasses.dataclass
class Held:
    h: torch.Tensor


@dataclasses.dataclass
class Opaque:
    h: torch.Tensor
    extra: torch.Tensor = dataclasses.field(init=False)


class Packed(nn.Module):
    """A block returning its tensor in a container of the given kind."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> object:
        h = self.b(torch.tanh(self.a(x)))
        if self.kind == "namedtuple":
            return Carried(h)
        if self.kind == "ordereddict":
            return collections.OrderedDict(h=h)
        if self.kind == "dataclass":
            return Held(h)
        out = Opaque(h)
        out.extra = h * 2
        return out


class PackedNet(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(4, 8), Packed(kind), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(torch.tanh(self.inp(x)))
        return self.head(out["h"] if isinstance(out, dict) else out.h)


@pytest.mark.parametrize("kind", ["namedtuple", "ordereddict", "dataclass"])
def test_a_block_returning_a_container_gets_its_factor_exactly(kind: str) -> None:
    """A block island's output in a namedtuple, a dict subclass (a ModelOutput's kind) or a
    dataclass: made again around views with the entry hook, so the gradients inside carry the
    factor exactly and those outside none (left as it was, the exit alone would divide the
    gradients upstream by it)."""
    torch.manual_seed(0)
    model = PackedNet(kind)
    x = torch.randn(5, 4)
    names = [n for n, _ in model.named_parameters()]
    grads = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    ref = dict(zip(names, grads, strict=True))
    scaler = scaler_with(["block"], init_scale=1.0).watch(model, activations=True)
    warm_up(scaler, model, lambda m: m(x).square().sum(), [torch.optim.SGD(model.parameters())])
    force(scaler, {"block": 64.0})
    scale = scaler.get_scale()
    scaler.scale(model(x).square().sum()).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n] * scale * (64.0 if n.startswith("block.") else 1.0)), n


def test_a_block_returning_a_container_it_cannot_make_again_is_refused() -> None:
    """A dataclass with a field its constructor does not set holds a tensor that needs a
    gradient: refused (NotImplementedError, naming the island and the fix), not left
    unscaled."""
    model = PackedNet("opaque")
    scaler = scaler_with(["block"]).watch(model, activations=True)
    with pytest.raises(NotImplementedError, match=r"output of 'block' is a Opaque.*islands"):
        scaler.scale(model(torch.randn(5, 4)).square().sum())


class SharedAct(nn.Module):
    """Two blocks holding one activation module (named once by named_modules())."""

    def __init__(self) -> None:
        super().__init__()
        self.net = QuietNet()
        act = nn.Tanh()
        self.net.quiet.act = act
        self.other = nn.Sequential(nn.Linear(8, 8), act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.other(self.net.head(torch.tanh(self.net.inp(x)))) * 0


def test_auto_with_a_module_held_by_two_blocks() -> None:
    """A module two blocks hold (one instance, named once): "auto" chooses without error."""
    torch.manual_seed(0)
    model = SharedAct()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler_with("auto").watch(model, activations=True)
    train(model, opt, scaler, range(4))
    assert factors_of(scaler)


class LoudInside(nn.Module):
    """A block of two leaves: c's output gradient quiet (its output is scaled down by QUIET
    before d), d's loud (its output is the block's, in the residual stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(32, 32)
        self.d = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(x)) * QUIET)


class TwoBlocksNet(QuietNet):
    def __init__(self) -> None:
        super().__init__()
        self.mixed = LoudInside()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.mixed(torch.tanh(self.inp(x)))[:, :8]


def test_auto_makes_a_block_an_island_only_where_all_its_leaves_are_quiet() -> None:
    """mixed holds a quiet leaf (c) and a loud one (d): c is an island, mixed is not (its
    factor would be bound by d's gradients, and lift nothing); quiet, all quiet, is one."""
    torch.manual_seed(0)
    model = TwoBlocksNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler_with("auto").watch(model, activations=True)
    train(model, opt, scaler, range(4))
    chosen = factors_of(scaler)
    assert "quiet" in chosen and "mixed.c" in chosen, chosen
    assert "mixed" not in chosen and "mixed.d" not in chosen, chosen


class QuietStack(nn.Module):
    """QuietNet's quiet block as a ModuleList, its layers called in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(16, 32), nn.Linear(32, 8)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        q = h
        for layer in self.layers:
            q = torch.relu(layer(q))
        return self.head(torch.tanh(h + q * QUIET))


def test_auto_does_not_make_a_container_an_island() -> None:
    """A ModuleList of quiet leaves looks like a block of leaves, but is never called: auto
    takes its leaves, not it."""
    torch.manual_seed(0)
    model = QuietStack()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = scaler_with("auto").watch(model, activations=True)
    train(model, opt, scaler, range(4))
    chosen = factors_of(scaler)
    assert "layers" not in chosen and {"layers.0", "layers.1"} <= set(chosen), chosen


class Raising(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("planted")
        return self.lin(x)


def test_a_forward_that_raises_inside_an_island_leaves_nothing_open() -> None:
    """An exception in an island's forward (the block and its nested leaf open) closes both
    calls: the next iterations train as a fresh run does, factor for factor."""

    def run(fail_once: bool) -> dict:
        torch.manual_seed(0)
        model = QuietNet()
        model.quiet.a = Raising()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = scaler_with(["quiet", "quiet.a"]).watch(model, activations=True)
        if fail_once:
            model.quiet.a.fail = True
            with pytest.raises(RuntimeError, match="planted"):
                f16_loss(model)
            model.quiet.a.fail = False
            assert scaler._island_set.islands._open == []
            assert scaler._island_set.islands._regions == {}
        train(model, opt, scaler, range(5))
        return factors_of(scaler)

    assert run(fail_once=True) == run(fail_once=False)


def plant_inf_in_loss(model: nn.Module, seed: int) -> torch.Tensor:
    return f16_loss(model, seed) * float("inf")


def plant_inf_inside(model: nn.Module, seed: int) -> torch.Tensor:
    """An inf in the gradient of quiet.a's output (inside the island, not at its edge: quiet.b's
    output is quiet's), in backward only."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))

    handle = model.quiet.a.register_forward_hook(hook)
    try:
        return f16_loss(model, seed)
    finally:
        handle.remove()


@pytest.mark.parametrize("plant", [plant_inf_in_loss, plant_inf_inside], ids=["loss", "inside"])
def test_overflow_skips_and_backs_off(plant: Callable) -> None:
    model, opt, scaler = fresh(["quiet"], seed=0)
    scaler.watch(model, activations=True)
    train(model, opt, scaler, range(4))
    islands = scaler._island_set.islands
    scale, island_scale = scaler.get_scale(), islands.scales().clone()
    before = snapshot(model)
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    scaler.scale(plant(model, 4)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.report().skipped
    for p, q in zip(model.parameters(), before[0], strict=True):
        assert torch.equal(p, q)
    for p, m in zip(model.parameters(), momentum, strict=True):
        assert torch.equal(opt.state[p]["momentum_buffer"], m)
    if plant is plant_inf_in_loss:  # (started outside: the global scale backs off, the
        # island, which the inf/NaN only flowed into, does not)
        assert scaler.get_scale() == scale / 2
        assert bool((islands.scales() >= island_scale).all()), (island_scale, islands.scales())
    else:  # (started inside: the island backs off, the global scale is held)
        assert torch.equal(islands.scales(), island_scale / 2), (island_scale, islands.scales())
        assert scaler.get_scale() == scale
    opt.zero_grad(set_to_none=True)
    assert not any(train(model, opt, scaler, range(5, 7)))  # (and goes on)


# ------------------------------------------------------------------------------- 5. global scale
class LoudNet(nn.Module):
    """loud.a's weight divided by 2**8 and loud.b's multiplied by as much: the forward pass is
    as before, but loud.a's output gradient and weight gradient sit 2**8 times above the
    others (the largest gradients of the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.loud = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        self.head = nn.Linear(32, 8)
        with torch.no_grad():
            self.loud[0].weight.div_(2.0**12)
            self.loud[0].bias.div_(2.0**12)
            self.loud[1].weight.mul_(2.0**12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(torch.tanh(h + self.loud(h)))


def test_global_scale_moves_as_without_islands() -> None:
    """The largest gradients sit inside loud.  The global scale reads every gradient at the
    global scale (an island's, parameters and traced rows alike, divided by its factor), so with
    loud an island at a factor of its own (below 1: its headroom is wider) the global scale is
    the one without islands, step for step."""
    scales = {}
    for islands in (None, ["loud"]):
        torch.manual_seed(0)
        model = LoudNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (the same gradients each time)
        scaler = ampfused.GradScaler("cpu", policy="headroom", islands=islands)
        scaler.watch(model, activations=True)
        trail = []
        for seed in range(6):
            skipped = train(model, opt, scaler, range(seed, seed + 1))
            assert not any(skipped) or seed == 0, skipped
            trail.append(scaler.get_scale())
        scales[islands is not None] = trail
        if islands:
            factor = factors_of(scaler)["loud"]
            assert factor < 1.0, factor
    assert scales[True] == scales[False], scales


# ------------------------------------------------------------------------------------ on a GPU
@pytest.mark.cuda
@pytest.mark.parametrize("stats", [False, True], ids=["plain", "statistics"])
def test_island_pass_on_cuda_equals_the_cpu(stats: bool) -> None:
    """ops.scaler_pass_ with islands on a GPU: the same bits as the CPU kernels (gradients,
    found_inf, next_state, statistics), for mixed dtypes, misaligned views and an island's
    largest element in a lane other than 0; an island_inv on the CPU is refused."""
    from ampfused import ops

    torch.manual_seed(0)
    base = [
        torch.randn(70_000) * 2.0**-20,
        torch.randn(1003).half(),  # (taken from element 3 on: a misaligned view)
        torch.randn(517, dtype=torch.float64),
        torch.randn(4096).bfloat16(),
    ]
    base[1][40] = 30000.0
    islands, inv = (0, 1, 0, 2), torch.tensor([2.0**-6, 2.0**9])
    out = {}
    for device in ("cpu", "cuda"):
        grads = [g.to(device, copy=True) for g in base]
        grads[1] = grads[1][3:]
        state = torch.zeros(ops.STATE_SIZE, dtype=torch.int32)
        state[0:1].view(torch.float32).fill_(2.0**10)
        state = state.to(device)
        nxt = torch.zeros_like(state)
        found = torch.zeros((), device=device)
        table = None
        if stats:
            rows = ops.grad_stats_rows(grads)
            table = torch.zeros(rows, len(ops.STAT_FIELDS), dtype=torch.float64, device=device)
        ops.scaler_pass_(grads, found, state, nxt, table, 2.0, 0.5, 3, headroom=4.0,
                         islands=islands, island_inv=inv.to(device))  # fmt: skip
        out[device] = [t.cpu() for t in (*grads, found, nxt, *([table] if stats else []))]
        if device == "cuda":
            with pytest.raises(RuntimeError, match="island_inv is on cpu"):
                ops.scaler_pass_(grads, found, state, nxt, table, 2.0, 0.5, 3, headroom=4.0,
                                 islands=islands, island_inv=inv)  # fmt: skip
    for got, want in zip(out["cuda"], out["cpu"], strict=True):
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_row_ids_of_tables_of_every_shape() -> None:
    """The per-row ids prepare_next reads its tables with, for shapes never seen before (a model
    whose sequence length varies makes new ones each iteration): each row's island, 0 for the
    rows left out (a header, a module's inputs), whether an entry's and whether float16's."""
    model, _, _ = fresh(["quiet"])
    islands = ampfused.scale_islands.Islands(model, ["quiet", "quiet.a"], "test")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        shape = tuple(
            tuple(int(v) for v in torch.randint(0, 4, (1,), generator=g))
            + tuple(bool(v) for v in torch.randint(0, 2, (2,), generator=g))
            + tuple(int(v) for v in torch.randint(0, 5, (2,), generator=g))
            for _ in range(int(torch.randint(1, 6, (1,), generator=g)))
        )
        want = [(k * (i >= skip), e, h) for k, e, h, skip, n in shape for i in range(n)]
        at, entry, half = islands._row_ids(shape)
        assert list(zip(at.tolist(), entry.tolist(), half.tolist(), strict=True)) == want, shape
    islands.remove()


@pytest.mark.cuda
def test_islands_iteration_on_cuda_waits_for_nothing() -> None:
    """On a GPU an iteration with islands (the edges' statistics, their ids, prepare_next, the
    update) makes no host sync, also where the batch's size changes each iteration, so that
    the tables' shapes are new and their ids are made again."""
    torch.manual_seed(0)
    model = QuietNet().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ampfused.GradScaler("cuda", policy="headroom", islands=["quiet"])
    scaler.watch(model, activations=True)
    for i, batch in enumerate((64, 2100, 4200, 6600, 9000, 2200)):
        x = torch.randn(batch, 16, device="cuda")
        if i == 2:  # (after the state and the scratch buffers exist)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.autocast("cuda", dtype=F16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad(set_to_none=True)
    assert factors_of(scaler)["quiet"] > 1.0


def test_traced_rows_inside_an_island_reach_the_global_magnitude_divided() -> None:
    """The global magnitude's traced part (_grad_pass.activation_magnitude): a row of a module
    inside an island counts divided by the island's factor (its value at the global scale),
    the others as they are."""
    from ampfused import _grad_pass
    from ampfused.scale_islands import Islands

    model = LoudNet()
    islands = Islands(model, ["loud"], "test")
    islands._set_factors(torch.tensor([2.0**-3]))

    def row(name: str, top: float) -> tuple:
        table = torch.zeros(2, 7, dtype=torch.float64)
        table[1, 1] = top
        return (name, 0, "backward", False, table, 4, F16, 0)

    into = torch.zeros(1)
    rows = [row("inp", 300.0), row("loud.0", 100.0), row("head", 50.0)]
    assert _grad_pass.activation_magnitude(rows, into, islands)
    assert into.item() == 800.0  # (loud.0's 100 at a factor of 1/8: 800 at the global scale)
    assert _grad_pass.activation_magnitude(rows, into, None) and into.item() == 300.0
    islands.remove()


def test_report_names_the_islands_of_its_iteration() -> None:
    """report().islands holds the factors in force in the report's iteration (the current one
    between unscale_ and update, else the last completed one, not the next one's); its text
    lists them, and an underflow line of a module inside an island names the island."""
    torch.manual_seed(0)
    model = QuietNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # (the same gradients each time)
    scaler = scaler_with(["quiet"]).watch(model, activations=True)
    warm_up(scaler, model, f16_loss, [opt])
    force(scaler, {"quiet": 2.0**-8})  # (low: quiet's gradients underflow at it)
    scaler.scale(f16_loss(model)).backward()
    scaler.unscale_(opt)
    now = scaler.report()
    assert now.islands == {"quiet": 2.0**-8}
    scaler.step(opt)
    scaler.update()
    assert scaler.island_factors() != {"quiet": 2.0**-8}  # (moved by the update)
    last = scaler.report()
    assert last.islands == {"quiet": 2.0**-8}
    text = str(last)
    assert "scale islands: 1, at 2^-8 to 2^-8 times the global scale" in text, text
    lines = [line for line in text.splitlines() if "quiet." in line and "subnormal" not in line]
    assert any("in scale island quiet at 2^-8" in line for line in lines), text


@pytest.mark.parametrize("islands", [["quiet"], "auto"], ids=["named", "auto"])
def test_checkpoint_and_pickle_before_the_first_pass(islands: object) -> None:
    """Before the islands' first pass there are no rows to keep: state_dict() writes no
    islands entry, and it, a deepcopy and a pickle load and train (they wrote rows of None,
    which load_state_dict and watch() refused)."""
    model, opt, scaler = fresh(islands, seed=0)
    scaler.watch(model, activations=True)
    if islands == "auto":
        train(model, opt, scaler, range(1))  # (the step that chooses: no pass of them yet)
    state = scaler.state_dict()
    assert CHECKPOINT_KEY not in state or state[CHECKPOINT_KEY]["states"] is not None
    _, _, other = fresh(islands)
    other.load_state_dict(state)
    for clone in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        model2, opt2, _ = fresh(islands, seed=0)
        clone.watch(model2, activations=True)
        assert not any(train(model2, opt2, clone, range(1, 3))[1:])


class CalmNet(nn.Module):
    """head's output gradient is the loss's (of order 1); calm's is the buffer `w` (a sum's
    gradient), many binades below: a constant one all in float16's normal range, a spread one
    reaching into its subnormals."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.calm = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)
        self.register_buffer("w", w)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.inp(x))
        return self.head(h), self.calm(h)


def calm_loss(model: nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(seed))
    with torch.autocast("cpu", dtype=F16):
        out, calm = model(x)
    return (out.float() ** 2).sum() + (calm.float() * model.w).sum()


@pytest.mark.parametrize("spread", [False, True], ids=["normal", "subnormal"])
def test_auto_chooses_only_modules_with_subnormal_gradients(spread: bool) -> None:
    """calm's output gradients sit 8 binades and more below head's either way; "auto" makes it
    an island only where they reach float16's subnormals (an island lifts nothing that the
    global scale keeps normal)."""
    torch.manual_seed(0)
    w = torch.full((64, 32), 2.0**-8)
    if spread:
        w = w * 2.0 ** -torch.empty(64, 32).uniform_(
            0, 30, generator=torch.Generator().manual_seed(1)
        )
    model = CalmNet(w)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = scaler_with("auto").watch(model, activations=True)
    skipped = train(model, opt, scaler, range(4), loss_fn=calm_loss)
    assert not any(skipped), skipped
    calm = [a for a in scaler.report().activations if a.module == "calm"]
    assert calm and (sum(a.subnormal for a in calm) > 0) == spread
    assert list(factors_of(scaler)) == (["calm"] if spread else [])


def test_master_weights_islands_rise_with_their_gradients() -> None:
    """A float16 QuietNet under MasterWeights: the island's factor follows its own measured
    gradients (the masters' statistics, traced rows, edges) up from 1, with no skipped step."""
    torch.manual_seed(0)
    model = QuietNet().half()
    opt = master_weights(model.parameters())
    scaler = scaler_with(["quiet"]).watch(model, activations=True)
    skipped = train(model, opt, scaler, range(8), loss_fn=lambda m, s: f16_loss(m, s))
    assert not any(skipped), skipped
    assert factors_of(scaler)["quiet"] > 1.0, factors_of(scaler)


def test_auto_reads_subnormals_at_the_settled_scale() -> None:
    """calm's output gradients, 2**-17, are subnormal at the headroom policy's start (scale
    1.0) and normal at the scale it settles at: "auto" chooses only once the scale stopped
    moving, so calm is left alone."""
    torch.manual_seed(0)
    model = CalmNet(torch.full((64, 32), 2.0**-17))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = scaler_with("auto").watch(model, activations=True)
    train(model, opt, scaler, range(12), loss_fn=calm_loss)
    assert 2.0**-17 * scaler.get_scale() >= 2.0**-14, scaler.get_scale()
    assert factors_of(scaler) == {}


def test_a_review_on_an_overflowing_iteration_chooses_nothing() -> None:
    """The 10th update, a review, overflows: "auto" chooses nothing then (it raised TypeError
    out of update()), and the islands go on."""
    model, opt, scaler = fresh("auto", seed=0)
    scaler.watch(model, activations=True)

    def loss(m: nn.Module, seed: int) -> torch.Tensor:
        out = f16_loss(m, seed)
        return out * 1e30 if seed == 99 else out  # (float16 output gradients overflow)

    train(model, opt, scaler, range(3), loss_fn=loss)
    chosen = factors_of(scaler)
    assert chosen, "auto chose no island"
    train(model, opt, scaler, range(3, 3 + 9 - scaler._island_set.iterations), loss_fn=loss)
    assert scaler._island_set.iterations == 9
    assert train(model, opt, scaler, [99], loss_fn=loss) == [True]
    assert factors_of(scaler).keys() == chosen.keys()
    assert not any(train(model, opt, scaler, range(100, 103), loss_fn=loss))


def test_islands_checkpoint_from_before_the_learned_margin_loads() -> None:
    """Rows written before the state's margin field (one int shorter) load, with no margin
    learned."""
    model, opt, scaler = fresh(["quiet"])
    scaler.watch(model, activations=True)
    train(model, opt, scaler, range(3))
    checkpoint = scaler.state_dict()
    entry = checkpoint["ampfused_islands"]
    old = {**entry, "states": [r[:-1] for r in entry["states"]]}
    model2, opt2, scaler2 = fresh(["quiet"])
    scaler2.watch(model2, activations=True)
    scaler2.load_state_dict({**checkpoint, "ampfused_islands": old})
    assert scaler2.island_factors() == scaler.island_factors()
    assert scaler2.state_dict()["ampfused_islands"]["states"] == [
        [*r[:-1], 0] for r in entry["states"]
    ]
