"""Distributed training: every rank makes the same skip decision and keeps the same scale.

Real torch.distributed processes (tests/_dist_pool.py; gloo on the CPU, 2 ranks; the NCCL
variants run where 2 GPUs are), the real engines (DDP, FSDP1, FSDP2, DTensor tensor
parallelism) and scenarios in tests/_dist_scenarios.py: inf/NaN put into one rank's gradients
only, after the engine's own reduction, with plain and fused optimizers.  torch's scalers run in
the same tests: where they let the ranks diverge, ampfused's must not; where they are right,
ampfused's must give the same bytes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import _dist_scenarios as scn
import pytest
import torch
import torch.distributed as dist
from _dist_pool import RankPool
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import ampfused

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

WORLD = 2
_POOLS: dict[str, RankPool] = {}


@pytest.fixture(
    scope="module",
    params=[
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
            ],
        ),
    ],
)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param
    pool = _POOLS.pop(request.param, None)
    if pool is not None:
        pool.close()


@pytest.fixture
def pool(backend: str) -> RankPool:
    """The backend's ranks, started once per module (again after a failed scenario)."""
    p = _POOLS.get(backend)
    if p is None or p.broken:
        p = _POOLS[backend] = RankPool(WORLD, backend)
    return p


def assert_ranks_agree(results: list[dict]) -> None:
    """Same scale, tracker and stepped/skipped at every step, and the same parameter bytes."""
    first = results[0]
    for rank, r in enumerate(results[1:], 1):
        for step, (a, b) in enumerate(zip(first["log"], r["log"], strict=True)):
            assert (a["state"], a.get("stepped")) == (b["state"], b.get("stepped")), (
                f"step {step}: rank 0 {a} vs rank {rank} {b}"
            )
        assert r["params"] == first["params"], f"rank {rank}'s parameters differ from rank 0's"


def assert_skipped_at_inf_step(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        stepped = [entry["stepped"] for entry in r["log"]]
        expected = [step != scn.INF_STEP for step in range(scn.STEPS)]
        assert stepped == expected, f"rank {rank} stepped {stepped}"


def assert_matches_reference(result: dict, opt: str, backend: str) -> None:
    """Scale and tracker exactly as one process on the same data (on the CPU); parameters to
    rounding (the reference averages the losses, the engines the gradients), on gloo."""
    ref = scn.reference(WORLD, opt)
    assert [e["state"] for e in result["log"]] == [e["state"] for e in ref["log"]]
    if backend != "gloo":
        return  # CUDA's float16 autocast rounds otherwise than the CPU's
    for got, want in zip(result["params"], ref["params"], strict=True):
        value = torch.frombuffer(bytearray(got), dtype=torch.float32).view_as(want)
        torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5)


def states(result: dict) -> list:
    return [e["state"] for e in result["log"]]


# ---------------------------------------------------------------------------------- DDP
@pytest.mark.parametrize("opt", ["sgd", "adam-fused"])
def test_ddp_found_inf_group_makes_ranks_agree(pool: RankPool, backend: str, opt: str) -> None:
    """A gradient changed on one rank after DDP's all-reduce: with found_inf_group every rank
    skips that step; without it (torch's scaler, or ampfused's by default) the ranks diverge,
    ampfused's exactly as torch's (a drop-in changes nothing it was not asked to)."""
    ours = pool.run("ddp", scaler="ampfused-group", opt=opt)
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)
    assert_matches_reference(ours[0], opt, backend)

    theirs = pool.run("ddp", scaler="torch", opt=opt)
    plain = pool.run("ddp", scaler="ampfused", opt=opt)
    assert theirs[0]["log"][scn.INF_STEP]["stepped"] is True  # rank 0 saw no inf: it stepped
    assert theirs[1]["log"][scn.INF_STEP]["stepped"] is False
    assert theirs[0]["params"] != theirs[1]["params"]
    for rank in range(WORLD):
        assert plain[rank]["params"] == theirs[rank]["params"]
        assert states(plain[rank]) == states(theirs[rank])


def test_ddp_nan_on_one_rank(pool: RankPool) -> None:
    ours = pool.run("ddp", scaler="ampfused-group", opt="adam", poison_value=float("nan"))
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)


# ---------------------------------------------------------------------------------- FSDP1
def test_fsdp1_matches_torchs_sharded_scaler(pool: RankPool, backend: str) -> None:
    """Plain optimizer: torch's ShardedGradScaler is right here; ampfused's gives the same bytes,
    the same (1,)-shaped found_inf tensors and the same SUM over the ranks in them."""
    theirs = pool.run("fsdp1", scaler="torch-sharded", opt="sgd")
    ours = pool.run("fsdp1", scaler="ampfused-sharded", opt="sgd")
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)
    for rank in range(WORLD):
        assert ours[rank]["params"] == theirs[rank]["params"]
        assert ours[rank]["log"] == theirs[rank]["log"]
    assert ours[0]["log"][scn.INF_STEP]["found_inf"] == [((1,), [1.0])]
    assert_matches_reference(ours[0], "sgd", backend)


