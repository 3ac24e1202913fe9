"""The masters question: both methods leave the same masters and parameters behind, and its
methods run only on float16 gradient sets, when asked."""

from __future__ import annotations

import torch

from benchmarks import questions as qs
from benchmarks.methods import METHODS, select
from benchmarks.workloads import Workload, build, uniform

CPU = torch.device("cpu")


def test_fused_and_by_hand_masters_agree() -> None:
    """The masters' gradients are the float16 gradients unscaled, bit for bit in both; the
    parameters come back unchanged, and the GradSet's shared buffer is not written (a write
    would make MasterWeights compare every parameter with its master)."""
    gs = build(Workload("6 x 300", tuple(uniform(6, 300)), "fp16"), CPU)
    before, version = [p.detach().clone() for p in gs.params], gs.params[0]._version
    for name in ("ampfused-masters", "torch-masters"):
        runner = METHODS[name].factory(gs)
        gs.restore()
        expected = [g.float() * 2.0**-16 for g in gs.grads]
        versions = [p._version for p in runner.params]
        runner.run()
        assert all(
            p._version > v for p, v in zip(runner.params, versions, strict=True)
        )  # copied back
        masters = runner.optimizer.param_groups[0]["params"]
        assert all(m.dtype == torch.float32 for m in masters)
        assert all(torch.equal(m.grad, e) for m, e in zip(masters, expected, strict=True))
        assert all(torch.equal(p, b) for p, b in zip(runner.params, before, strict=True))
    assert gs.params[0]._version == version


def test_masters_methods_only_when_asked_and_only_float16() -> None:
    names = {"ampfused-masters", "torch-masters", "floor-masters"}
    assert not names & {m.name for m in select(None, CPU)}
    fp32 = Workload("1 x 8", tuple(uniform(1, 8)))
    assert all(METHODS[n].unavailable(fp32, CPU) for n in names)
    assert all(METHODS[n].unavailable(w, CPU) is None for n in names for w in qs.MASTERS_SETS)
