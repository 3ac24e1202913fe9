"""``ampfused.GradScaler`` under ``torch.compile``: it compiles wherever torch's scaler does,
gives the same bits, and makes no more graphs than torch's.

torch's scaler is on dynamo's skip list: compiled code calls its methods at a graph break and
compiles the optimizer's step as a frame of its own.  Each test runs the same training loop
twice, once with each scaler, the scaler calls inside a ``torch.compile``'d function, and
compares parameters, optimizer state, scale and growth tracker bit for bit after every step,
and the number of graphs the backend was handed.  The loop injects an inf (a skipped step and a
backoff) and uses growth_interval=2, so the scale also grows.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import ampfused

# Tracing into the scaler would warn (dynamo meets builtins it cannot trace): torch's is not traced.
pytestmark = pytest.mark.filterwarnings("error:Dynamo does not know how to trace:UserWarning")

STEPS, INF_STEP = 4, 1
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, fused=True)  # _step_supports_amp_scaling


def _state_of(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> dict[str, Any]:
    state = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, s in enumerate(opt.state_dict()["state"].values()):
        for k, v in s.items():
            state[f"opt.{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    state["scale"] = scaler._scale.clone()
    state["growth_tracker"] = scaler._growth_tracker.clone()
    return state


def _train(
    scaler_cls: type, kind: str, clip: bool, backend: str, whole_step: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """STEPS steps with the scaler calls compiled; the states after each step and the number of
    graphs the backend compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = _optimizer(kind, model.parameters())
    scaler = scaler_cls("cpu", **SCALER_KW)
    data = [torch.randn(4, 6) for _ in range(STEPS)]

    def backward(x: torch.Tensor) -> None:
        scaler.scale(model(x).square().mean()).backward()

    def scaler_step() -> None:
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()

    def train_step(x: torch.Tensor, poison: bool) -> None:
        backward(x)
        if poison:
            model[0].weight.grad[1, 2] = float("inf")
        scaler_step()

    counter = CompileCounterWithBackend(backend)
    compiled_scaler_step = torch.compile(scaler_step, backend=counter)
    compiled_train_step = torch.compile(train_step, backend=counter)
    states = []
    for i, x in enumerate(data):
        opt.zero_grad()
        if whole_step:
            compiled_train_step(x, i == INF_STEP)
        else:
            backward(x)
            if i == INF_STEP:
                model[0].weight.grad[1, 2] = float("inf")
            compiled_scaler_step()
        states.append(_state_of(model, opt, scaler))
    torch._dynamo.reset()
    return states, counter.frame_count