def test_fsdp1_found_inf_sums_over_ranks_as_torchs(pool: RankPool) -> None:
    """inf on both ranks: torch's ShardedGradScaler all-reduces found_inf with SUM, so its
    flags count the ranks (2.0); users who read them see the same from ampfused's."""
    theirs = pool.run("fsdp1", scaler="torch-sharded", opt="sgd", inf_rank=-1)
    ours = pool.run("fsdp1", scaler="ampfused-sharded", opt="sgd", inf_rank=-1)
    assert theirs[0]["log"][scn.INF_STEP]["found_inf"] == [((1,), [2.0])]
    for rank in range(WORLD):
        assert ours[rank]["log"] == theirs[rank]["log"]
        assert ours[rank]["params"] == theirs[rank]["params"]


def test_fsdp1_fused_optimizer_all_reduces(pool: RankPool, backend: str) -> None:
    """Adam(fused=True): torch's ShardedGradScaler runs no all-reduce on this path, so the rank
    that saw the inf skips and the other steps; ampfused's reduces there too."""
    theirs = pool.run("fsdp1", scaler="torch-sharded", opt="adam-fused")
    assert [r["log"][scn.INF_STEP]["stepped"] for r in theirs] == [True, False]
    ours = pool.run("fsdp1", scaler="ampfused-sharded", opt="adam-fused")
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)
    assert_matches_reference(ours[0], "adam-fused", backend)


def test_fsdp1_float16_gradients(pool: RankPool) -> None:
    """FSDP1 mixed precision keeping float16 gradients: unscaled in place, as torch's."""
    theirs = pool.run("fsdp1", scaler="torch-sharded", opt="sgd", fp16_grads=True)
    ours = pool.run("fsdp1", scaler="ampfused-sharded", opt="sgd", fp16_grads=True)
    assert ours[0]["grad_dtypes"] == ["torch.float16"]
    assert_ranks_agree(ours)
    for rank in range(WORLD):
        assert ours[rank]["params"] == theirs[rank]["params"]
        assert ours[rank]["log"] == theirs[rank]["log"]


def test_fsdp1_cpu_offload(pool: RankPool, backend: str) -> None:
    """Parameters and gradients offloaded to the CPU, the scale on the GPU: the CPU flag is
    all-reduced through a copy on the GPU (NCCL takes no CPU tensors), as torch's."""
    if backend == "gloo":
        pytest.skip("everything is on the CPU already under gloo")
    theirs = pool.run("fsdp1", scaler="torch-sharded", opt="sgd", cpu_offload=True)
    ours = pool.run("fsdp1", scaler="ampfused-sharded", opt="sgd", cpu_offload=True)
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)
    for rank in range(WORLD):
        assert ours[rank]["params"] == theirs[rank]["params"]
        assert ours[rank]["log"] == theirs[rank]["log"]


# ---------------------------------------------------------------------------------- FSDP2
@pytest.mark.parametrize(
    "opt, poison", [("sgd", "inf"), ("adam", "inf"), ("adam-fused", "inf"), ("adam", "nan")]
)
def test_fsdp2_on_the_fused_path(pool: RankPool, backend: str, opt: str, poison: str) -> None:
    """DTensor gradients: ampfused unscales the local shards with its own pass (torch's
    foreach unscale is never called) and gives torch's bytes, found_inf included."""
    theirs = pool.run("fsdp2", scaler="torch", opt=opt, poison_value=float(poison))
    ours = pool.run("fsdp2", scaler="ampfused", opt=opt, poison_value=float(poison))
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)
    assert all(r["torch_unscale_calls"] == 0 for r in ours)
    assert all(r["torch_unscale_calls"] > 0 for r in theirs)
    for rank in range(WORLD):
        assert ours[rank]["params"] == theirs[rank]["params"]
        assert ours[rank]["log"] == theirs[rank]["log"]
    assert_matches_reference(ours[0], opt, backend)


