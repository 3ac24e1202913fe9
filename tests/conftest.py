"""Shared pytest set-up for the ampfused tests: the ``device`` fixture and the opt-in markers.

- ``device``: every test that takes it runs once on ``"cpu"`` and once on ``"cuda"``; the CUDA
  run carries ``pytest.mark.cuda`` (select or deselect it with ``-m cuda`` / ``-m "not cuda"``).
- ``@pytest.mark.cuda``: skipped when ``torch.cuda.is_available()`` is False.
- ``@pytest.mark.bigmem``: allocates several GB; skipped unless a GPU is present or the
  environment sets ``AMPFUSED_BIGMEM=1``.
- ``--device-audit``: the CPU proxy for the CUDA runs (see :class:`DeviceAudit`).  A tensor a
  test makes without ``device=`` lives on the CPU even when the test runs on CUDA; on a CPU-only
  machine that mistake is invisible, because both are the CPU.  With the option, the ``"cpu"``
  variant of every test that takes ``device`` tracks which tensors came from the fixture's device
  and which were made without it, and fails where a CUDA run would have failed: an op mixing the
  two, a CPU gradient assigned to a device parameter.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

HAS_CUDA: bool = torch.cuda.is_available()
BIGMEM: bool = os.environ.get("AMPFUSED_BIGMEM") == "1" or HAS_CUDA

_SKIP_CUDA = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
_SKIP_BIGMEM = pytest.mark.skip(
    reason="allocates several GB: runs with a GPU present or with AMPFUSED_BIGMEM=1"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device-audit",
        action="store_true",
        help="run the cpu variant of device-parametrized tests as a stand-in for cuda: fail "
        "where a tensor made without device= meets one made on the test's device",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # One place decides the skips, so a marker on a test, a class or a fixture param all work.
    for item in items:
        if not HAS_CUDA and item.get_closest_marker("cuda") is not None:
            item.add_marker(_SKIP_CUDA)
        if not BIGMEM and item.get_closest_marker("bigmem") is not None:
            item.add_marker(_SKIP_BIGMEM)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    """The device a test runs on, as a string ("cpu" or "cuda")."""
    if request.param != "cpu" or not request.config.getoption("--device-audit"):
        yield request.param
        return
    audit = DeviceAudit()
    with audit:
        yield AuditDevice("cpu")
    if audit.violations:
        pytest.fail("where a CUDA run fails:\n" + "\n".join(audit.violations), pytrace=False)


# ------------------------------------------------------------------------------- device audit
class AuditDevice(str):
    """The string "cpu", marked as the test's device: what the fixture yields under the audit."""

    __slots__ = ()


_TESTS = os.path.dirname(os.path.abspath(__file__))
_PLACE = "_ampfused_audit_place"  # attribute set on every tensor whose origin is known
ON_DEVICE, ON_HOST = "the test's device", "the host (no device=)"
# Ops that legitimately take tensors from two devices: copies and moves.
_MOVES = {"copy_", "to", "cpu", "cuda", "_has_compatible_shallow_copy_type"}
# Elementwise ops, where CUDA takes a 0-dim CPU tensor as a scalar (elsewhere it raises, e.g.
# torch.equal, torch.stack, torch.testing.assert_close's isclose after its device check).
_SCALAR_OK = {
    f"{pre}{op}{post}"
    for op in ("add", "sub", "mul", "div", "truediv", "rsub", "pow", "eq", "ne", "lt", "le")
    + ("gt", "ge", "and", "or", "xor", "true_divide", "where", "clamp", "lerp", "addcmul")
    + ("addcdiv", "maximum", "minimum", "fill", "masked_fill", "setitem", "copy")
    for pre, post in (("", ""), ("", "_"), ("__", "__"), ("__r", "__"), ("__i", "__"))
}


