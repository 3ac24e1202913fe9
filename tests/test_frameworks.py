"""``ampfused.GradScaler`` inside PyTorch Lightning, Accelerate and the Hugging Face Trainer.

Each framework builds its own ``torch.amp.GradScaler`` (or, on the CPU, none at all). The
page docs/frameworks.md ("Using it with Lightning, Accelerate and the HF Trainer") says how to
hand it ours instead; these tests run exactly those incantations. A tiny model trains for a few
steps with float16 autocast through the framework, and the test checks from the outside that

- the framework holds our scaler object and called its ``scale``/``step``/``update`` every step;
- our scaler's scale and growth tracker end where torch's do over the same steps (the third
  step overflows and is skipped, the scale backs off, clean steps grow it again), so our update
  ran, not the framework's;
- every parameter equals, bit for bit, a plain training loop with ``torch.amp.GradScaler``, so
  the gradients that reached the optimizer were unscaled, and inf/NaN steps were skipped.

The "trap" tests pin that page's warnings: on the CPU the plain fp16 flags of all three give
no scaler (Lightning switches to bf16, Accelerate and the Trainer to float32, silently or with a
warning), and a scaler handed to Accelerate after ``prepare()`` is not the one that steps. If a
framework release changes one of these, docs/frameworks.md needs the same change.

A test is skipped when its framework is absent (``pip install lightning accelerate
transformers``). The CUDA variants run the same incantations with ``"cuda"``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ampfused

N, D_IN, D_HID, BATCH = 20, 8, 16, 4
STEPS = N // BATCH
CLIP = 1.0
# With these, step 2 overflows at 2**16 and step 3 (OVERFLOW_ROW) at any scale; both are
# skipped and back off, and growth_interval 2 lets the clean steps 4-5 grow the scale again.
SCALER_KW: dict[str, Any] = {"init_scale": 2.0**16, "growth_interval": 2}
OVERFLOW_ROW = 8  # 1e5 in the third batch: the first Linear's float16 output overflows

# lightning 2.6 on torch 2.14 warns about torch's own pytree API; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*")

clip_ids = pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])


# ----------------------------------------------------------------------------- shared pieces
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets, on the CPU; one row large enough to overflow float16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D_IN, generator=g)
    y = torch.randn(N, 1, generator=g)
    x[OVERFLOW_ROW] = 1e5
    return x, y


def _net() -> nn.Sequential:
    """The same initial weights on every call, without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, 1))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(*_data()), batch_size=BATCH)


def _reference(device: str, clip: bool) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """A plain loop with torch.amp.GradScaler: final parameters (on the CPU) and scaler state."""
    net = _net().to(device)
    opt = _sgd(net.parameters())
    scaler = torch.amp.GradScaler(device, **SCALER_KW)
    scales = []
    for xb, yb in _loader():
        xb, yb = xb.to(device), yb.to(device)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(net(xb), yb)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip:
            nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    # what these tests rely on: a skipped step (back-off), a growth, a final scale != initial
    steps = list(zip([SCALER_KW["init_scale"], *scales[:-1]], scales, strict=True))
    assert any(b < a for a, b in steps) and any(b > a for a, b in steps), scales
    assert scales[-1] != SCALER_KW["init_scale"], scales
    return [p.detach().cpu() for p in net.parameters()], scaler.state_dict()


