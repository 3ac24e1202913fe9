"""ampfused: fused multi-tensor gradient unscale + inf/NaN check + loss-scale update.

``ampfused.GradScaler`` is a drop-in replacement for ``torch.amp.GradScaler``; the ops behind it
are registered as ``torch.ops.ampfused.*`` and wrapped in :mod:`ampfused.ops`;
:mod:`ampfused.reference` is their pure-PyTorch specification.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from ampfused import _C  # noqa: F401  (registers torch.ops.ampfused.*)
except ImportError as e:  # pragma: no cover - exercised by hand
    raise ImportError(
        f"ampfused's compiled extension failed to import ({e}). It must be built against the "
        f"torch you are running (torch {torch.__version__}): reinstall with "
        "`pip install --no-build-isolation .` from the ampfused checkout (or run `make test`), "
        "in the environment where this torch is installed."
    ) from e

from ampfused import ops, reference  # noqa: E402
from ampfused.grad_scaler import GradScaler, OptState  # noqa: E402
from ampfused.master_weights import MasterWeights  # noqa: E402

__version__ = "0.1.0"
WITH_CUDA: bool = bool(_C.with_cuda)

__all__ = [
    "GradScaler",
    "MasterWeights",
    "ShardedGradScaler",
    "OptState",
    "ops",
    "reference",
    "WITH_CUDA",
    "__version__",
]


def __getattr__(name: str):  # noqa: ANN202
    # ShardedGradScaler imports torch's FSDP1 package: loaded on first use only.
    if name == "ShardedGradScaler":
        from ampfused.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler
    raise AttributeError(f"module 'ampfused' has no attribute {name!r}")
