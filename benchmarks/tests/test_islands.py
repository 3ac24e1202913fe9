"""The islands question in a tiny form (seconds): the measures against hand-made tensors, the
targets against hand-made runs, and a short run of both models whose records, JSON, tables and
plot are checked, with the islands policy as the column it becomes once the scaler takes
``islands=``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import ampfused
from benchmarks import compare, islands, policy
from benchmarks.env import REPO
from benchmarks.policy import TINY, Trace
from benchmarks.report import CONSOLE_WIDTH
from benchmarks.suite import Context
from benchmarks.timing import QUICK_TIMING

FORM = policy.Form(
    {"bert-tiny": 9, "llama-tiny": 9}, spike_every=4, sample_every=3, first=2, last=3,
    noise_seeds=(2,),
)  # fmt: skip
TIMING = (2, 3)  # warm-up steps, timed rounds


class IslandsScaler(ampfused.GradScaler):
    """ampfused's scaler taking ``islands=`` and doing nothing with it: the islands policy's
    column as it will be when the scaler accepts the keyword."""

    def __init__(self, *args, islands: str | None = None, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)


class Ticks:
    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        pass


def _ctx() -> Context:
    return Context(device=torch.device("cpu"), timing=QUICK_TIMING, methods=[], quick=True)


@pytest.fixture(scope="module")
def result() -> dict:
    pytest.importorskip("transformers")
    ctx = _ctx()
    ctx.progress = Ticks()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ampfused, "GradScaler", IslandsScaler)
        out = islands.run(ctx, FORM, timing=TIMING)
    out["ticks"] = ctx.progress.n
    return out


# --------------------------------------------------------------------------- measures
def test_module_counts_follow_the_definition() -> None:
    half = torch.tensor(
        [0.0, TINY / 4, TINY, 1.0, 0.0, float("inf"), float("nan"), -TINY / 2, 0.0],
        dtype=torch.float16,
    )
    full = torch.tensor([TINY, TINY, TINY, 1.0, 1e-9, 1.0, 1.0, -TINY, 0.0])
    # nonzero in float32: all but the last; subnormal or zero in float16 among them: 0, 1, 4
    # and 7 (inf and NaN are neither); zero in float16 among them: 0 and 4; below 2^-14 with the
    # largest (1.0) at 65504 / 4: 4 only (1e-9 < 2^-28)
    other = torch.zeros(3, dtype=torch.float16)
    counts = islands.module_counts(
        {"a": [half, half[:2]], "b": [other]}, {"a": [full, full[:2]], "b": [torch.ones(3)]}
    )
    assert counts == {"a": [11, 10, 6, 3, 1], "b": [3, 3, 3, 3, 0]}
    # the own scale is the module's, over all its calls: 2^-20 is out of reach beside 2^10
    big, small = torch.tensor([2.0**10]), torch.tensor([2.0**-20, 2.0**-17])
    counts = islands.module_counts({"c": [big.half(), small.half()]}, {"c": [big, small]})
    assert counts["c"][4] == 1


def test_activation_figures_whole_model_worst_modules_and_series() -> None:
    trace = Trace()
    trace.measured = [
        (0, {"q": [10, 8, 4, 0, 0], "k": [10, 10, 1, 1, 1], "v": [10, 0, 0, 0, 0]}),
        (5, {"q": [10, 8, 0, 0, 0], "k": [10, 10, 0, 1, 2], "v": [10, 0, 0, 0, 0]}),
    ]
    a = islands.activation_figures(trace)["activations"]
    assert a["modules"] == {
        "q": [20, 16, 4, 0, 0],
        "k": [20, 20, 1, 2, 3],
        "v": [20, 0, 0, 0, 0],
    }
    assert a["subnormal"] == pytest.approx(5 / 36) and a["zero"] == pytest.approx(2 / 36)
    assert a["own_scale"] == pytest.approx(3 / 36)
    assert a["worst_subnormal"] == {"module": "q", "share": 0.25}
    assert a["worst_zero"] == {"module": "k", "share": 0.1}
    assert a["worst_own_scale"] == {"module": "k", "share": 0.15}
    assert a["series"] == [[0, 5 / 18, 1 / 18], [5, 0.0, 1 / 18]]
    assert (a["elements"], a["nonzero"]) == (60, 36)
    # after the start: the sampled steps but the first
    after = islands.activation_figures(trace)["after_start"]
    assert after["modules"] == {
        "q": [10, 8, 0, 0, 0],
        "k": [10, 10, 0, 1, 2],
        "v": [10, 0, 0, 0, 0],
    }
    assert after["subnormal"] == 0.0 and after["series"] == [[5, 0.0, 1 / 18]]
    # a tie goes to the first module in forward order
    trace.measured = [(0, {"x": [4, 4, 1, 0, 0], "y": [4, 4, 1, 0, 0]})]
    assert islands.activation_figures(trace)["activations"]["worst_subnormal"]["module"] == "x"


def test_short_module_names() -> None:
    assert islands.short("bert.encoder.layer.0.attention.self.query") == (
        "layer.0.attention.self.query"
    )
    assert islands.short("model.layers.11.self_attn.q_proj") == "layers.11.self_attn.q_proj"
    for name in ("cls.predictions.transform.dense", "lm_head", "layer.0.x", "a.layers.b"):
        assert islands.short(name) == name


def test_masked_batches() -> None:
    data = torch.arange(1000) % 200
    g = torch.Generator().manual_seed(0)
    offsets, masked = islands._mlm_draw(data, g)
    assert masked.shape == (policy.LM_BATCH, policy.LM_BLOCK) and masked.any(dim=1).all()
    x, labels = islands._mlm_batch(data, (offsets, masked))
    window = torch.stack([data[o : o + policy.LM_BLOCK] for o in offsets.tolist()])
    assert torch.equal(x[masked], torch.full_like(x[masked], islands.MASK_ID))
    assert torch.equal(x[~masked], window[~masked])
    assert torch.equal(labels[masked], window[masked]) and (labels[~masked] == -100).all()
    # a window the draw left unmasked gets its first position masked
    g = torch.Generator().manual_seed(0)
    share, islands.MASK_SHARE = islands.MASK_SHARE, 0.0
    try:
        _, none = islands._mlm_draw(data, g)
    finally:
        islands.MASK_SHARE = share
    assert none[:, 0].all() and not none[:, 1:].any()


# --------------------------------------------------------------------------- targets
def _run(name: str, modules: dict, loss: float, skipped: tuple = (0, 0), step=(1.0, 1.0)) -> dict:
    return {
        "policy": name,
        "status": "ok",
        "final_loss": loss,
        "skipped": {"first": skipped[0], "later": skipped[1], "spikes": 0},
        "after_start": {"modules": modules},
        "step_vs_untraced": step[0],
        "step_vs_traced": step[1],
    }


def test_verdict() -> None:
    # under the global scale q has 10% subnormal (over 5%), k 1%: only q is judged
    glob = _run(islands.GLOBAL, {"q": [100, 100, 10, 0], "k": [100, 100, 1, 0]}, 2.10)
    f32 = {"policy": "float32", "status": "ok", "final_loss": 2.00}
    good = _run(islands.ISLANDS, {"q": [1e5, 1e5, 50, 0], "k": [100, 100, 1, 0]}, 2.05)
    main = {islands.GLOBAL: glob, "float32": f32, islands.ISLANDS: good}
    v = islands.verdict(good, main, noise=0.01)
    assert v["met"] is True and v["text"] == "met"
    assert v["parts"] == dict.fromkeys(
        ("subnormal", "no skip outside spikes", "loss", "step time"), True
    )
    # the global scale itself: its own modules over 5%, as close to float32 as itself
    v = islands.verdict(glob, main, noise=0.01)
    assert v["parts"]["subnormal"] is False and v["parts"]["loss"] is True
    assert v["text"] == "not met: subnormal above 0.05% in 1 of 1 modules"
    # q at 0.051%, skips outside spikes, loss further than the global's beyond the noise, slow
    bad = _run(islands.ISLANDS, {"q": [1e5, 1e5, 51, 0]}, 2.2, (1, 2), (1.3, 1.05))
    v = islands.verdict(bad, {**main, islands.ISLANDS: bad}, noise=0.05)
    assert v["met"] is False and v["parts"] == dict.fromkeys(v["parts"], False)
    assert v["text"] == (
        "not met: subnormal above 0.05% in 1 of 1 modules, 3 skips outside spikes, loss further "
        "from float32's than the global scale's, step 1.30x untraced, 1.05x traced"
    )
    # further from float32 but within the noise: too short to tell; no noise: not judged
    near = {**good, "final_loss": 2.15}
    assert islands.verdict(near, main, noise=0.1)["text"] == "met (loss: too short to tell)"
    assert islands.verdict(near, main, noise=None)["met"] is None
    assert (
        islands.verdict({**good, "step_vs_traced": 1.11}, main, 0.01)["parts"]["step time"] is False
    )
    assert (
        islands.verdict({**good, "step_vs_traced": None}, main, 0.01)["parts"]["step time"] is None
    )
    # no module over 5% under the global scale: the subnormal target is not judged
    calm = {**main, islands.GLOBAL: _run(islands.GLOBAL, {"q": [100, 100, 5, 0]}, 2.1)}
    v = islands.verdict(good, calm, noise=0.01)
    assert v["parts"]["subnormal"] is None and v["met"] is None
    assert v["text"] == "met (subnormal: no module above 5% under the global scale)"
    assert islands.verdict({**good, "skipped": {"first": 1, "later": 0}}, main, 0.01)["text"] == (
        "not met: 1 skip outside spikes"
    )


def test_the_islands_policy_is_unavailable_until_the_scaler_takes_the_keyword(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Refuses(ampfused.GradScaler):
        def __init__(self, *args, islands: str | None = None, **kwargs) -> None:  # noqa: ANN002, ANN003
            if islands is not None:
                raise TypeError(f"unexpected keyword argument islands={islands!r}")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ampfused, "GradScaler", Refuses)
    why = policy.availability(islands.POLICIES)
    assert why[islands.TORCH] is None and why[islands.GLOBAL] is None
    assert (
        why[islands.ISLANDS].startswith("not available: TypeError")
        and "islands" in why[islands.ISLANDS]
    )
    monkeypatch.setattr(ampfused, "GradScaler", IslandsScaler)
    assert set(policy.availability(islands.POLICIES).values()) == {None}
    assert islands.POLICIES[2].call() == (
        "ampfused.GradScaler(\"cpu\", policy='headroom', islands='auto') "
        "+ watch(model, activations=True)"
    )


# --------------------------------------------------------------------------- a tiny run
def test_records_and_json(result: dict, tmp_path: Path) -> None:
    names = [p.name for p in islands.POLICIES]
    assert result["ticks"] == islands.n_runs(True, form=FORM) == 2 * (3 + 2 + 1)
    for task in ("bert-tiny", "llama-tiny"):
        runs = [r for r in result["runs"] if r["task"] == task]
        assert [(r["policy"], r["seed"]) for r in runs] == [
            *((n, 1) for n in names),
            ("float32", 1),
            (islands.TORCH, 2),
        ]
        assert all(r["status"] == "ok" for r in runs), [r["note"] for r in runs]
        entry = result["tasks"][task]
        assert entry["spikes"] == [4] and entry["noise"]["spread"] is not None
        assert set(entry["step_ms"]) == set(names)
        assert all(
            t["steps"] == TIMING[1] and t["median_ms"] > 0 for t in entry["step_ms"].values()
        )
        by = {r["policy"]: r for r in runs if r["seed"] == 1}
        assert by[islands.TORCH]["step_vs_untraced"] == 1.0
        assert by[islands.GLOBAL]["step_vs_traced"] == 1.0
        for name in names:
            r = by[name]
            a = r["activations"]
            # sampled every 3rd step but the spike's (step 4 is not a multiple of 3 anyway)
            assert [s[0] for s in a["series"]] == [0, 3, 6]
            assert a["nonzero"] > 0 and 0 <= a["zero"] <= a["subnormal"] <= 1
            assert a["worst_subnormal"]["share"] >= a["subnormal"]
            assert a["worst_subnormal"]["module"] in a["modules"]
            # the Linear layers' outputs: BERT's query/key/value, Llama's q/k/v projections
            proj = "attention.self.query" if task == "bert-tiny" else "self_attn.q_proj"
            assert any(m.endswith(proj) for m in a["modules"])
            assert set(r["target"]["parts"]) == {
                "subnormal",
                "no skip outside spikes",
                "loss",
                "step time",
            }
            assert "loss_minus_float32" in r
            assert r["after_start"]["series"] == a["series"][1:]
        assert "activations" not in by["float32"] and "target" not in by["float32"]
    assert "ampfused_equals_torch" not in result["tasks"]["bert-tiny"]
    assert islands.errors(result) == []
    # results.jsonl keeps it on a line of its own, read back by compare.load
    assert json.loads(json.dumps(result)) == result
    path = compare.write(tmp_path, {"command": "x"}, [], None, None, result)
    back = compare.load(path)
    assert back["islands"]["runs"][0]["policy"] == islands.TORCH and back["policy"] is None


def test_a_summed_loss_overflows_torchs_first_scale(result: dict) -> None:
    """torch's default starts at 2^16, which a summed loss overflows: its first steps skip."""
    r = next(
        r for r in result["runs"] if r["task"] == "llama-tiny" and r["policy"] == islands.TORCH
    )
    assert r["skipped"]["first"] >= 1 and r["log2_scales"][0] == 16