@pytest.mark.parametrize("opt", ["sgd", "adam-fused"])
def test_fsdp2_clip_grad_norm(pool: RankPool, opt: str) -> None:
    """scaler.clip_grad_norm_ on DTensor gradients clips by the norm over every rank's shards
    (torch's clip_grad_norm_ after the local unscale; this rank's shards alone would be wrong):
    the same total and bytes as torch's unscale_ + clip_grad_norm_."""
    theirs = pool.run("fsdp2", scaler="torch", opt=opt, clip=0.05)
    ours = pool.run("fsdp2", scaler="ampfused", opt=opt, clip=0.05)
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)
    for rank in range(WORLD):
        assert ours[rank]["log"] == theirs[rank]["log"]
        assert ours[rank]["params"] == theirs[rank]["params"]
    norms = [e["norm"] for e in ours[0]["log"]]
    assert norms[0] > 0.05 and norms[scn.INF_STEP] == float("inf")  # it clipped; inf is seen


def test_fsdp2_checkpoint_resume(pool: RankPool, tmp_path: pytest.TempPathFactory) -> None:
    """torch.distributed.checkpoint resume (set_state_dict's dummy optimizer step included):
    the same bytes and the same scaler state (scale, tracker, counters) as an uninterrupted
    run, equal on every rank."""
    out = pool.run("fsdp2_checkpoint", path=str(tmp_path / "ckpt"), opt="adam")
    for rank, r in enumerate(out):
        assert r["loaded"] == r["saved"], f"rank {rank} loaded {r['loaded']}"
        assert r["got"] == r["expected"], f"rank {rank}: the resumed run differs"
    assert out[0]["got"] == out[1]["got"]
    assert out[0]["saved"]["ampfused"]["skipped_steps"] == 1


# ---------------------------------------------------------------------------------- TP
@pytest.mark.parametrize("opt", ["sgd", "adam-fused"])
def test_tensor_parallel_every_gradients_placements(pool: RankPool, opt: str) -> None:
    """A Replicate gradient first, inf in a Shard(0) gradient on rank 1: torch's DTensor handler
    reduces over the first gradient's placements only (none), so its ranks disagree; ampfused
    reduces over every gradient's non-Replicate mesh dims."""
    theirs = pool.run("tensor_parallel", scaler="torch", opt=opt)
    flags = [r["log"][scn.INF_STEP]["found_inf"] for r in theirs]
    assert flags == [[((), [0.0])], [((), [1.0])]]
    ours = pool.run("tensor_parallel", scaler="ampfused", opt=opt)
    assert [r["log"][scn.INF_STEP]["found_inf"] for r in ours] == [[((), [1.0])]] * 2
    assert_ranks_agree(ours)
    assert_skipped_at_inf_step(ours)


def test_tensor_parallel_shard_first_matches_torch(pool: RankPool) -> None:
    """Where torch's handler is right (the Shard gradient first), the same bytes as torch."""
    theirs = pool.run("tensor_parallel", scaler="torch", opt="adam", shard_first=True)
    ours = pool.run("tensor_parallel", scaler="ampfused", opt="adam", shard_first=True)
    assert_ranks_agree(theirs)
    for rank in range(WORLD):
        assert ours[rank] == theirs[rank]


# ---------------------------------------------------------------------------------- groups
@pytest.mark.parametrize("opt", ["sgd", "adam-fused"])
def test_groups_and_a_rank_without_gradients(pool: RankPool, opt: str) -> None:
    out = pool.run("groups_without_params", opt=opt)
    for step in range(scn.STEPS):
        a, b = out[0]["log"][step], out[1]["log"][step]
        assert a["state"] == b["state"]
        assert a["counters"] == b["counters"]
        flag = [((), [1.0 if step == scn.INF_STEP else 0.0])]
        assert a["found_inf"] == flag and b["found_inf"] == flag
    assert out[1]["log"][-1]["counters"]["skipped_steps"] == 1


def test_watch_reports_the_agreed_verdict(pool: RankPool) -> None:
    out = pool.run("watched")
    for step in range(scn.STEPS):
        reports = [r["reports"][step] for r in out]
        inf_step = step == scn.INF_STEP
        assert [r["skipped"] for r in reports] == [inf_step, inf_step]
        assert [r["step_skipped"] for r in reports] == [inf_step, inf_step]
        assert reports[0]["offenders"] == []
        assert reports[1]["offenders"] == (["2.bias"] if inf_step else [])
    assert out[0]["counters"] == out[1]["counters"]
    assert out[0]["counters"]["skipped_steps"] == 1
    assert "another rank" in out[0]["reports"][scn.INF_STEP]["text"]
    assert out[1]["reports"][scn.INF_STEP]["text"].startswith("ampfused step 2 (rank 1): ")


def test_ddp_scale_islands_agree(pool: RankPool) -> None:
    """Scale islands under DDP with found_inf_group: the same factors on every rank (moved away
    from 1), the same parameters; without found_inf_group, watch() refuses."""
    out = pool.run("ddp_islands")
    assert out[0]["factors"] == out[1]["factors"]
    assert any(f["0"] != 1.0 for f in out[0]["factors"]), out[0]["factors"]
    assert out[0]["params"] == out[1]["params"]
    refused = pool.run("ddp_islands", group=False)
    assert all("found_inf_group" in r["error"] for r in refused)


