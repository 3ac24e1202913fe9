"""``GradScaler.watch``: per-parameter statistics recorded by the pass that unscales, named.

Inf, -inf and NaN are injected into chosen gradients (first, middle, last, several at once;
float16, bfloat16 and float32 gradients; two optimizers on one scaler) and the report must name
exactly those, in parameter order, with their counts, the scale in force and the step.  Norms
are checked against ``torch.linalg.vector_norm`` of the unscaled gradients and keyed as
Lightning's ``grad_norm`` keys them; zero counts, skipped-step logging and the flag of the last
step are checked on runs where the answer is known.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import unittest.mock
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import ampfused
from ampfused.diagnostics import StepReport, Watch

INIT_SCALE = 2.0**12


class Net(nn.Module):
    """Six parameters in a known order, one of them with no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.frozen = nn.Parameter(torch.ones(3))  # never used: its .grad stays None
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _setup(device: str, dtype: torch.dtype = torch.float32, fused: bool = False) -> tuple:
    torch.manual_seed(0)
    model = Net().to(device=device, dtype=dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
    scaler = ampfused.GradScaler(device, init_scale=INIT_SCALE).watch(model)
    return model, opt, scaler


def _backward(model: nn.Module, scaler: Any, device: str, dtype: torch.dtype) -> None:
    x = torch.randn(5, 6, device=device, dtype=dtype)
    scaler.scale(model(x).float().square().mean()).backward()


def _names_with_grads(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is not None]


SPECIALS = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


@pytest.mark.parametrize(
    "where",
    [
        {"embed.weight": ["inf"]},  # first
        {"block.2.bias": ["nan"]},  # middle
        {"head.bias": ["-inf"]},  # last
        {"embed.bias": ["inf", "nan"], "block.0.weight": ["-inf", "-inf"], "head.weight": ["nan"]},
    ],
    ids=["first", "middle", "last", "several"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_report_names_exactly_the_offenders(device: str, dtype: torch.dtype, where: dict) -> None:
    model, opt, scaler = _setup(device, dtype)
    _backward(model, scaler, device, dtype)
    params = dict(model.named_parameters())
    for name, kinds in where.items():
        flat = params[name].grad.view(-1)
        for i, kind in enumerate(kinds):
            flat[2 * i] = SPECIALS[kind]
    if dtype == torch.float16:  # unscale_ refuses float16 gradients, as torch's does
        scaler._check_inf_per_device(opt)  # the read-only pass, as a fused optimizer gets
    else:
        scaler.unscale_(opt)
    report = scaler.report()
    assert isinstance(report, StepReport)
    assert report.skipped and report.step == 0 and report.scale == INIT_SCALE
    order = _names_with_grads(model)
    assert [g.name for g in report.grads] == order  # parameter order, "frozen" has no grad
    assert [g.name for g in report.offenders] == [n for n in order if n in where]
    for g in report.offenders:
        kinds = where[g.name]
        assert (g.pos_inf, g.neg_inf, g.nan) == (
            kinds.count("inf"),
            kinds.count("-inf"),
            kinds.count("nan"),
        )
        assert g.numel == params[g.name].numel()
        assert math.isfinite(g.abs_max)
    assert all(g.non_finite == 0 for g in report.grads if g.name not in where)
    text = str(report)
    assert "step skipped" in text and all(name in text for name in where)
    assert text.index(report.offenders[0].name) <= text.index(report.offenders[-1].name)


def test_two_optimizers_one_report(device: str) -> None:
    model, _, scaler = _setup(device)
    opt_a = torch.optim.SGD(model.embed.parameters(), lr=0.1)
    opt_b = torch.optim.SGD([*model.block.parameters(), *model.head.parameters()], lr=0.1)
    _backward(model, scaler, device, torch.float32)
    model.head.weight.grad[0, 0] = float("nan")
    scaler.unscale_(opt_a)
    scaler.unscale_(opt_b)
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    report = scaler.report()
    assert report is not None and report.skipped
    assert [g.name for g in report.grads] == _names_with_grads(model)
    assert [g.name for g in report.offenders] == ["head.weight"]
    assert scaler.step_skipped()


def test_norms_match_vector_norm_and_lightning_keys(device: str) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.utilities import grad_norm

    model, opt, scaler = _setup(device)
    _backward(model, scaler, device, torch.float32)
    scaler.unscale_(opt)
    ours = scaler.grad_norms()
    theirs = grad_norm(model, norm_type=2)  # the unscaled gradients, after unscale_
    assert list(ours) == list(theirs)
    # Each norm sums n float32 squares: the relative error of a float32 sum of n positive
    # terms is below n * 2^-24 in any order, so two orders differ by at most twice that (and the
    # square root halves a relative error).
    for key, value in theirs.items():
        n = max(p.numel() for p in model.parameters())
        assert ours[key] == pytest.approx(float(value), rel=2 * n * 2.0**-24, abs=0)
    total = torch.linalg.vector_norm(
        torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
        )
    )
    assert ours["grad_2.0_norm_total"] == pytest.approx(float(total), rel=1e-6)


def test_fused_optimizer_route_reports_unscaled_norms(device: str) -> None:
    """The fused optimizer gets a read-only pass; its statistics are of the unscaled values all
    the same, equal to those of the writing pass (float32: both compute v * inv_scale)."""
    norms = []
    for fused in (False, True):
        model, opt, scaler = _setup(device, fused=fused)
        _backward(model, scaler, device, torch.float32)
        if not fused:
            scaler.unscale_(opt)
        scaler.step(opt)
        norms.append(scaler.grad_norms())
        scaler.update()
    assert norms[0] == norms[1]


def test_zero_counts_show_underflow() -> None:
    model, opt, scaler = _setup("cpu")
    _backward(model, scaler, "cpu", torch.float32)
    model.embed.weight.grad[:3].zero_()
    model.head.bias.grad.fill_(-0.0)
    scaler.unscale_(opt)
    report = scaler.report()
    assert report is not None
    zeros = {g.name: g.zeros for g in report.grads}
    assert zeros["embed.weight"] == 3 * 6
    assert zeros["head.bias"] == 2
    assert zeros["block.0.weight"] == int((model.block[0].weight.grad == 0).sum())


def test_report_follows_the_iterations() -> None:
    model, opt, scaler = _setup("cpu")
    for step in range(3):
        opt.zero_grad()
        _backward(model, scaler, "cpu", torch.float32)
        if step == 1:
            model.block[0].bias.grad[0] = float("inf")
        scaler.step(opt)
        during = scaler.report()  # between step() and update(): this iteration's
        assert during is not None and during.step == step and during.skipped == (step == 1)
        assert bool(scaler.step_skipped_tensor()) == (step == 1)
        scaler.update()
        after = scaler.report()  # after update(): still the iteration just finished
        assert after is not None and after.step == step
        assert scaler.step_skipped() == (step == 1)
    assert after.scale == INIT_SCALE / 2  # the iteration after the skip ran at the backed-off scale


@pytest.mark.parametrize("mode", ["log", "warn"])
def test_skipped_steps_are_logged_when_asked(mode: str, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, scaler = _setup("cpu")
    scaler.watch(model, log_skipped=mode)
    caplog.set_level(logging.WARNING, logger="ampfused")
    for step in range(2):
        opt.zero_grad()
        _backward(model, scaler, "cpu", torch.float32)
        if step == 1:
            model.head.weight.grad[0, 0] = float("nan")
        scaler.step(opt)
        if mode == "warn" and step == 1:
            with pytest.warns(RuntimeWarning, match="head.weight"):
                scaler.update()
        else:
            scaler.update()
    if mode == "log":
        assert len(caplog.records) == 1 and "head.weight" in caplog.records[0].getMessage()
    else:
        assert not caplog.records


def test_without_watch_nothing_is_recorded() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampfused.GradScaler("cpu")
    _backward(model, scaler, "cpu", torch.float32)
    scaler.unscale_(opt)
    assert scaler._watch is None
    # Without watch() both readers refuse the same way (report() used to return None).
    for read in (scaler.report, scaler.grad_norms):
        with pytest.raises(RuntimeError, match=r"needs per-parameter statistics.*scaler.watch"):
            read()
    scaler.watch(model)
    scaler.unwatch()
    with pytest.raises(RuntimeError, match="watch"):
        scaler.report()


def test_parameters_not_watched_are_numbered() -> None:
    model, opt, scaler = _setup("cpu")
    scaler.watch([("the embedding", model.embed.weight)])
    _backward(model, scaler, "cpu", torch.float32)
    with pytest.warns(UserWarning, match=r"7 of this optimizer's 8 parameters .* have no name"):
        scaler.unscale_(opt)
    report = scaler.report()
    assert report is not None
    names = [g.name for g in report.grads]
    assert names[0] == "the embedding"
    # named_parameters() lists the module's own `frozen` first: positions 0 (no grad) and 1.
    assert names[1:] == [f"<param {i}>" for i in range(2, 9)]


def test_watch_refuses_what_it_cannot_name() -> None:
    scaler = ampfused.GradScaler("cpu")
    with pytest.raises(TypeError, match="named_parameters"):
        scaler.watch([torch.zeros(1)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not a tensor"):
        scaler.watch([("w", 3.0)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="log_skipped"):
        scaler.watch(Net(), log_skipped="print")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="L2"):
        scaler.watch(Net()).grad_norms(norm_type=1.0)


def test_watch_refuses_an_optimizer_and_unnamed_parameters() -> None:
    """The natural mix-ups (the optimizer, or model.parameters(), where the model goes) are a
    TypeError saying what was given and what to pass; the watch in force stays."""
    model, opt, scaler = _setup("cpu")
    kept = scaler._watch
    pairs = nn.Linear(3, 2)  # a 2-row weight unpacks into a "pair" of rows
    head = "watch(model): expected the model whose parameters to name (a torch.nn.Module), "
    fix = "; pass the module that owns the optimizer's parameters: scaler.watch(model)"
    wrong = {
        "the optimizer": (lambda: scaler.watch(opt), "got an optimizer (Adam)"),
        "the optimizer, traced": (
            lambda: scaler.watch(opt, activations=True),
            "got an optimizer (Adam)",
        ),
        "model.parameters()": (
            lambda: scaler.watch(pairs.parameters()),
            "got a generator (model.parameters()?) whose item 0 is a tensor",
        ),
        "a list of parameters": (
            lambda: scaler.watch(list(pairs.parameters())),
            "got a list of tensors (the parameters?) whose item 0 is a tensor",
        ),
        "a number": (lambda: scaler.watch(3), "got an int"),  # type: ignore[arg-type]
    }
    for label, (call, given) in wrong.items():
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert message.startswith(head) and given in message, (label, message)
        assert message.endswith(fix), (label, message)
        assert scaler._watch is kept, label
    # Every form that names parameters still does.
    for good in (
        model,
        model.named_parameters(),
        list(model.named_parameters()),
        dict(model.named_parameters()).items(),
        dict(model.named_parameters()),
        [("w", model.embed.weight)],
        [],
    ):
        assert scaler.watch(good) is scaler


@pytest.mark.parametrize("watched", ["another module", "no parameters", "some parameters"])
def test_watch_warns_once_of_parameters_it_does_not_name(watched: str) -> None:
    """watch() of a module the optimizer's parameters are not in (or of too few of them): the
    first pass says which gradients the reports will number, at the caller's line; no later
    step does."""
    model, opt, scaler = _setup("cpu")
    target = {
        "another module": nn.Linear(6, 8),
        "no parameters": nn.GELU(),
        "some parameters": model.block,
    }[watched]
    scaler.watch(target)
    expected = {
        "another module": r"none of this optimizer's 8 parameters with gradients has a name",
        "no parameters": r"none of this optimizer's 8 parameters with gradients has a name",
        "some parameters": r"4 of this optimizer's 8 parameters with gradients have no name",
    }[watched]
    _backward(model, scaler, "cpu", torch.float32)
    with pytest.warns(UserWarning, match=expected) as record:
        line = sys._getframe().f_lineno + 1
        scaler.step(opt)
    assert len(record) == 1
    text = str(record[0].message)
    assert (record[0].filename, record[0].lineno) == (__file__, line)
    assert "report() and grad_norms() number them: <param " in text
    assert "Watch the module that owns the optimizer's parameters (scaler.watch(model)" in text
    numbered = [g.name for g in scaler.report().grads if g.name.startswith("<param ")]
    listed = numbered[:5] + ([f"and {len(numbered) - 5} more"] if len(numbered) > 5 else [])
    assert all(name in text for name in listed), (listed, text)
    scaler.update()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            opt.zero_grad()
            _backward(model, scaler, "cpu", torch.float32)
            scaler.step(opt)
            scaler.update()


def _counted_name_checks() -> Any:
    """Watch.check_names, its calls counted."""
    return unittest.mock.patch.object(
        Watch, "check_names", autospec=True, side_effect=Watch.check_names
    )


def test_watch_checks_every_optimizer_of_the_first_iteration_only() -> None:
    """Two optimizers, the second's parameters not watched: its pass warns, though the first
    optimizer's came first and was named.  From the second iteration on no pass looks at the
    names (no Python work per parameter), whatever it holds."""
    model, _, scaler = _setup("cpu")
    opt_a = torch.optim.SGD(model.embed.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.head.parameters(), lr=0.1)

    def iteration(expect_warning: bool) -> None:
        _backward(model, scaler, "cpu", torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler.step(opt_a)
        if expect_warning:
            with pytest.warns(UserWarning, match=r"none of .* 2 parameters .*<param 0>"):
                scaler.step(opt_b)
        else:
            scaler.step(opt_b)
        scaler.update()
        model.zero_grad()

    scaler.watch(model.embed)
    with _counted_name_checks() as check_names:
        for step in range(3):
            iteration(expect_warning=step == 0)
    assert check_names.call_count == 2  # the two passes of the first iteration
    scaler.watch(model)  # a new watch() checks again, and finds every name
    with warnings.catch_warnings(), _counted_name_checks() as check_names:
        warnings.simplefilter("error")
        for _ in range(3):
            iteration(expect_warning=False)
    assert check_names.call_count == 2
    scaler.watch(nn.GELU())  # neither optimizer named: one warning for the two passes
    _backward(model, scaler, "cpu", torch.float32)
    with pytest.warns(UserWarning, match="none of this optimizer's") as record:
        scaler.step(opt_a)
        scaler.step(opt_b)
    assert len(record) == 1 and "<param 0> (shape (8, 6))" in str(record[0].message)
    scaler.update()


def test_master_weights_watch_of_another_module_warns() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    opt = ampfused.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = ampfused.GradScaler("cpu", init_scale=64.0).watch(nn.Linear(4, 4))
    scaler.scale(model(torch.randn(3, 4).half()).float().sum()).backward()
    with pytest.warns(UserWarning, match=r"none of this optimizer's 4 parameters .* <param 3>"):
        scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("fused", [False, True], ids=["unscale_", "fused_optimizer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_report_equals_the_reference_bit_for_bit(
    device: str, dtype: torch.dtype, fused: bool
) -> None:
    """Every value of the report against ampfused.reference's definition of the pass's
    statistics (which fixes the summation order), computed from the gradients before the pass."""
    model, opt, scaler = _setup(device, dtype, fused=fused)
    _backward(model, scaler, device, dtype)
    model.block[2].weight.grad[1, :3] = torch.tensor([0.0, float("inf"), float("nan")])
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    if fused:
        scaler.step(opt)  # the read-only pass; the optimizer unscales on its own
    else:
        scaler.unscale_(opt)
    report = scaler.report()
    assert report is not None
    inv = ampfused.reference.inv_scale_of(torch.tensor(INIT_SCALE))
    rows = ampfused.reference.grad_stats(grads, inv, check_only=fused)
    per_grad, total = ampfused.reference.reduce_grad_stats(rows, [g.numel() for g in grads])
    for g, want in zip(report.grads, per_grad.tolist(), strict=True):
        norm = float(torch.tensor(math.sqrt(want[0]), dtype=torch.float32))
        got = (g.norm, g.abs_max, g.pos_inf, g.neg_inf, g.nan, g.zeros)
        # (the subnormal column is read for traced activation gradients only)
        assert got == pytest.approx((norm, *want[1:6]), rel=0, abs=0, nan_ok=True), g.name
    assert math.isnan(report.total_norm) and math.isnan(total)


def test_lightning_hook_logs_this_steps_norms(tmp_path: Any) -> None:
    """The README's Lightning pattern: grad_norms() in on_before_optimizer_step (Lightning has
    unscaled by then) gives this step's norms, the same values as Lightning's grad_norm."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.utilities import grad_norm

    seen: list[tuple[dict, dict]] = []

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            norms = scaler.grad_norms()
            self.log_dict(norms)
            seen.append((norms, {k: float(v) for k, v in grad_norm(self, norm_type=2).items()}))

    torch.manual_seed(0)
    model = Lit()
    scaler = ampfused.GradScaler("cpu", init_scale=256.0).watch(model)
    data = torch.utils.data.TensorDataset(torch.randn(12, 6))
    trainer = pl.Trainer(
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        default_root_dir=tmp_path,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    assert len(seen) == 3 and math.isfinite(seen[0][0]["grad_2.0_norm_total"])
    for ours, theirs in seen:
        assert list(ours) == list(theirs)
        for k in ours:
            assert ours[k] == pytest.approx(theirs[k], rel=1e-5, nan_ok=True), k
    assert "grad_2.0_norm/net.embed.weight" in trainer.callback_metrics


@pytest.mark.parametrize("check_only", [False, True], ids=["unscale", "check_only"])
def test_scaler_pass_table_equals_reference(device: str, check_only: bool) -> None:
    """The whole table of the op, header included, against ampfused.reference.scaler_pass_."""
    torch.manual_seed(0)
    grads = [
        torch.randn(70000, device=device) * 100,
        torch.randn(5, device=device).bfloat16(),
        torch.zeros(0, device=device),
        torch.randn(3, 4, device=device).half().t(),
    ]
    grads[0][5] = float("inf")
    grads[1][2] = float("nan")
    state = torch.zeros(ampfused.ops.STATE_SIZE, dtype=torch.int32, device=device)
    state[0] = torch.tensor(1024.0, device=device).view(torch.int32)
    state[2], state[3] = 1, 7
    out = []
    for run in (ampfused.ops.scaler_pass_, ampfused.reference.scaler_pass_):
        gs = [g.clone() for g in grads]
        table = torch.empty(
            ampfused.ops.grad_stats_rows(gs),
            len(ampfused.ops.STAT_FIELDS),
            dtype=torch.float64,
            device=device,
        )
        found, nxt = torch.zeros((), device=device), torch.empty_like(state)
        run(gs, found, state, nxt, table, 2.0, 0.5, 2000, check_only=check_only)
        out.append((table.cpu(), nxt.cpu(), found.cpu(), [g.cpu() for g in gs]))
    (ta, na, fa, ga), (tb, nb, fb, gb) = out
    assert torch.equal(ta.nan_to_num(), tb.nan_to_num()) and torch.equal(ta.isnan(), tb.isnan())
    assert ta[0].tolist() == [1024.0, 7.0, 1.0] + [0.0] * (len(ampfused.ops.STAT_FIELDS) - 3)
    assert torch.equal(na, nb) and torch.equal(fa, fb)
    for a, b in zip(ga, gb, strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_watch_again_keeps_the_statistics() -> None:
    model, opt, scaler = _setup("cpu")
    _backward(model, scaler, "cpu", torch.float32)
    scaler.step(opt)
    scaler.update()
    norms, text = scaler.grad_norms(), str(scaler.report())
    scaler.watch(model, log_skipped="log")  # new options, the tables recorded so far kept
    assert scaler.grad_norms() == norms and str(scaler.report()) == text


@pytest.mark.parametrize("call", ["unscale_", "clip_grad_norm_"])
def test_not_covered_warning_points_at_the_callers_line(call: str) -> None:
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ampfused.GradScaler("cpu").watch([("p", p)])
    scaler.scale(torch.ones(()))
    p.grad = two_tensor.TwoTensor(torch.ones(4), torch.ones(4))  # (takes torch's walk)
    with pytest.warns(RuntimeWarning, match="records no statistics") as record:
        line = sys._getframe().f_lineno + 1
        scaler.unscale_(opt) if call == "unscale_" else scaler.clip_grad_norm_(opt, 1.0)
    assert (record[0].filename, record[0].lineno) == (__file__, line)


# ------------------------------------------------------------------------------- never mislead
def test_master_weights_pass_records_the_float16_gradients() -> None:
    """A .half() model with MasterWeights: report() and grad_norms() cover its gradients (the
    unscaled float16 ones the masters' pass reads), with no warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    opt = ampfused.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = ampfused.GradScaler("cpu", init_scale=64.0).watch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(model(torch.randn(3, 4).half()).float().sum()).backward()
        model[1].weight.grad[0, 0] = float("inf")
        want = {
            f"grad_2.0_norm/{n}": p.grad.double().div(64).norm().item()
            for n, p in model.named_parameters()
        }
        scaler.step(opt)
        report, norms = scaler.report(), scaler.grad_norms()
    assert report.skipped and [g.name for g in report.offenders] == ["1.weight"]
    assert norms.keys() - {"grad_2.0_norm_total"} == want.keys()
    for key, value in want.items():
        assert norms[key] == pytest.approx(value, rel=1e-6, nan_ok=True)
    scaler.update()


def test_reading_before_the_first_pass_is_refused() -> None:
    """Before any pass under watch() there is nothing to report: both readers refuse, with the
    refusal they give between scale() and a pass, saying that no pass has run yet (report()
    used to return None, grad_norms() {})."""
    model, opt, scaler = _setup("cpu")
    no_pass = (
        r"^{}\(\) was called before any pass under watch\(\), so there are no statistics yet\. "
        r" Call it after scaler\.unscale_\(optimizer\) or scaler\.step\(optimizer\)\."
    )
    for read in (scaler.report, scaler.grad_norms):
        with pytest.raises(RuntimeError, match=no_pass.format(read.__name__)):
            read()
    _backward(model, scaler, "cpu", torch.float32)  # scale(): still no pass
    for read in (scaler.report, scaler.grad_norms):
        with pytest.raises(RuntimeError, match=no_pass.format(read.__name__)):
            read()
    scaler.unscale_(opt)
    assert scaler.report().step == 0 and scaler.grad_norms()
    scaler.step(opt)
    scaler.update()
    scaler.watch(model)  # a new watch() keeps the statistics recorded so far
    assert scaler.report().step == 0
    scaler.unwatch()
    scaler.watch(model)  # after unwatch(), none
    with pytest.raises(RuntimeError, match=no_pass.format("report")):
        scaler.report()


def test_reading_before_this_iterations_pass_is_refused() -> None:
    model, opt, scaler = _setup("cpu")
    _backward(model, scaler, "cpu", torch.float32)
    scaler.step(opt)
    scaler.update()
    assert scaler.report().step == 0  # after update(): the last iteration, named
    _backward(model, scaler, "cpu", torch.float32)  # iteration 1 begins at scale()
    for read in (scaler.report, scaler.grad_norms):
        with pytest.raises(RuntimeError, match=r"before this iteration's pass.*last iteration"):
            read()
    scaler.unscale_(opt)
    assert scaler.report().step == 1 and scaler.grad_norms()
    scaler.step(opt)
    scaler.update()
    assert scaler.report().step == 1


def test_one_step_numbering_for_report_log_and_floor_warning() -> None:
    """The skipped step the report names is the step the at_min_scale warning names."""
    model, opt, _ = _setup("cpu")
    scaler = ampfused.GradScaler("cpu", init_scale=2.0, min_scale=2.0, at_min_scale="warn")
    scaler.watch(model)
    for step in range(3):
        _backward(model, scaler, "cpu", torch.float32)
        if step == 2:
            model.head.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        expected = pytest.warns(UserWarning, match="of step 2 had inf/NaN")
        with expected if step == 2 else contextlib.nullcontext():
            scaler.update()
        opt.zero_grad()
    assert scaler.report().step == 2 and scaler.report().skipped
    assert str(scaler.report()).startswith("ampfused step 2:")
