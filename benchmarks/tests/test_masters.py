"""The masters question: its two methods leave the same masters and parameters behind, its
floor runs only when asked, and the table reads its rows.

    python -m pytest benchmarks/tests -q
"""

from __future__ import annotations

import torch

from benchmarks import questions as qs
from benchmarks.methods import METHODS, select
from benchmarks.workloads import Workload, build, uniform

CPU = torch.device("cpu")


def test_fused_and_by_hand_masters_agree() -> None:
    """One step of each: the masters' gradients are the float16 gradients unscaled, bit for
    bit in both, and the parameters come back unchanged (a no-op optimizer)."""
    gs = build(Workload("6 x 300", tuple(uniform(6, 300)), "fp16"), CPU)
    before = [p.detach().clone() for p in gs.params]
    shared_version = gs.params[0]._version
    master_grads = {}
    for name in ("ampfused-masters", "torch-masters"):
        runner = METHODS[name].factory(gs)
        gs.restore()
        runner.reset()
        scaled = [g.clone() for g in gs.grads]
        runner.run()
        masters = runner.optimizer.param_groups[0]["params"]
        assert all(m.dtype == torch.float32 for m in masters)
        master_grads[name] = [m.grad.clone() for m in masters]
        expected = [g.float() * (1.0 / 2.0**16) for g in scaled]
        assert all(torch.equal(a, b) for a, b in zip(master_grads[name], expected, strict=True))
        assert all(torch.equal(p, b) for p, b in zip(runner.params, before, strict=True))
    # Each runner copies back into parameters of its own: the GradSet's shared buffer is not
    # written (a write would make MasterWeights compare every parameter with its master).
    assert gs.params[0]._version == shared_version
    ours, theirs = master_grads.values()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_masters_methods_only_when_asked_and_only_float16() -> None:
    names = {"ampfused-masters", "torch-masters", "floor-masters"}
    assert not names & {m.name for m in select(None, CPU)}
    fp32 = Workload("1 x 8", tuple(uniform(1, 8)))
    assert all(METHODS[n].unavailable(fp32, CPU) for n in names)
    assert all(METHODS[n].unavailable(w, CPU) is None for n in names for w in qs.MASTERS_SETS)