def test_fsdp2_scale_islands_agree(pool: RankPool) -> None:
    """Scale islands on FSDP2 (DTensor gradients) with found_inf_group: the same factors on
    every rank, moved off 1, and the same full parameters, all finite."""
    out = pool.run("fsdp2_islands")
    assert out[0]["factors"] == out[1]["factors"]
    assert any(f["0"] != 1.0 for f in out[0]["factors"]), out[0]["factors"]
    assert out[0]["params"] == out[1]["params"]


def test_master_weights_agree(pool: RankPool) -> None:
    out = pool.run("master_weights")
    assert_ranks_agree(out)
    assert_skipped_at_inf_step(out)


# ---------------------------------------------------------------------------------- API
def test_sharded_scaler_is_a_drop_in() -> None:
    ours = inspect.signature(ampfused.ShardedGradScaler.__init__).parameters
    theirs = inspect.signature(TorchSharded.__init__).parameters
    assert list(ours)[: len(theirs)] == list(theirs)  # backoff_factor before growth_factor
    for name in ("device", "init_scale", "backoff_factor", "growth_factor", "growth_interval"):
        assert ours[name].default == theirs[name].default
    s = ampfused.ShardedGradScaler("cpu", 8.0, 0.25, 4.0, 3)
    assert isinstance(s, TorchSharded) and isinstance(s, torch.amp.GradScaler)
    assert (s._backoff_factor, s._growth_factor, s._growth_interval) == (0.25, 4.0, 3)
    assert s.process_group is None


def test_sharded_scaler_state_dict_loads_both_ways() -> None:
    ours = ampfused.ShardedGradScaler("cpu", init_scale=32.0)
    theirs = TorchSharded("cpu", init_scale=4.0)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.get_scale() == 32.0
    ours.load_state_dict(TorchSharded("cpu", init_scale=2.0).state_dict())
    assert ours.get_scale() == 2.0


@pytest.mark.parametrize(
    "value, match",
    [
        ("world", r"found_inf_group must be a torch.distributed.ProcessGroup.*got str"),
        ([None], r"found_inf_group must be .*got NoneType.*init_process_group"),
        (None, r"found_inf_group must be .*got NoneType.*init_process_group"),
        (3, r"found_inf_group must be .*got int"),
    ],
)
def test_found_inf_group_refuses_what_is_not_a_group(value: object, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        ampfused.GradScaler("cpu", found_inf_group=value)


def test_sharded_scaler_refuses_options_it_cannot_honour() -> None:
    with pytest.raises(TypeError, match="allow_fp16"):
        ampfused.ShardedGradScaler("cpu", allow_fp16=False)
    with pytest.raises(TypeError, match="process_group must be"):
        ampfused.ShardedGradScaler("cpu", process_group="world")


@pytest.mark.parametrize("engine", ["ddp", "fsdp1", "fsdp2"])
def test_fused_optimizer_step_reads_nothing_on_the_host(pool: RankPool, engine: str) -> None:
    """The fused-optimizer route stays sync-free with the all-reduce: step() and update() read
    no tensor value on the host, on any rank, and every rank skips the step with inf."""
    out = pool.run("fused_step_reads_nothing", engine=engine)
    expected = [step == scn.INF_STEP for step in range(scn.STEPS)]
    assert out == [expected] * WORLD


def test_headroom_policy_agrees_in_the_flags_collective(pool: RankPool) -> None:
    """The headroom policy with traced activations: each rank measures its own batch's
    activation gradients; found_inf_group agrees the magnitude in the same all-reduce as the
    flag (one per pass), so the ranks hold one scale and step the same parameters.  Without
    the group (plain DDP runs no collective of ours) the scales differ: the README says to pass
    found_inf_group=dist.group.WORLD with traced activations."""
    ours = pool.run("headroom_traced", group=True)
    assert ours[0]["scales"] == ours[1]["scales"]
    assert ours[0]["scales"][0] > 1.0  # the scale moved from the policy's start
    # one per pass (two optimizers: two passes an iteration), the magnitude riding in each
    assert [r["all_reduces"] for r in ours] == [2 * scn.STEPS, 2 * scn.STEPS]
    assert ours[0]["params"] == ours[1]["params"]
    apart = pool.run("headroom_traced", group=False)
    assert apart[0]["scales"] != apart[1]["scales"]
    assert [r["all_reduces"] for r in apart] == [0, 0]
