"""Every float32 island the report suggests (``report.suggested_islands``) is tried: applied with
``ampfused.keep_float32`` and stepped again at the scale that overflowed, it must make the step
finite.  Where the report suggests none, the test checks what the report says instead: the
smaller islands it rules out do not help, the scale it says would fit does and the next one up
does not, and when it says the scale does not explain the inf/NaN, neither a lower scale nor the
island it would otherwise have needed helps.

The models: a transformers Llama (2 layers, eager and sdpa attention) whose layer-1 ``o_proj``
weight is scaled up by 4,096 and ``v_proj`` down by as much (the forward unchanged, the
backward's gradient overflowing inside the attention, or in ``v_proj``'s weight gradient at
lower scales); a GPT-2 and a convnet with a forward overflow (from ``test_activations``); a
GPT-2 whose MLP makes NaN in backward at a chosen step; the issue's nn.Sequential convnet whose
backward overflows in conv2's or the last Linear's input gradient (an island there may be a run
of consecutive children; the first step's report suggests none, and ``keep_float32`` with that
empty suggestion changes nothing).  Float16 autocast on the CPU, SGD with lr 0 (the weights
never move, so the iteration before an overflow is an exact reference).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import pytest
import torch
from test_activations import FORWARD_CASES, gpt2, gpt2_loss
from torch import nn

import ampfused
from ampfused.diagnostics import StepReport

transformers = pytest.importorskip("transformers")

F16_MAX = torch.finfo(torch.float16).max
LAYER = "model.layers.1.self_attn"


# ------------------------------------------------------------------------------- models
def llama(attn: str, factor: float = 4096.0) -> nn.Module:
    """Layer 1's o_proj weight times `factor`, v_proj's divided by it: the attention's output is
    the same, the gradient between o_proj's backward and v_proj's is `factor` times larger."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation=attn,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_submodule(f"{LAYER}.o_proj").weight.mul_(factor)
        model.get_submodule(f"{LAYER}.v_proj").weight.div_(factor)
    return model


def llama_loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.autocast("cpu", dtype=torch.float16):
        return model(input_ids=ids, labels=ids).loss


class NaNBackwardWhenOn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, on):  # noqa: ANN001, ANN205
        ctx.on = on
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return (grad * float("nan") if ctx.on else grad), None


class NaNGradSwitch(nn.Module):
    """Identity in forward; in backward its input gradient is NaN while `on`."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NaNBackwardWhenOn.apply(x, self.on)


Loss = Callable[[nn.Module, int], torch.Tensor]


def iterations(
    model: nn.Module,
    loss_fn: Loss,
    scales: Sequence[float],
    before_last: Callable[[], object] | None = None,
) -> StepReport:
    """One iteration per scale (set with ``update(new_scale)``), on one watching scaler;
    `before_last` runs before the last.  The last iteration's report."""
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ampfused.GradScaler("cpu", init_scale=scales[0])
    scaler.watch(model, activations=True)
    for i, scale in enumerate(scales):
        if i:
            scaler.update(scale)
        if i == len(scales) - 1 and before_last is not None:
            before_last()
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_fn(model, 0)).backward()
        scaler.step(opt)
    scaler.update()
    return scaler.report()