def _assert_same_training(kind: str, clip: bool, backend: str, whole_step: bool = False) -> None:
    expected, torch_graphs = _train(torch.amp.GradScaler, kind, clip, backend, whole_step)
    got, our_graphs = _train(ampfused.GradScaler, kind, clip, backend, whole_step)
    # The loop must have skipped a step, backed off and grown, or it tests less than it says.
    scales = [s["scale"].item() for s in expected]
    assert scales[INF_STEP] < scales[INF_STEP - 1] and scales[-1] > scales[INF_STEP], scales
    for step, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert e.keys() == g.keys()
        for key in e:
            same = (
                torch.equal(e[key], g[key])
                if isinstance(e[key], torch.Tensor)
                else e[key] == g[key]
            )
            assert same, f"step {step}: {key} differs: torch {e[key]} vs ampfused {g[key]}"
    assert our_graphs <= torch_graphs, (
        f"ampfused's scaler made {our_graphs} graphs where torch's made {torch_graphs}"
    )


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
@pytest.mark.parametrize("kind", ["sgd", "adamw", "fused_adamw"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_scaler_matches_torch(backend: str, kind: str, clip: bool) -> None:
    _assert_same_training(kind, clip, backend)


@pytest.mark.parametrize("kind", ["sgd", "fused_adamw"])
def test_compiled_scaler_matches_torch_inductor(kind: str) -> None:
    # Inductor compiles C++ for every graph: one plain and one fused case, with clipping.
    _assert_same_training(kind, True, "inductor")


@pytest.mark.parametrize("kind", ["sgd", "fused_adamw"])
def test_compiled_whole_training_step_matches_torch(kind: str) -> None:
    # forward, scale(loss).backward(), unscale_, clip, step and update in one compiled function
    _assert_same_training(kind, True, "aot_eager", whole_step=True)


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale_clip_step"])
@pytest.mark.parametrize("kind", ["sgd", "fused_adamw"])
def test_graph_breaks_no_more_than_torch(kind: str, clip: bool) -> None:
    """torch._dynamo.explain over unscale_ (+ clip) + step + update: ampfused's scaler breaks
    the graph as often as torch's and, on the fused-optimizer path, not at all."""

    def explain(scaler_cls: type) -> Any:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = _optimizer(kind, model.parameters())
        scaler = scaler_cls("cpu")
        scaler.scale(model(torch.randn(2, 4)).sum()).backward()

        def scaler_step() -> None:
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()

        return torch._dynamo.explain(scaler_step)()

    ours, theirs = explain(ampfused.GradScaler), explain(torch.amp.GradScaler)
    counts = f"ampfused {ours.graph_count} graphs, torch {theirs.graph_count}"
    assert ours.graph_count <= theirs.graph_count, counts
    assert ours.graph_break_count <= theirs.graph_break_count, counts
    if kind == "fused_adamw":
        assert ours.graph_break_count <= 0, counts


def test_import_does_not_load_dynamo() -> None:
    # torch._dynamo takes seconds to import; eager users of the scaler must not pay for it.
    code = (
        "import sys, torch; before = 'torch._dynamo' in sys.modules; import ampfused; "
        "print(before, 'torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert after == before, "import ampfused imported torch._dynamo"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_with_traced_activations_is_quiet_and_records_as_eager(backend: str) -> None:
    """torch.compile(model) under watch(model, activations=True): the tracing hooks run eagerly
    at graph breaks, with no warning from dynamo (this module turns "Dynamo does not know how to
    trace" into an error: the hooks' kernel call, or the eval-frame callback they read, met in
    a traced frame), and record the rows an eager model records, bit for bit."""

    def rows(compile_it: bool) -> list[tuple]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampfused.GradScaler("cpu", **SCALER_KW).watch(model, activations=True)
        run = torch.compile(model, backend=backend) if compile_it else model
        for x in [torch.randn(4, 6) for _ in range(3)]:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = run(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        torch._dynamo.reset()
        report = scaler.report()
        return [(a.module, a.direction, a.abs_max, a.numel, a.dtype) for a in report.activations]

    eager = rows(False)
    assert len(eager) == 10  # (5 modules, forward and backward)
    assert rows(True) == eager


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_model_with_scale_islands_matches_eager(backend: str) -> None:
    """torch.compile(model) with scale islands (GradScaler(islands=...)): the same parameters,
    scales and island factors as the eager model, bit for bit (a factor moved off 1, so an edge
    left unscaled would show), with no more graphs than traced mode alone and at most two graph
    breaks more per island (its entry and exit hooks)."""
    from torch._dynamo.utils import counters

    def run(compile_it: bool, islands: Any) -> tuple:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kw = {"policy": "headroom", "islands": islands} if islands else {"policy": "headroom"}
        scaler = ampfused.GradScaler("cpu", **kw).watch(model, activations=True)
        forward = torch.compile(model, backend=backend) if compile_it else model
        for x in [torch.randn(4, 6, generator=torch.Generator().manual_seed(k)) for k in range(4)]:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = forward(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        graphs = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        torch._dynamo.reset()
        params = [p.detach().clone() for p in model.parameters()]
        return params, scaler.get_scale(), scaler.island_factors(), graphs

    eager = run(False, ["0", "2"])
    assert any(f != 1.0 for f in eager[2].values()), eager[2]
    compiled = run(True, ["0", "2"])
    assert all(torch.equal(a, b) for a, b in zip(eager[0], compiled[0], strict=True))
    assert compiled[1:3] == eager[1:3]
    traced = run(True, None)
    # (the islands' gradient hooks run eagerly: dynamo counts a break for an island's entry
    # hook and for its exit hook at most; no graph more)
    graphs, breaks = compiled[3], traced[3]
    assert graphs[0] <= breaks[0] and graphs[1] <= breaks[1] + 2 * len(eager[2]), (graphs, breaks)


@pytest.mark.parametrize("compile_it", [False, True], ids=["eager", "compiled"])
def test_a_block_island_under_compile_trains_and_says_what_it_measures(compile_it: bool) -> None:
    """A block island (a module with modules inside) under torch.compile(model): it trains as
    eagerly, with its edges scaled (its factor moves off 1), but the graph its forward made is
    not walked (a compiled forward has no autograd nodes of its own between the modules), so
    its interior gradients are not measured there; eagerly they are."""
    from ampfused.scale_islands import INTERIOR

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)) * 0.5)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Block(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampfused.GradScaler("cpu", policy="headroom", islands=["1"])
    scaler.watch(model, activations=True)
    forward = torch.compile(model, backend="eager") if compile_it else model
    interior = []
    for k in range(4):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = forward(x).float().square().mean() * 1e-3
        scaler.scale(loss).backward()
        islands = scaler._island_set.islands
        interior.append(sum(edge == INTERIOR for _, edge, _, _ in islands.edges))
        scaler.step(opt)
        scaler.update()
    torch._dynamo.reset()
    assert scaler.island_factors()["1"] != 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (max(interior) == 0) == compile_it, interior


def test_a_compiled_island_inside_an_eager_block_calls_off_the_blocks_walk() -> None:
    """A leaf island compiled on its own (module.compile()) inside an eager block island: its
    hooks run traced, so it keeps no region for the block's walk, which would measure its
    gradients (at its own scale) as the block's; the block's walk is called off instead (its
    interior is not measured, as under a whole compiled model)."""
    from ampfused.scale_islands import INTERIOR

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)))

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Block(), nn.Linear(8, 3))
    model[1].a.compile(backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampfused.GradScaler("cpu", policy="headroom", islands=["1", "1.a"])
    scaler.watch(model, activations=True)
    for k in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(k))
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        rows = [t for i, edge, _, t in scaler._island_set.islands.edges if edge == INTERIOR]
        assert rows == [], k
        scaler.step(opt)
        scaler.update()
    torch._dynamo.reset()
    assert scaler._island_set.islands._open == []