def _spy(scaler: ampfused.GradScaler) -> Counter:
    """Count calls of the scaler's public methods (instance attributes wrapping the methods)."""
    calls: Counter = Counter()
    for name in ("scale", "unscale_", "step", "update"):
        method = getattr(scaler, name)

        def counted(*args: Any, _method: Any = method, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _method(*args, **kwargs)

        setattr(scaler, name, counted)
    return calls


def _params_equal(params: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    got = [p.detach().cpu() for p in params]
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _check_ours_ran(
    held: object,
    scaler: ampfused.GradScaler,
    calls: Counter,
    params: list[torch.Tensor],
    device: str,
    clip: bool,
) -> None:
    want_params, want_state = _reference(device, clip)
    assert held is scaler, f"the framework holds {held!r}, not the ampfused scaler it was given"
    assert isinstance(held, ampfused.GradScaler)
    assert (calls["scale"], calls["step"], calls["update"]) == (STEPS, STEPS, STEPS), calls
    state = scaler.state_dict()
    state.pop("ampfused")  # policy and counters: torch's scaler has none
    assert state == want_state
    assert _params_equal(params, want_params), "parameters differ from torch.amp.GradScaler's run"


def _device_count_guard(device: str) -> None:
    # The HF Trainer wraps the model in nn.DataParallel when it sees several GPUs.
    if device == "cuda" and torch.cuda.device_count() > 1:
        pytest.skip("the HF Trainer uses nn.DataParallel with several visible GPUs")


# -------------------------------------------------------------------------------- Lightning
QUIET_LIGHTNING: dict[str, Any] = {
    "devices": 1,
    "max_epochs": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


def _lightning_module(pl: Any) -> Any:
    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            xb, yb = batch
            return F.mse_loss(self.net(xb), yb)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _sgd(self.parameters())

    return TinyModule()


def test_lightning_trainer(device: str, tmp_path: Any) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins import MixedPrecision

    scaler = ampfused.GradScaler(device, **SCALER_KW)
    calls = _spy(scaler)
    model = _lightning_module(pl)
    trainer = pl.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        plugins=[MixedPrecision("16-mixed", device, scaler=scaler)],  # docs/frameworks.md's line
        default_root_dir=tmp_path,
        **QUIET_LIGHTNING,
    )
    trainer.fit(model, _loader())
    # Lightning unscales before its on_before_optimizer_step hook, every step
    assert calls["unscale_"] >= STEPS
    _check_ours_ran(
        trainer.precision_plugin.scaler, scaler, calls, list(model.parameters()), device, False
    )


def test_lightning_fabric(device: str) -> None:
    pytest.importorskip("lightning.fabric")
    from lightning.fabric import Fabric
    from lightning.fabric.plugins import MixedPrecision

    scaler = ampfused.GradScaler(device, **SCALER_KW)
    calls = _spy(scaler)
    fabric = Fabric(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", device, scaler=scaler)],  # docs/frameworks.md's line
    )
    net = _net()
    model, optimizer = fabric.setup(net, _sgd(net.parameters()))
    for xb, yb in fabric.setup_dataloaders(_loader()):
        optimizer.zero_grad()
        fabric.backward(F.mse_loss(model(xb), yb))
        optimizer.step()
    _check_ours_ran(
        fabric.strategy.precision.scaler, scaler, calls, list(model.parameters()), device, False
    )


def test_lightning_trap_cpu_16_mixed_flag_is_bf16_without_scaler(tmp_path: Any) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    with pytest.warns(UserWarning, match="not supported on\\s+CPU"):
        trainer = pl.Trainer(
            accelerator="cpu", precision="16-mixed", default_root_dir=tmp_path, **QUIET_LIGHTNING
        )
    assert trainer.precision_plugin.precision == "bf16-mixed"
    assert trainer.precision_plugin.scaler is None


# ------------------------------------------------------------------------------- Accelerate
@pytest.fixture
def fresh_accelerate_state() -> Any:
    """Accelerate keeps process-wide singletons; start and leave each test with none."""
    state = pytest.importorskip("accelerate.state")

    def reset() -> None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()

    reset()
    yield
    reset()


def _accelerate_run(
    device: str, clip: bool, incantation: str
) -> tuple[Any, ampfused.GradScaler, Counter, Any]:
    """Train through Accelerate. incantation: "readme", or one of the wrong ways
    "scaler_after_prepare" (native_amp set before prepare()) and "native_amp_not_set"."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=device == "cpu")
    scaler = ampfused.GradScaler(accelerator.device.type, **SCALER_KW)
    calls = _spy(scaler)
    if incantation in ("readme", "native_amp_not_set"):
        accelerator.scaler = scaler
    if incantation in ("readme", "scaler_after_prepare"):
        accelerator.native_amp = True
    net = _net()
    model, optimizer, loader = accelerator.prepare(net, _sgd(net.parameters()), _loader())
    if incantation == "scaler_after_prepare":
        accelerator.scaler = scaler
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return model, scaler, calls, optimizer


@clip_ids
def test_accelerate(device: str, clip: bool, fresh_accelerate_state: Any) -> None:
    model, scaler, calls, optimizer = _accelerate_run(device, clip, "readme")
    if clip:  # accelerator.clip_grad_norm_ unscales through our scaler first
        assert calls["unscale_"] >= STEPS
    _check_ours_ran(optimizer.scaler, scaler, calls, list(model.parameters()), device, clip)
    assert optimizer.step_was_skipped is False  # the last step was clean


@pytest.mark.parametrize("wrong", ["scaler_after_prepare", "native_amp_not_set"])
def test_accelerate_trap_wrong_incantations_train_differently(
    wrong: str, fresh_accelerate_state: Any
) -> None:
    want_params, _ = _reference("cpu", clip=False)
    model, scaler, calls, optimizer = _accelerate_run("cpu", False, wrong)
    assert not _params_equal(list(model.parameters()), want_params)
    if wrong == "scaler_after_prepare":
        # backward() scaled the loss with our scaler, but the optimizer never asked it to
        # unscale or skip: the scaled (and inf/NaN) gradients reached SGD
        assert optimizer.scaler is not scaler
        assert calls["scale"] == STEPS and calls["step"] == 0
        assert not all(torch.isfinite(p).all() for p in model.parameters())
    else:
        # no autocast: float32 all along, nothing overflows, the scale only grows
        assert scaler.get_scale() > SCALER_KW["init_scale"]


def test_accelerate_trap_cpu_fp16_is_off(fresh_accelerate_state: Any) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.mixed_precision == "fp16"
    assert accelerator.scaler is None and accelerator.native_amp is False


# ----------------------------------------------------------------------------- HF Trainer
class _TinyHFModel(nn.Module):
    """What the HF Trainer expects of a model: keyword inputs, a dict with "loss"."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


class _DictDataset(Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _hf_trainer(trainer_cls: Any, device: str, clip: bool, tmp_path: Any) -> Any:
    from transformers import TrainingArguments

    model = _TinyHFModel()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        fp16=True,
        use_cpu=device == "cpu",
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        max_grad_norm=CLIP if clip else 0.0,
        lr_scheduler_type="constant",
        train_sampling_strategy="sequential",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    return trainer_cls(
        model=model,
        args=args,
        train_dataset=_DictDataset(),
        optimizers=(_sgd(model.parameters()), None),
    )


@clip_ids
def test_hf_trainer(device: str, clip: bool, tmp_path: Any, fresh_accelerate_state: Any) -> None:
    transformers = pytest.importorskip("transformers")
    _device_count_guard(device)
    made: list[tuple[ampfused.GradScaler, Counter]] = []

    class AmpfusedTrainer(transformers.Trainer):
        # docs/frameworks.md's subclass, with the test's scaler arguments and call counter
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if self.args.fp16 and not (self.is_fsdp_enabled or self.is_deepspeed_enabled):
                scaler = ampfused.GradScaler(self.accelerator.device.type, **SCALER_KW)
                made.append((scaler, _spy(scaler)))
                self.accelerator.scaler = scaler
                self.accelerator.native_amp = True  # CPU: Accelerate leaves fp16 off there

    trainer = _hf_trainer(AmpfusedTrainer, device, clip, tmp_path)
    with torch.random.fork_rng():  # Trainer.train() reseeds the global RNG
        trainer.train()
    assert len(made) == 1
    scaler, calls = made[0]
    assert trainer.accelerator.scaler is scaler
    _check_ours_ran(
        trainer.optimizer.scaler, scaler, calls, list(trainer.model.parameters()), device, clip
    )


def test_hf_trainer_trap_cpu_fp16_is_off(tmp_path: Any, fresh_accelerate_state: Any) -> None:
    transformers = pytest.importorskip("transformers")
    trainer = _hf_trainer(transformers.Trainer, "cpu", False, tmp_path)
    assert trainer.args.fp16 is True
    assert trainer.accelerator.scaler is None and trainer.accelerator.native_amp is False