def test_tables_fit_the_console_and_name_their_columns(result: dict, tmp_path: Path) -> None:
    text = islands.text(result, "simple")
    assert max(map(len, text.split("\n"))) <= CONSOLE_WIDTH
    for head in ("subnormal", "worst module", "step ms", "targets on bert-tiny", "seconds"):
        assert head in text
    assert "headroom with islands" in text and "not available" not in text
    md = islands.text(result, "github")
    assert "| policy" in md and "final loss (minus float32's)" in md
    assert islands.plot(result, tmp_path, "test").is_file()


def test_unavailable_policy_shows_as_such(tmp_path: Path) -> None:
    """Without the keyword the islands column says "not available" and its runs are n/a."""
    pytest.importorskip("transformers")
    form = policy.Form({"llama-tiny": 3}, spike_every=2, sample_every=2, first=1, last=1)
    refused = policy.Policy(islands.ISLANDS, "ampfused", (("no_such_keyword", 1),), trace=True)
    out = islands.run(_ctx(), form, islands.TASKS[1:], (islands.POLICIES[0], refused), (1, 2))
    r = next(r for r in out["runs"] if r["policy"] == islands.ISLANDS)
    assert r["status"] == "n/a" and "no_such_keyword" in r["note"]
    assert set(out["tasks"]["llama-tiny"]["step_ms"]) == {islands.TORCH}
    assert "not available" in islands.text(out, "simple")


