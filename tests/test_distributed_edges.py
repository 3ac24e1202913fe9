"""The distributed agreement's edge cases: what tests/test_distributed.py does not reach.

Scenarios in tests/_dist_scenarios.py (the "edges" section), on 2 gloo ranks.  Where ranks
would run different collectives, the scenarios count dist.all_reduce calls instead of running
them, so a mismatch is reported, not waited on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from _dist_pool import RankPool

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

WORLD = 2


_POOL: list[RankPool] = []


@pytest.fixture(scope="module")
def _close_pool() -> Iterator[None]:
    yield
    while _POOL:
        _POOL.pop().close()


@pytest.fixture
def pool(_close_pool: None) -> RankPool:
    """2 gloo ranks, started once per module (again after a failed scenario)."""
    if not _POOL or _POOL[-1].broken:
        _POOL.append(RankPool(WORLD, "gloo"))
    return _POOL[-1]


def test_rank_without_gradients_joins_the_dtensor_mesh_reduction(pool: RankPool) -> None:
    calls = pool.run("dtensor_rank_without_gradients")
    # one all-reduce: the mesh spans the world, found_inf_group is the world (not run twice)
    assert calls[0] == calls[1] == ["world"], calls


def test_sharded_scaler_on_torchs_path_rank_without_gradients_joins(pool: RankPool) -> None:
    """torch's ShardedGradScaler.unscale_ all-reduces only the flags it has: none on a rank
    without gradients; ampfused's must run the SUM there itself."""
    calls = pool.run("sharded_torch_path_rank_without_gradients")
    assert calls[0] == calls[1] == ["world"], calls


def test_watch_verdict_is_not_cleared_by_a_later_optimizer(pool: RankPool) -> None:
    """A later optimizer's agreement (MasterWeights: no statistics of its own) must not
    overwrite the verdict in an earlier optimizer's statistics."""
    for r in pool.run("watch_two_optimizers"):
        assert r["skipped_steps"] == 1
        assert r["offenders"] == ["a"]
        assert r["skipped"] is True


def test_sharded_found_inf_shapes_match_torchs(pool: RankPool) -> None:
    """(1,)-shaped found_inf after unscale_ and after clipping, as torch's ShardedGradScaler's;
    step_skipped_tensor stays 0-dim as documented."""
    for r in pool.run("sharded_found_inf_shapes"):
        assert r["ampfused unscale_"] == r["torch unscale_"] == [(1,)]
        assert r["ampfused clip"] == r["torch clip"]
        assert r["ampfused step_skipped_tensor after unscale_"] == ()
        assert r["ampfused step_skipped_tensor after clip"] == ()


def test_sharded_scaler_unscale_then_fused_optimizer(pool: RankPool) -> None:
    """FSDP1's usual clipping pattern (unscale_, clip, step) with Adam(fused=True): it runs, the
    ranks agree, and the result is the one of ampfused.GradScaler with found_inf_group."""
    out = pool.run("sharded_unscale_then_fused_step")
    for r in out:
        assert r["ampfused-sharded"] == r["ampfused-group"]
    assert out[0] == out[1]


def test_sharded_scaler_refuses_to_clip_by_one_rank_s_shards(pool: RankPool) -> None:
    """FSDP1's gradients are shards: ShardedGradScaler.clip_grad_norm_ would see this rank's
    only, so it refuses (NotImplementedError, naming FSDP's own clip_grad_norm_) before anything
    changes; unscale_ + FSDP's clip then gives torch's norm, the same on every rank."""
    out = pool.run("fsdp1_clip")
    for r in out:
        assert "model.clip_grad_norm_" in r["refused"]
        assert r["unchanged"]
        assert r["ampfused-sharded"] == r["torch-sharded"]
    assert out[0]["torch-sharded"] == out[1]["torch-sharded"]
