"""ampfused: fused multi-tensor gradient unscale + inf/NaN check + loss-scale update.

``ampfused.GradScaler`` is a drop-in replacement for ``torch.amp.GradScaler``; the ops behind it
are registered as ``torch.ops.ampfused.*`` and wrapped in :mod:`ampfused.ops`;
:mod:`ampfused.reference` is their pure-PyTorch specification.  The compiled kernels come from
the installed build or one compiled at first import (:mod:`ampfused._extension`); where none can
be had, ``GradScaler`` is torch's own scaler (:mod:`ampfused._no_kernels`) and ``KERNELS`` is
False.  ``python -m ampfused`` (or :func:`info`) says which.

Which file holds what, from the top down (a module imports only modules below it):

    sharded_grad_scaler  ShardedGradScaler: torch's FSDP1 scaler on GradScaler
    grad_scaler          GradScaler: the protocol (unscale_, step, update, the stages)
    _no_kernels          GradScaler and friends where no kernels could be had
    _clip, diagnostics   fused unscale + clip; watch() and the statistics it reads
    scale_islands        GradScaler(islands=...): modules whose backward runs at its own scale
    activations          activation tracing (watch(activations=...)): where an overflow starts
    report               StepReport and its rows and advice (pure host code over the rows)
    _grad_pass           the pass: which route gradients take, the agreement across ranks
    master_weights       MasterWeights: float32 masters for float16/bfloat16 models
    _scale_state         the scale's state and policy, pending update, checkpoints, checks
    _dist, ops           torch.distributed's part; the ops' typed wrappers
    reference            the ops' pure-PyTorch specification
    islands              keep_float32: chosen modules run in float32
    _compile             how the scaler's methods meet torch.compile
    _arguments           what a user passed, named for errors; the not-an-optimizer refusal
    _torch_private       the private torch names relied on, and why
    _extension           where the kernels come from (_build_config, _build_check: the build)
"""

# The package's version, in one place: pyproject.toml's metadata reads it from here.
__version__ = "0.1.0"

import sys

try:
    import torch  # noqa: F401  (loads libtorch before the extension)
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise  # torch is there, and something it imports is not: torch's own error says what
    raise ModuleNotFoundError(
        f"ampfused needs PyTorch, and this Python ({sys.executable}) has none: install torch "
        "(2.11 to 2.14) first, with `pip install torch` or the command for your CUDA version "
        "from https://pytorch.org/get-started/locally/, then import ampfused again.",
        name="torch",
    ) from None

from ampfused import _extension
from ampfused._extension import KernelsUnavailableError, KernelsUnavailableWarning
from ampfused.islands import keep_float32  # (no kernels needed)

_C = _extension.load()  # registers torch.ops.ampfused.*, or stands in for them
KERNELS: bool = _extension.STATUS.available

if KERNELS:
    from ampfused import ops, reference  # noqa: F401  (in __all__ below)
    from ampfused.grad_scaler import GradScaler, OptState
    from ampfused.master_weights import MasterWeights
else:
    from ampfused import reference
    from ampfused._no_kernels import GradScaler, MasterWeights, OptState

WITH_CUDA: bool = bool(_C.with_cuda)

__all__ = [
    "GradScaler",
    "MasterWeights",
    "keep_float32",
    "ShardedGradScaler",
    "OptState",
    "reference",
    "info",
    "KERNELS",
    "KernelsUnavailableError",
    "KernelsUnavailableWarning",
    "WITH_CUDA",
    "__version__",
] + (["ops"] if KERNELS else [])


def info() -> _extension.BuildInfo:
    """Where this process's kernels come from, what they were built for, and the build cache;
    ``print(ampfused.info())`` (or ``python -m ampfused``) for a bug report."""
    return _extension.info(__version__, WITH_CUDA)


def __getattr__(name: str):  # noqa: ANN202
    # ShardedGradScaler imports torch's FSDP1 package: loaded on first use only.
    if name == "ShardedGradScaler":
        if not KERNELS:
            from ampfused._no_kernels import sharded_grad_scaler

            return sharded_grad_scaler()
        from ampfused.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler
    if name == "ops":  # only without the kernels; imported above otherwise
        raise _extension.unavailable("ampfused.ops")
    raise AttributeError(f"module 'ampfused' has no attribute {name!r}")
