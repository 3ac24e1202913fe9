"""Activation tracing (``watch(model, activations=...)``, ampfused/activations.py), the origin
and headroom in the report (ampfused/diagnostics.py) and float32 islands (``keep_float32``,
ampfused/islands.py), on a transformers GPT-2 and a small convnet in float16 autocast on the CPU.

Each overflow is made to start in a chosen module: a weight scaled so that the module's float16
output passes 65,504, an attention score blown up, a NaN produced in backward only.  The report
must name that module every time; an island on it must make the step go through, with the loss
of a float32 run of that module.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampfused
from ampfused.report import ESTIMATE_HEADROOM, island_estimate, island_exponent

transformers = pytest.importorskip("transformers")

F16_MAX = torch.finfo(torch.float16).max


# ------------------------------------------------------------------------------- models
def gpt2(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"  # the attention probabilities pass attn_dropout
    return transformers.GPT2LMHeadModel(config)


def gpt2_loss(model: nn.Module, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.autocast("cpu", dtype=torch.float16):
        return model(input_ids=ids, labels=ids).loss


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


def convnet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ConvNet()


def convnet_loss(model: nn.Module, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(x).float(), y)


def scale_weight(model: nn.Module, name: str, factor: float, columns: slice = slice(None)) -> None:
    with torch.no_grad():
        model.get_submodule(name).weight[:, columns].mul_(factor)


def blow_projection(block: str):
    """The projection's weight scaled up (and what feeds it, a little), so that its float16
    output passes 65,504 while its weight and its inputs stay finite in float16."""

    def blow(model: nn.Module) -> None:
        if block.endswith("attn"):
            scale_weight(model, f"{block}.c_attn", 8.0, slice(64, 96))  # (the values)
        else:
            scale_weight(model, f"{block}.c_fc", 4.0)
        scale_weight(model, f"{block}.c_proj", 1e6)

    return blow


def blow_attention_scores(block: int):
    """Query and key projections scaled so that q.k overflows float16 inside the attention
    (no module's output: the probabilities pass functional code), the projections finite."""

    def blow(model: nn.Module) -> None:
        scale_weight(model, f"transformer.h.{block}.attn.c_attn", 1000.0, slice(0, 64))

    return blow


def blow_conv(model: nn.Module) -> None:
    """conv1's weight and bias scaled: its float16 output passes 65,504."""
    with torch.no_grad():
        model.conv1.weight.mul_(1e5)
        model.conv1.bias.mul_(1e5)


class NaNInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad * float("nan")


class NaNGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NaNInBackward.apply(x)


def one_step(model: nn.Module, loss_fn, seed: int, **watch) -> tuple:  # noqa: ANN001
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0**10)
    scaler.watch(model, activations=True, **watch)
    loss = loss_fn(model, seed)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return scaler, scaler.report(), loss.detach()


# ------------------------------------------------------------------------------- the origin
# (model, loss, how the overflow is made, the module it starts in, the island that fixes it)
FORWARD_CASES = {
    "gpt2-attn.c_proj": (gpt2, gpt2_loss, blow_projection("transformer.h.0.attn"),
                         "transformer.h.0.attn.c_proj", "transformer.h.0.attn.c_proj"),
    "gpt2-mlp.c_proj": (gpt2, gpt2_loss, blow_projection("transformer.h.1.mlp"),
                        "transformer.h.1.mlp.c_proj", "transformer.h.1.mlp.c_proj"),
    # The first traced module with inf/NaN is c_proj, whose input already held it: the report
    # names it and suggests its parent, the attention, as the island.
    "gpt2-attention-score": (gpt2, gpt2_loss, blow_attention_scores(1),
                             "transformer.h.1.attn.c_proj", "transformer.h.1.attn"),
    "convnet-conv1": (convnet, convnet_loss, blow_conv, "conv1", "conv1"),
}  # fmt: skip


