"""The policy question in a tiny form (a few seconds): the runs' records and their JSON, the
planted spikes where the form puts them, the tables within 100 columns, the underflow count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import compare, policy
from benchmarks.report import CONSOLE_WIDTH
from benchmarks.suite import Context
from benchmarks.timing import QUICK_TIMING

INF = float("inf")

pytest.importorskip("transformers")

TINY = policy.Form(
    {"gpt2-tiny": 8, "mlp-teacher": 40},
    spike_every=10,
    sample_every=4,
    first=3,
    last=5,
    noise_seeds=(2,),
)
# torch's default, ampfused's default, one that cannot be made (as headroom before it exists),
# headroom (available or not, whichever this build is)
UNKNOWN = policy.Policy("unknown keyword", "ampfused", (("no_such_option", 1),))
POLICIES = (*policy.POLICIES[:2], UNKNOWN, policy.POLICIES[4])


@pytest.fixture(scope="module")
def result() -> dict:
    ctx = Context(device=torch.device("cpu"), timing=QUICK_TIMING, methods=[], quick=True)
    return policy.run(ctx, TINY, policies=POLICIES)


def test_planted_spikes_are_where_the_form_says() -> None:
    lm, mlp = policy.TASKS
    assert TINY.spikes(lm) == []  # the language model is trained without spikes
    assert TINY.spikes(mlp) == [10, 20, 30]  # every 10th step, none in the last 5 of 40
    assert policy.FULL.spikes(mlp) == [300, 600, 900, 1200, 1500, 1800]


def test_records_and_json(result: dict) -> None:
    runs = result["runs"]
    per_task = len(POLICIES) + 1 + len(TINY.noise_seeds)  # + float32 + torch on other batches
    assert len(runs) == 2 * per_task
    assert [r["policy"] for r in runs[:per_task]] == [
        *(p.name for p in POLICIES),
        "float32",
        policy.TORCH,
    ]
    assert [r["seed"] for r in runs[:per_task]] == [1] * (per_task - 1) + [2]
    by = {(r["task"], r["policy"], r["seed"]): r for r in runs}
    assert by[("mlp-teacher", "unknown keyword", 1)]["status"] == "n/a"
    assert "no_such_option" in by[("mlp-teacher", "unknown keyword", 1)]["note"]
    assert result["policies"]["unknown keyword"]["why"].startswith("not available")
    for task in ("gpt2-tiny", "mlp-teacher"):
        steps = TINY.steps[task]
        t, f32 = by[(task, policy.TORCH, 1)], by[(task, "float32", 1)]
        assert t["status"] == f32["status"] == "ok"
        assert len(t["log2_scales"]) == steps and t["log2_scales"][0] == 16
        assert t["log2_scale_lowest"] <= t["log2_scale_median"] <= 16
        assert set(t["skipped"]) == {"first", "later", "spikes", "most_at_one_spike"}
        assert sum(t["skipped"][k] for k in ("first", "later", "spikes")) == len(t["skipped_steps"])
        # sampled every 4th step but the planted spikes', over the Linear/Conv1D outputs
        spikes = set(result["tasks"][task]["spikes"])
        samples = [s[0] for s in t["underflow"]["samples"]]
        assert samples == [i for i in range(0, steps, 4) if i not in spikes]
        u = t["underflow"]
        assert u["elements"] > 0 and 0 <= u["underflowed"] <= u["subnormal"] <= 1
        assert all(len(x) == 6 for x in u["samples"])
        # (None where every sampled step overflowed: the language model's first 8 under torch)
        ratio = u["activation_over_parameter_max"]
        assert ratio > 0 if task == "mlp-teacher" else ratio is None or ratio > 0
        assert t["loss_minus_torch"] == 0 and f32["loss_minus_torch"] == -t["loss_minus_float32"]
        assert "skipped" not in f32 and "target" not in f32 and f32["wall_s"] > 0
        assert t["target"]["text"].startswith(("met", "not met"))
        noise = result["tasks"][task]["noise"]
        assert len(noise["final_losses"]) == 2 and noise["spread"] >= 0
        assert result["tasks"][task]["ampfused_equals_torch"] is True
        assert result["tasks"][task]["traced_equals_untraced"] is None  # (traced not run)
    # results.jsonl keeps it on a line of its own, read back by compare.load
    assert json.loads(json.dumps(result)) == result


def test_spike_steps_are_skipped_and_counted_there(result: dict) -> None:
    """torch's rule at ~2^12-2^16 cannot hold a loss 10^3 times larger: every planted spike's
    step is skipped and counted at the spikes, none of them as 'later'."""
    t = next(
        r for r in result["runs"] if r["task"] == "mlp-teacher" and r["policy"] == policy.TORCH
    )
    assert {10, 20, 30} <= set(t["skipped_steps"])
    assert t["skipped"]["spikes"] >= 3


def test_split_skips_and_verdict() -> None:
    # a spike owns its step and the SPIKE_WINDOW - 1 after it (10 and 11; 39 but not 40)
    s = policy.split_skips([0, 2, 4, 10, 11, 25, 39, 40], spikes=[10, 30], first=3)
    assert s == {"first": 2, "later": 3, "spikes": 3, "most_at_one_spike": 2}
    run = {"skipped": s, "log2_scale_median": 12.0, "loss_minus_torch": 0.01}
    ref = {"status": "ok", "log2_scale_median": 12.0}
    v = policy.verdict(run, ref, noise=0.02)
    assert v["met"] is False
    assert v["text"] == "not met: skips at start, later skips, 2+ skips at a spike"
    clean = {"first": 0, "later": 0, "spikes": 1, "most_at_one_spike": 1}
    assert policy.verdict({**run, "skipped": clean}, ref, 0.02) == {
        "met": True,
        "text": "met",
        "parts": dict.fromkeys(
            (
                "no skip outside spikes",
                "at most one skip per spike",
                "median scale at least torch's",
                "loss at most torch's plus noise",
            ),
            True,
        ),
    }
    v = policy.verdict({**run, "skipped": clean}, ref, None)
    assert v["met"] is None and v["text"] == "met (loss not judged)"
    low = {**run, "skipped": clean, "log2_scale_median": 11.0, "loss_minus_torch": 0.05}
    assert policy.verdict(low, ref, 0.02)["text"] == (
        "not met: median scale below torch's, loss above torch's beyond noise"
    )
    better = {**run, "skipped": clean, "loss_minus_torch": -0.5}  # lower: trained better
    assert policy.verdict(better, ref, 0.02)["text"] == "met"


def test_underflow_counts_follow_the_definition() -> None:
    tiny = 2.0**-14
    half = torch.tensor([0.0, tiny / 4, tiny, 1.0, 0.0, float("inf")], dtype=torch.float16)
    full = torch.tensor([tiny, tiny, tiny, 1.0, 1e-9, 1.0])
    # underflowed: elements 0 and 1 (zero / subnormal in float16, normal in float32);
    # subnormal: also element 4 (zero in float16, not zero in float32); inf is neither
    assert policy.underflow_counts({"a": [half]}, {"a": [full]}) == (2, 3, 6)


def test_tables_fit_the_console_and_name_their_columns(result: dict, tmp_path: Path) -> None:
    text = policy.text(result, "simple")
    assert max(map(len, text.split("\n"))) <= CONSOLE_WIDTH
    for head in ("policy", "log2 scale", "underflowed", "targets on gpt2-tiny", "seconds"):
        assert head in text
    assert "not available" in text and "unknown keyword" in text
    md = policy.text(result, "github")
    assert "| policy" in md and "final loss (minus torch default's / float32's)" in md
    assert policy.errors(result) == []
    (line,) = policy.comparison_lines(result)
    assert "bit for bit, on 2 of 2 models" in line
    path = compare.write(tmp_path, {"command": "x"}, [], None, result)
    assert compare.load(path)["policy"]["runs"][0]["policy"] == policy.TORCH
    assert policy.plot(result, tmp_path, "test").is_file()


def test_at_scale_counts_the_steps_a_higher_scale_would_overflow() -> None:
    """policy.at_scale: each step's measured magnitude moved to the given scale (and half a
    binade below it) passes 65,504 or not; steps that found inf/NaN, measured nothing, or sit in
    a planted spike's window are left out."""
    run = {
        # step:     0       1        2         3     4      5        6 (spike)  7 (in its window)
        "magnitudes": [1000.0, 20000.0, 50000.0, 0.0, INF, 35000.0, 60000.0, 60000.0],
        "log2_scales": [8, 8, 8, 8, 8, 8, 8, 8],
    }
    at = policy.at_scale(run, 9.0, [6])
    assert at["log2_scale"] == 9.0
    assert at["at"] == [2, 5]  # (x2: 100,000 and 70,000 pass 65,504; 40,000 does not)
    assert at["half_binade_below"] == [2]  # (x2^0.5: 70,711 passes; 49,497 does not)
    assert policy.at_scale(dict(run, log2_scales=[9] * 8), 9.0, [6])["at"] == []