# --------------------------------------------------------------------------- the docs
COMMITTED = REPO / "benchmarks" / "results" / "cpu" / "islands" / "results.md"
DOC = REPO / "docs" / "benchmarks.md"


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _tables(text: str) -> list[str]:
    """The markdown tables of ``text``, each as its lines."""
    out, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            out.append("\n".join(block))
            block = []
    return out


def test_docs_quote_the_committed_run() -> None:
    """docs/benchmarks.md's section holds the committed run's tables as results.md has them,
    its time and its load, and no percentage the run did not print."""
    results = COMMITTED.read_text()
    ours = _section(results, "Islands")
    doc = _section(DOC.read_text(), "Every layer's activation gradients")
    tables = _tables(ours)
    assert len(tables) == 3  # a table per model, the targets
    for table in tables:
        assert table in doc, "paste the committed results.md's islands tables into the docs"
    seconds = re.search(r"^`python -m benchmarks --only islands[^`]*`, (\d+) s\.", results, re.M)
    others = re.search(r"cpu_used_by_others +\| ([\d.]+)% of all CPU time", results)
    assert seconds and others
    assert f"{seconds[1]} s, with {others[1]}% of the CPU taken by other processes" in doc
    prose = "\n".join(line for line in doc.splitlines() if not line.startswith("|"))
    for figure in re.findall(r"\d[\d.]*%", prose):
        assert figure in results or figure in ("0.05%", "5%"), figure  # (or a target's)