@pytest.mark.parametrize("case", FORWARD_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forward_origin_is_the_module_it_started_in(case, seed):
    make, loss_fn, blow, origin, island = FORWARD_CASES[case]
    model = make(seed)
    blow(model)
    scaler, report, _ = one_step(model, loss_fn, seed)
    assert report.skipped
    assert report.forward_origin is not None, str(report)
    assert report.forward_origin.module == origin, str(report)
    assert report.forward_origin.direction == "forward" and report.forward_origin.non_finite
    assert report.forward_origin.inputs_finite == (origin == island)
    # print(report) starts from the origin and suggests the island
    text = str(report)
    assert text.index("overflow started in forward") < text.index("parameter gradients")
    assert f"ampfused.keep_float32(model, [{island!r}])" in text


def _float32_module(module: nn.Module) -> nn.Module:
    """The reference for an island: the module called with float32 inputs, autocast off."""

    class Float32(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            cast = lambda v: v.float() if torch.is_tensor(v) and v.dtype == torch.float16 else v  # noqa: E731
            with torch.autocast("cpu", enabled=False):
                return self.inner(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    return Float32()


@pytest.mark.parametrize("case", FORWARD_CASES)
def test_island_on_the_origin_lets_the_step_through(case):
    make, loss_fn, blow, _, island_name = FORWARD_CASES[case]
    model = make(0)
    blow(model)
    reference = copy.deepcopy(model)
    parent, _, child = island_name.rpartition(".")
    holder = reference.get_submodule(parent) if parent else reference
    setattr(holder, child, _float32_module(holder.get_submodule(child)))

    island = ampfused.keep_float32(model, [island_name])
    scaler, report, loss = one_step(model, loss_fn, 0)
    assert not report.skipped, str(report)
    assert report.forward_origin is None and report.backward_origin is None
    assert torch.equal(loss, loss_fn(reference, 0).detach())
    # The island's outputs are float32.
    outputs = [a for a in report.activations if a.direction == "forward"]
    inside = [a for a in outputs if a.module.startswith(island_name)]
    assert inside and all(a.dtype == torch.float32 for a in inside)
    island.remove()
    scaler, report, _ = one_step(model, loss_fn, 0)
    assert report.skipped  # back to mixed precision


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backward_only_nan_names_its_module(seed):
    model = gpt2(seed)
    model.transformer.h[0].mlp.act = NaNGrad()
    scaler, report, _ = one_step(model, gpt2_loss, seed)
    assert report.skipped
    assert report.forward_origin is None
    origin = report.backward_origin
    # The first gradient that held NaN is the one the NaN's module computed: the gradient of
    # its input, which is the output gradient of the module before it (c_fc).
    assert origin.module == "transformer.h.0.mlp.c_fc" and origin.direction == "backward"
    assert report.backward_producer == "transformer.h.0.mlp.act"
    assert "in the backward of transformer.h.0.mlp.act" in str(report)


# ------------------------------------------------------------------------------- the rows
class Twice(nn.Module):
    """A shared layer called twice, a module returning a tuple, one returning a non-tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.split = Split()
        self.meta = Meta()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(self.shared(self.shared(x)))
        self.meta(a)
        return (a * b).sum()


class Split(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :2] * 1.5, x[:, 2:]


class Meta(nn.Module):
    def forward(self, x: torch.Tensor) -> str:
        return f"shape {tuple(x.shape)}"


def _reference_rows(model: nn.Module, run) -> list[tuple]:  # noqa: ANN001
    """What tracing must record, from plain hooks with .item() per tensor: (module, call,
    direction, abs_max, +inf, -inf, NaN, numel) per call."""
    rows: dict[tuple, list] = {}
    calls: dict[str, int] = {}

    def stats(key: tuple, tensors: list[torch.Tensor]) -> None:
        entry = rows.setdefault(key, [0.0, 0, 0, 0, 0])
        for t in tensors:
            finite = t[torch.isfinite(t)]
            entry[0] = max(entry[0], finite.abs().max().item() if finite.numel() else 0.0)
            entry[1] += int((t == float("inf")).sum().item())
            entry[2] += int((t == float("-inf")).sum().item())
            entry[3] += int(torch.isnan(t).sum().item())
            entry[4] += t.numel()

    def hook(name, module, args, output):  # noqa: ANN001, ANN202
        outs = list(output) if isinstance(output, tuple) else [output]
        outs = [o for o in outs if torch.is_tensor(o) and o.is_floating_point()]
        if not outs:
            return
        call = calls.get(name, 0)
        calls[name] = call + 1
        stats((name, call, "forward"), outs)
        for o in outs:
            if o.requires_grad:
                o.register_hook(
                    lambda g, name=name, call=call: stats((name, call, "backward"), [g])
                )

    leaves = [(n, m) for n, m in model.named_modules() if next(m.children(), None) is None]
    handles = [
        m.register_forward_hook(lambda mod, a, o, n=n: hook(n, mod, a, o)) for n, m in leaves
    ]
    run()
    for h in handles:
        h.remove()
    return [(*key, *values) for key, values in rows.items()]


def _traced_rows(model: nn.Module, run) -> list[tuple]:  # noqa: ANN001
    """What tracing records of one run(), as _reference_rows gives it."""
    scaler = ampfused.GradScaler("cpu").watch(model, activations=True)
    run()
    return [
        (a.module, a.call, a.direction, a.abs_max, a.pos_inf, a.neg_inf, a.nan, a.numel)
        for a in scaler._watch.report_activations()
    ]


@pytest.mark.parametrize("poison", ["none", "inf", "nan"])
def test_rows_equal_plain_hooks_bit_for_bit(poison):
    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(3, 4)
    if poison != "none":
        x[1, 2] = float(poison)

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x)
        (loss.float() * 8.0).backward()

    want = _reference_rows(model, run)
    got = _traced_rows(model, run)
    assert sorted(got, key=str) == sorted(want, key=str)
    # a row per call, the shared layer's two calls apart; the tuple's tensors together
    assert {(a[0], a[1], a[2]) for a in got} >= {
        ("shared", 0, "forward"),
        ("shared", 1, "forward"),
        ("shared", 0, "backward"),
        ("shared", 1, "backward"),
        ("split", 0, "forward"),
    }
    assert next(a for a in got if a[0] == "split" and a[2] == "forward")[7] == 12
    assert not any(a[0] == "meta" for a in got)  # a non-tensor output records nothing


class Overlapping(nn.Module):
    """Tensors whose elements share memory: an expanded output, a window view of it, and, the
    loss being the output's sum, the expanded gradient of the last output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.spread = Spread()
        self.windows = Windows()
        self.last = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.windows(self.spread(self.lin(x))))


class Spread(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(3, *x.shape)


class Windows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unfold(-1, 4, 2)


def test_tensors_whose_elements_share_memory_are_read_element_by_element():
    """An expanded output, a window view and the gradient of ``output.sum()`` (expanded) are
    recorded as their elements, as plain hooks read them; the kernel refused them before."""
    torch.manual_seed(0)
    model = Overlapping()
    x = torch.randn(5, 4)

    def run() -> None:
        (model(x).sum() * 8.0).backward()

    want = _reference_rows(model, run)
    got = _traced_rows(model, run)
    assert sorted(got, key=str) == sorted(want, key=str)
    assert ("last", 0, "backward", 8.0, 0, 0, 0, 3 * 5 * 3 * 2) in got


def test_checkpoint_recomputation_is_not_an_origin():
    class Blow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 1e5

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.blow = Blow()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.blow(x))  # (inner saves blow's output: blow is re-run)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.block = Block()
            self.last = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.utils.checkpoint.checkpoint(self.block, self.first(x), use_reentrant=False)
            return self.last(y).float().mean()

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ampfused.GradScaler("cpu", init_scale=1.0).watch(model, activations=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4))
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.report()
    blow_rows = [
        a for a in report.activations if a.module == "block.blow" and a.direction == "forward"
    ]
    assert [a.recompute for a in blow_rows] == [False, True]  # the first call, then its re-run
    assert [a.call for a in blow_rows] == [0, 1]
    assert report.forward_origin.module == "block.blow" and not report.forward_origin.recompute


def test_unwatch_removes_every_hook():
    model = gpt2(0)
    before = {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
    }
    scaler = ampfused.GradScaler("cpu").watch(model, activations=True)
    hooked = sum(len(m._forward_hooks) for m in model.modules())
    assert hooked == sum(1 for m in model.modules() if next(m.children(), None) is None)
    scaler.watch(model, activations=["transformer.h.0", nn.LayerNorm])  # replaces the first
    assert sum(len(m._forward_hooks) for m in model.modules()) == 1 + 5
    scaler.unwatch()
    after = {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
    }
    assert after == before


def test_off_by_default_registers_nothing():
    model = gpt2(0)
    ampfused.GradScaler("cpu").watch(model)
    assert all(not m._forward_hooks for m in model.modules())


def test_tracing_never_syncs(no_host_sync):
    model = gpt2(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)  # (no sync in the step)
    scaler = ampfused.GradScaler("cpu").watch(model, activations=True)
    for seed in range(2):
        loss = gpt2_loss(model, seed)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_bad_activations_arguments():
    model = gpt2(0)
    scaler = ampfused.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"names 'transformer.h.9'.*named_modules"):
        scaler.watch(model, activations=["transformer.h.9"])
    with pytest.raises(TypeError, match="module names"):
        scaler.watch(model, activations=[3])
    with pytest.raises(TypeError, match="pass the torch.nn.Module"):
        scaler.watch(list(model.named_parameters()), activations=True)
    with pytest.raises(ValueError, match="selects no module"):
        scaler.watch(model, activations=[nn.Conv2d])
    assert scaler._watch is None  # nothing kept