class DeviceAudit(TorchFunctionMode):
    """Tags each tensor with where a CUDA run would have put it, and records the ops that mix.

    Rules, as CUDA applies them: a factory given the fixture's device (or ``.to``/``.cuda()`` of
    it, or the ``.device`` of a tensor there) makes a tensor on the device; a factory given no
    device, or ``.cpu()``, one on the host; any other op's result is where its inputs are.  An op
    mixing a device tensor with a host tensor is a violation, unless the host tensor is an index
    or a 0-dim operand of an elementwise op (CUDA takes those); so is a host gradient assigned to
    a device parameter.  Tensors made in C++ (gradients from autograd, the scalers' state) are
    untagged and never flagged; ``p.grad`` read from Python takes ``p``'s place.
    """

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        # torch.device objects seen: id -> (the object, kept alive so ids stay unique; place)
        self._devices: dict[int, tuple[torch.device, str | None]] = {}

    def _place_of_device(self, dev: Any) -> str | None:
        if isinstance(dev, AuditDevice):
            return ON_DEVICE
        if isinstance(dev, str):
            return ON_HOST  # a literal "cpu" stays on the host in a CUDA run
        return self._devices.get(id(dev), (None, None))[1]  # else unknown: could be either

    def _remember(self, dev: Any, place: str | None) -> None:
        if isinstance(dev, torch.device) and place is not None:
            self._devices[id(dev)] = (dev, place)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        prop = getattr(getattr(func, "__self__", None), "__name__", "")  # "grad" for p.grad
        out = func(*args, **kwargs)
        if name == "_parse_to":  # Module.to(device) turns the string into a torch.device
            if any(isinstance(a, AuditDevice) for a in args):
                self._remember(out[0], ON_DEVICE)
            return out

        checked = list(args) + list(kwargs.values())
        if name in ("__getitem__", "__setitem__"):
            checked.pop(1)  # CUDA accepts CPU index tensors
        tensors = [t for t in tree_flatten(checked)[0] if isinstance(t, torch.Tensor)]
        places = [getattr(t, _PLACE, None) for t in tensors]

        if name == "__get__" and prop == "device" and tensors:
            self._remember(out, places[0])
            return out
        if name == "__set__" and prop == "grad" and len(tensors) == 2:
            if places[0] == ON_DEVICE and places[1] == ON_HOST:
                self._record(f"p.grad = {_describe(tensors[1])}: the gradient is on {ON_HOST}")
            return out
        if name == "__set__" and prop == "data" and len(tensors) == 2:
            _tag(tensors[0], places[1])
            return out

        explicit = kwargs.get("device")
        if name in ("to", "cuda", "cpu"):
            rest = [a for a in args[1:] if a is not None]
            if name == "cpu":
                place = ON_HOST
            elif name == "cuda":
                place = ON_DEVICE
            elif rest and isinstance(rest[0], torch.Tensor):
                place = getattr(rest[0], _PLACE, None)
            elif rest and isinstance(rest[0], (str, torch.device)):
                place = self._place_of_device(rest[0])
            elif explicit is not None:
                place = self._place_of_device(explicit)
            else:
                place = places[0] if places else None
        elif explicit is not None:
            place = self._place_of_device(explicit)
        elif not tensors:
            place = ON_HOST  # torch.zeros(3), torch.tensor([...]): the default device
        else:
            place = ON_DEVICE if ON_DEVICE in places else (ON_HOST if ON_HOST in places else None)
            if ON_DEVICE in places and name not in _MOVES:
                for t, p in zip(tensors, places, strict=True):
                    if p == ON_HOST and (t.dim() > 0 or name not in _SCALAR_OK):
                        self._record(f"{name or func}: {_describe(t)} is on {ON_HOST}")
                        break
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                _tag(t, place)
        return out

    def _record(self, what: str) -> None:
        # Not raised: the test runs on (everything is on the CPU) and its teardown lists them all.
        frames = [
            f
            for f in traceback.extract_stack()
            if f.filename.startswith(_TESTS) and f.filename != __file__
        ]
        where = f"{os.path.relpath(frames[-1].filename)}:{frames[-1].lineno}: " if frames else ""
        self.violations.append(f"{where}{what} while other inputs are on the test's device")


def _tag(t: torch.Tensor, place: str | None) -> None:
    if place is not None:
        try:
            setattr(t, _PLACE, place)
        except (AttributeError, TypeError):  # tensors that take no attributes stay untagged
            pass


def _describe(t: torch.Tensor) -> str:
    return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {list(t.shape)}"


def _raiser(name: str) -> Callable[..., Any]:
    def sync(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} called on a route that must not sync with the host")

    return sync


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every Python-level way to read a tensor's value on the host raises while the test runs."""
    for name in ("item", "cpu", "tolist", "numpy", "__bool__", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, _raiser(f"Tensor.{name}"))
    monkeypatch.setattr(torch.cuda, "synchronize", _raiser("torch.cuda.synchronize"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", _raiser("Stream.synchronize"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", _raiser("Event.synchronize"))
    yield