def skipped_at(model: nn.Module, loss_fn: Loss, scale: float, islands: Sequence[str] = ()) -> bool:
    """Whether one step at `scale` (a fresh scaler) is skipped, with `islands` in float32."""
    island = ampfused.keep_float32(model, list(islands)) if islands else None
    try:
        model.zero_grad(set_to_none=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = ampfused.GradScaler("cpu", init_scale=scale)
        scaler.scale(loss_fn(model, 0)).backward()
        scaler.step(opt)
        scaler.update()
        return scaler.step_skipped()
    finally:
        if island is not None:
            island.remove()


def finite_bound(report: StepReport) -> float:
    """The oracle for "the traced gradients that stayed finite would fit up to": the scale at
    which the largest finite float16 gradient (an output gradient, or a parameter gradient of a
    module whose outputs were float16) reaches 65,504."""
    f16 = {
        a.module
        for a in report.activations
        if a.direction == "forward" and a.dtype == torch.float16
    }
    levels = [
        a.abs_max
        for a in report.activations
        if a.direction == "backward" and a.dtype == torch.float16 and not a.non_finite
    ]
    levels += [
        g.abs_max * report.scale
        for g in report.grads
        if g.name.rpartition(".")[0] in f16 and not g.non_finite
    ]
    return report.scale * F16_MAX / max(levels)


def suggestion(report: StepReport) -> list[str]:
    """The islands the report suggests, checked against its text."""
    names = report.suggested_islands
    text = str(report)
    if names:
        assert f"ampfused.keep_float32(model, {names!r})" in text
    else:
        assert "keep_float32" not in text
    return names


# ------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("case", ["gpt2-mlp.c_proj", "gpt2-attention-score", "convnet-conv1"])
def test_forward_island_it_suggests_lets_the_step_through(case):
    make, loss_fn, blow, origin, _ = FORWARD_CASES[case]
    model = make(0)
    blow(model)
    report = iterations(model, loss_fn, [2.0**10])
    assert report.skipped and report.forward_origin.module == origin
    names = suggestion(report)
    assert len(names) == 1
    assert not skipped_at(model, loss_fn, report.scale, names), names


# ------------------------------------------------------------------------------- backward
# (attention, the scales of the iterations: the last overflows, the one before is finite; the
# island that must be suggested)
BACKWARD_CASES = {
    # The gradient passes 65,504 between o_proj's backward and v_proj's output (in the
    # attention's own code): the island must hold the whole attention.
    "eager-activation": ("eager", [256.0, 65536.0], LAYER),
    "sdpa-activation": ("sdpa", [256.0, 65536.0], LAYER),
    "eager-just-over": ("eager", [128.0, 2048.0], LAYER),
    # At 512 every output gradient fits, but v_proj's weight gradient (computed in float16)
    # does not: an island on v_proj computes it in float32.
    "eager-weight-gradient": ("eager", [256.0, 512.0], f"{LAYER}.v_proj"),
}


@pytest.mark.parametrize("case", BACKWARD_CASES)
def test_backward_island_it_suggests_lets_the_step_through(case):
    attn, scales, expected = BACKWARD_CASES[case]
    model = llama(attn)
    report = iterations(model, llama_loss, scales)
    assert report.skipped and report.forward_origin is None
    assert report.reference is not None and report.reference.scale == scales[0]
    names = suggestion(report)
    assert names == [expected], str(report)
    assert not skipped_at(model, llama_loss, report.scale, names), names
    # The message states the scale, the step it measured by, and the scale that fits.
    fit = report.fitting_scale
    text = str(report)
    assert f"scale {report.scale:g} was too large for this backward" in text
    assert f"scale {scales[0]:g}, all finite" in text
    assert f"fit up to scale {fit:.4g}" in text
    assert f"backoff_factor (0.5 by default: {report.scale / 2:g} next)" in text


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fitting_scale_is_the_largest_that_fits(attn):
    """What the report says fits does, and 10% more does not (the bound is the traced
    magnitudes' own, and here the binding one is traced)."""
    model = llama(attn)
    report = iterations(model, llama_loss, [256.0, 65536.0])
    fit = report.fitting_scale
    assert fit is not None and 256.0 < fit < 512.0  # (512 overflows v_proj's weight gradient)
    assert report.reference.fitting_scale == fit  # (a finite step's own)
    assert not skipped_at(model, llama_loss, 0.9 * fit)
    assert skipped_at(model, llama_loss, 1.1 * fit)
    halvings = re.search(r"(\d+) halvings? reach", str(report))
    assert halvings and 65536.0 / 2 ** int(halvings[1]) <= fit < 65536.0 / 2 ** (
        int(halvings[1]) - 1
    )


# ------------------------------------------------------------------------------- no island
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_island_from_one_overflowing_trace(attn):
    """The issue's case: the first step overflows, so no finite trace says what the gradients
    below the overflow would be.  The report suggests nothing, names the smallest island that
    could work, and what it rules out (islands on v_proj, and on v_proj and o_proj: the gradient
    is cast back to float16 between them) indeed does not help."""
    model = llama(attn)
    report = iterations(model, llama_loss, [65536.0])
    assert report.skipped and report.forward_origin is None and report.reference is None
    assert report.backward_origin.module == f"{LAYER}.v_proj"
    assert report.backward_producer == f"{LAYER}.o_proj"
    assert suggestion(report) == []
    assert report.smallest_island == LAYER
    assert report.fitting_scale is None
    text = str(report)
    assert "a scale that fits is below 65536" in text
    assert f"would fit up to scale {finite_bound(report):.4g}" in text
    assert "backoff_factor (0.5 by default: 32768 next)" in text
    assert f"one would have to hold at least {LAYER}," in text
    assert "no finite trace of the step before" in text
    for smaller in ([f"{LAYER}.v_proj"], [f"{LAYER}.v_proj", f"{LAYER}.o_proj"]):
        assert skipped_at(model, llama_loss, 65536.0, smaller), smaller


def test_no_island_when_the_scale_does_not_explain_it():
    """NaN made in backward from finite values: at this scale the iteration before puts every
    traced gradient within range, so the report suggests neither an island nor a scale; and
    neither the island that would have held it nor a scale of 1 lets the step through."""
    model = gpt2(0)
    switch = NaNGradSwitch()
    model.transformer.h[0].mlp.act = switch  # (in place of the GELU)
    on = lambda: setattr(switch, "on", True)  # noqa: E731
    report = iterations(model, gpt2_loss, [1024.0, 1024.0], before_last=on)
    assert report.skipped and report.forward_origin is None
    assert report.reference is not None
    assert report.backward_origin.module == "transformer.h.0.mlp.c_fc"
    assert suggestion(report) == []
    assert report.fitting_scale >= report.scale
    text = str(report)
    assert "the scale does not explain it" in text
    assert "no help with what the scale does not explain" in text
    assert f"fit up to scale {report.fitting_scale:.4g}" in text
    region = report.smallest_island
    assert region == "transformer.h.0.mlp"
    assert skipped_at(model, gpt2_loss, report.scale, [region])
    assert skipped_at(model, gpt2_loss, 1.0)


# ------------------------------------------------------------------------------- nn.Sequential
# The issue's convnet (issue 37 §5): an nn.Sequential whose backward overflows in conv2's input
# gradient (its weight x3e4) or in the last Linear's (x1e5).  Between two children of an
# nn.Sequential nothing runs but autocast's casts, so an island may be a run of consecutive
# children.
def sequential_convnet(blow: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    with torch.no_grad():
        if blow == "conv2":
            model[2].weight.mul_(3e4)
        else:
            model[6].weight.mul_(1e5)
    return model


def sequential_loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        return nn.functional.cross_entropy(model(x), y)


# (the module whose weight is blown up: the run an island needs at least at the first step, the
# backward origin, its producer)
SEQUENTIAL_CASES = {"conv2": (["1", "2"], "1", "2"), "linear": (["5", "6"], "5", "6")}


@pytest.mark.parametrize("blow", SEQUENTIAL_CASES)
def test_sequential_first_overflow_suggests_nothing_and_the_documented_line_is_safe(blow):
    """The first step at torch's default scale overflows in backward: no finite trace, so no
    island can be shown to help.  The documented ``keep_float32(model,
    report.suggested_islands)`` then changes nothing and warns; the report's reason is the
    model's own (nothing but autocast's casts between the two modules: an island on the producer
    alone hands the gradient back in float16), and it is true: that island alone does not let
    the step through; the report says what to do instead."""
    needed, origin, producer = SEQUENTIAL_CASES[blow]
    model = sequential_convnet(blow)
    report = iterations(model, sequential_loss, [65536.0])
    assert report.skipped and report.forward_origin is None and report.reference is None
    assert report.backward_origin.module == origin and report.backward_producer == producer
    assert suggestion(report) == []
    assert report.needed_islands == needed
    assert report.smallest_island is None  # (no single module smaller than the model)
    text = str(report)
    assert "code between them" not in text, text
    assert "nothing runs between them but autocast's casts" in text, text
    assert f"an island on {producer} alone would hand the gradient back to {origin}" in text
    assert f"one would have to hold at least {needed[0]} and {needed[1]}," in text
    assert "policy='headroom'" in text and "init_scale=" in text
    assert skipped_at(model, sequential_loss, 65536.0, [producer])
    with pytest.warns(UserWarning, match="no module given, so nothing runs in float32"):
        island = ampfused.keep_float32(model, report.suggested_islands)
    assert island.names == [] and "forward" not in vars(model[int(producer)])
    island.remove()


def test_sequential_run_it_suggests_lets_the_step_through():
    """With a finite step before it, the Linear x1e5 convnet's overflow at scale 8 needs conv1
    to conv2 in float32 (their weight gradients pass 65,504): the report suggests the run of
    children 0, 1 and 2, which lets the step through, where the shorter runs do not."""
    model = sequential_convnet("linear")
    report = iterations(model, sequential_loss, [2.0, 8.0])
    assert report.skipped and report.reference is not None
    names = suggestion(report)
    assert names == ["0", "1", "2"], str(report)
    assert "consecutive children of the nn.Sequential <model>" in str(report)
    assert not skipped_at(model, sequential_loss, 8.0, names)
    for shorter in (["1", "2"], ["2"]):
        assert skipped_at(model, sequential_loss, 8.0, shorter), shorter


@pytest.mark.parametrize("blow", SEQUENTIAL_CASES)
def test_sequential_what_else_the_report_says_works(blow):
    """The report's "what else": torch's rule backs off one skipped step per halving (13 and 15
    of them here, from 65,536), where policy='headroom' under watch(model, activations=True)
    starts at 1.0 and moves the scale by the traced magnitudes: no step skipped."""
    skipped = {}
    for policy in ("torch", "headroom"):
        model = sequential_convnet(blow)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = ampfused.GradScaler("cpu", policy=policy).watch(model, activations=True)
        for _ in range(20):
            opt.zero_grad(set_to_none=True)
            scaler.scale(sequential_loss(model)).backward()
            scaler.step(opt)
            scaler.update()
        skipped[policy] = scaler.counters()["skipped_steps"]
    assert skipped == {"torch": {"conv2": 13, "linear": 15}[blow], "headroom": 0}, skipped