# ------------------------------------------------------------------------------- islands
def test_island_keeps_state_dict_hooks_and_compile():
    model = convnet(0)
    blow_conv(model)
    keys = list(model.state_dict())
    seen = []
    model.conv1.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    island = ampfused.keep_float32(model, ["conv1"])
    assert list(model.state_dict()) == keys
    eager = convnet_loss(model, 0)
    assert seen == [torch.float32] and torch.isfinite(eager)
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(convnet_loss(compiled, 0), eager)
    twin = copy.deepcopy(model)
    assert torch.equal(convnet_loss(twin, 0), eager)
    island.remove()
    assert not torch.isfinite(convnet_loss(model, 0))


def test_island_refusals():
    model = convnet(0)
    with pytest.raises(ValueError, match="'nope'"):
        ampfused.keep_float32(model, ["nope"])
    with pytest.raises(TypeError, match="module names"):
        ampfused.keep_float32(model, [1.5])
    with pytest.raises(TypeError, match="'conv1' holds torch.float16 parameters"):
        ampfused.keep_float32(model.half(), ["conv1"])


def test_island_by_type_and_nested_calls():
    model = convnet(0)
    island = ampfused.keep_float32(model, nn.Conv2d)
    out = []
    model.conv2.register_forward_hook(lambda m, a, o: out.append((a[0].dtype, o.dtype)))
    convnet_loss(model, 0)
    assert out == [(torch.float32, torch.float32)]
    assert torch.is_autocast_enabled("cpu") is False  # outside autocast again
    with torch.autocast("cpu", dtype=torch.float16):
        model.conv1(torch.randn(1, 3, 4, 4))
        assert torch.is_autocast_enabled("cpu")  # restored after the island's call
    assert "conv1" in repr(island)


# ------------------------------------------------------------------------------- underflow
def test_counters_sum_the_subnormal_activation_gradients_since_watch() -> None:
    """counters() under watch(activations=True): the traced float16 output gradients' nonzero
    elements and subnormal ones, summed over the iterations since watch(), equal the counts
    taken from the gradients themselves; a watch() again starts them afresh; without traced
    activations the keys are absent."""
    model = convnet(0)
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(lambda g: captured.append(g.detach().clone()))

    for name in ("conv1", "bn1", "conv2", "head"):  # (every leaf module: all are traced)
        model.get_submodule(name).register_forward_hook(hook)
    scaler = ampfused.GradScaler("cpu", init_scale=2.0**-6)  # (subnormal gradients: see below)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    assert "activation_grads_subnormal" not in scaler.counters()
    scaler.watch(model, activations=True)

    def iterations(seeds: range) -> tuple[int, int]:
        nonzero = subnormal = 0
        for seed in seeds:
            captured.clear()
            scaler.scale(convnet_loss(model, seed)).backward()
            scaler.step(opt)
            scaler.update()
            for g in captured:
                if g.dtype == torch.float16:
                    a = g.float().abs()
                    nonzero += int((a > 0).sum())
                    subnormal += int(((a > 0) & (a < 2.0**-14)).sum())
        return nonzero, subnormal

    nonzero, subnormal = iterations(range(3))
    assert subnormal > 0  # (the premise)
    counters = scaler.counters()
    assert counters["activation_grads_nonzero"] == nonzero
    assert counters["activation_grads_subnormal"] == subnormal
    scaler.watch(model, activations=True)
    nonzero, subnormal = iterations(range(3, 4))
    counters = scaler.counters()
    assert (counters["activation_grads_nonzero"], counters["activation_grads_subnormal"]) == (
        nonzero,
        subnormal,
    )
    scaler.watch(model)
    assert "activation_grads_subnormal" not in scaler.counters()

    # a float32 output is not counted
    class Widen(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x.float())

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Widen(), nn.Linear(16, 4))
    scaler = ampfused.GradScaler("cpu", init_scale=2.0**-10).watch(net, activations=True)
    grads: list[torch.Tensor] = []
    for m in net:
        m.register_forward_hook(lambda m, a, out: out.register_hook(grads.append) and None)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(torch.randn(32, 8)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(torch.optim.SGD(net.parameters(), lr=0.0))
    scaler.update()
    assert {g.dtype for g in grads} == {torch.float16, torch.float32}  # (the premise)
    half = [g.float().abs() for g in grads if g.dtype == torch.float16]
    counters = scaler.counters()
    assert counters["activation_grads_nonzero"] == sum(int((a > 0).sum()) for a in half)
    assert counters["activation_grads_subnormal"] == sum(
        int(((a > 0) & (a < 2.0**-14)).sum()) for a in half
    )


def test_report_counts_subnormal_activation_gradients() -> None:
    """The pass counts, per traced module, the float16 output gradients in float16's subnormal
    range (0 < |g| < 2**-14): the report's shares equal counts taken from the gradients
    themselves (captured by hooks on the same outputs), per module and over the model, and
    the module with the largest share is listed first."""
    model = convnet(0)
    captured: dict[str, torch.Tensor] = {}

    def capture(name: str):  # noqa: ANN202
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            output.register_hook(lambda g: captured.__setitem__(name, g.detach().clone()))

        return hook

    for name in ("conv1", "bn1", "conv2", "head"):  # (every leaf module: all are traced)
        model.get_submodule(name).register_forward_hook(capture(name))
    # scale 2**-6: the small float16 gradients of a tiny loss land in the subnormal range
    scaler = ampfused.GradScaler("cpu", init_scale=2.0**-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.watch(model, activations=True)
    scaler.scale(convnet_loss(model, 1)).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.report()

    def share(g: torch.Tensor) -> tuple[int, int]:
        a = g.float().abs()
        return int(((a > 0) & (a < 2.0**-14)).sum()), int((a > 0).sum())

    rows = {a.module: a for a in report.activations if a.direction == "backward"}
    total_sub = total_nonzero = 0
    for name, g in captured.items():
        if g.dtype != torch.float16:  # (bn1 runs in float32 under autocast: not counted)
            assert rows[name].dtype != torch.float16
            continue
        sub, nonzero = share(g)
        assert rows[name].subnormal == sub and rows[name].numel - rows[name].zeros == nonzero
        total_sub, total_nonzero = total_sub + sub, total_nonzero + nonzero
    assert total_sub > 0  # the test's premise: some gradients are subnormal
    assert report.subnormal_share == total_sub / total_nonzero
    shares = [a.subnormal_share for a in report.underflow]
    assert shares == sorted(shares, reverse=True) and shares[0] > 0
    worst = report.underflow[0]
    assert f"{worst.module} output gradient: {worst.subnormal_share:.2%}" in str(report)
    # the estimate "as a scale island at 2^k", held to the captured gradients: at 2^k exactly
    # the values below 2**-(14 + k) stay subnormal (none where k >= 10)
    for a in report.underflow:
        k = island_exponent(a.abs_max)
        g = captured[a.module].float().abs()
        lifted = g * 2.0**k
        stay = int(((lifted > 0) & (lifted < 2.0**-14)).sum())
        line = next(x for x in str(report).splitlines() if f"{a.module} output gradient" in x)
        assert lifted.max() * ESTIMATE_HEADROOM <= 65504.0 < lifted.max() * 2 * ESTIMATE_HEADROOM
        if k >= 10:
            assert stay == 0 and line.endswith(
                f"at 2^{k} (its largest 64x below 65,504): none of them"
            )
        elif k >= 1:
            assert stay == int(((g > 0) & (g < 2.0 ** -(14 + k))).sum())
            assert line.endswith(f"only those below 2**-{14 + k}"), line
    assert any(island_exponent(a.abs_max) >= 1 for a in report.underflow)
    assert f"(subnormal): {total_sub / total_nonzero:.2%}" in str(report)


@pytest.mark.parametrize("k", [1, 5, 9, 10, 11])
def test_island_estimate_at_its_edges(k: int) -> None:
    """The report's "as a scale island at 2^k": float16 values spanning every binade, with the
    largest just at the estimate's headroom for 2^k; lifted by 2^k exactly those below
    2**-(14 + k) stay subnormal, none from k = 10 (float16's subnormals span 10 binades)."""
    top = 65504.0 / ESTIMATE_HEADROOM / 2.0**k
    g = torch.tensor([2.0**e for e in range(-24, 16)] + [top], dtype=torch.float16)
    g = g[g.float() <= top]
    assert island_exponent(float(g.float().max())) == k
    lifted = g.float() * 2.0**k
    stay = int(((lifted > 0) & (lifted < 2.0**-14)).sum())
    text = island_estimate(float(g.float().max()))
    assert text.startswith(f"; as a scale island at 2^{k} (its largest 64x below 65,504)")
    if k >= 10:
        assert stay == 0 and text.endswith("none of them")
    else:
        assert stay == int(((g.float() > 0) & (g.float() < 2.0 ** -(14 + k))).sum()) > 0
        assert text.endswith(f"only those below 2**-{14 + k}")
