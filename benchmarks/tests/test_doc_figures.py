"""The figures README.md and docs/*.md quote from the committed benchmark results, checked
against those results (benchmarks/results/cpu/...): a run that is committed again fails here
until the prose says what it measured.  On a failure the message holds the text to paste.

Times are quoted to 3 significant digits from the results' tables (µs as measured), ratios as
the tables print them (to 1 decimal from 10x up); each check names the run it reads.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.env import REPO

RESULTS = REPO / "benchmarks" / "results" / "cpu"
README, DOCS = REPO / "README.md", REPO / "docs"


# ------------------------------------------------------------------------------- reading
def flat(text: str) -> str:
    """Prose with its line breaks and runs of spaces as single spaces."""
    return re.sub(r"\s+", " ", text)


def md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every table of a markdown text: (headers, rows), cells stripped."""

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|[-:| ]+\|", lines[i + 1].strip()):
            if i and lines[i - 1].startswith("|"):
                continue
            rows = []
            for body in lines[i + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(cells(body))
            tables.append((cells(line), rows))
    return tables


def doc_table(page: Path, headers: list[str]) -> list[list[str]]:
    (rows,) = [r for h, r in md_tables(page.read_text()) if h == headers] or [None]
    assert rows is not None, f"{page.name}: no table headed {headers}"
    return rows


def results_section(folder: Path, heading: str) -> str:
    text = (folder / "results.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def results_rows(folder: Path, heading: str) -> dict[str, dict[str, str]]:
    """The rows of the (first) table under ``## heading`` of folder/results.md, by first cell."""
    headers, rows = md_tables(results_section(folder, heading))[0]
    return {r[0]: dict(zip(headers, r, strict=True)) for r in rows}


def run_head(folder: Path) -> dict:
    with open(folder / "results.jsonl") as f:
        return json.loads(f.readline())["run"]


def run_seconds(folder: Path) -> int:
    """The run's time as its results.md states it (from the unrounded figure)."""
    match = re.search(
        r"^`python -m benchmarks[^`]*`, (\d+) s\.", (folder / "results.md").read_text(), re.M
    )
    assert match, folder
    return int(match.group(1))


# ------------------------------------------------------------------------------- formats
def sig3(x: float) -> str:
    """3 significant digits, trailing zeros kept: 11.86 -> 11.9, 13.04 -> 13.0, 2.33 -> 2.33."""
    decimals = max(0, 2 - math.floor(math.log10(abs(x)))) if x else 0
    return f"{x:.{decimals}f}"


def time_of(cell: str) -> str:
    """A results.md time cell ("11.86 ms ±477 us", "213 us") as prose quotes it."""
    match = re.match(r"([\d.]+) (us|ms|s)\b", cell)
    assert match, cell
    value, unit = match.groups()
    if unit == "us":
        return f"{value} µs"
    return f"{sig3(float(value))} {unit}"


def ratio_of(cell: str) -> str:
    """A results.md ratio cell ("10.94x", "0.98x") as prose quotes it: 1 decimal from 10x."""
    x = float(cell.rstrip("x"))
    return f"{x:.1f}x" if x >= 10 else cell


def count_of(cell: str) -> str:
    return f"{int(cell):,}"


def mismatch(page: str, expected: str) -> str:
    return f"{page} should say (from the committed results):\n{expected}"


# ------------------------------------------------------------------------------- tables
def check_table(
    page: Path,
    headers: list[str],
    source: dict[str, dict[str, str]],
    names: dict[str, str],
    columns: list[Callable[[dict[str, str]], str]],
) -> None:
    """Each row of the page's table, named as in ``names`` (page name -> results row), holds
    the cells ``columns`` make of its results row; no row goes unchecked."""
    rows = doc_table(page, headers)
    expected = [[name, *(f(source[names[name]]) for f in columns)] for name in names]
    text = "\n".join("| " + " | ".join(r) + " |" for r in expected)
    assert rows == expected, mismatch(f"{page.name}'s table {headers}", text)


def cell(column: str, fmt: Callable[[str], str] = time_of) -> Callable[[dict[str, str]], str]:
    return lambda row: "" if row[column] in ("-", "n/a") else fmt(row[column])


def test_step_cost_table_and_readme_sentence() -> None:
    """docs/benchmarks.md's results table and the README's sentence: the step_cost question
    of the full CPU run (benchmarks/results/cpu)."""
    source = results_rows(RESULTS, "Per-step scaler cost on the target gradient sets")
    names = {
        "3000 x 16": "3000 x 16 fp32",
        "1000 x 1K": "1000 x 1K fp32",
        "GPT-2 124M shapes": "gpt2-124m fp32",
        "4 x 16M": "4 x 16M fp32",
        "3000 x 16, new tensors each step": "3000 x 16 fp32 realloc",
        "1000 x 1K, new tensors each step": "1000 x 1K fp32 realloc",
    }
    headers = ["gradients (fp32)", "tensors", "ampfused", "torch.amp.GradScaler"]
    headers += ["in-place floor", "ampfused / floor", "speedup"]
    columns = [cell("tensors", count_of), cell("ampfused"), cell("torch"), cell("floor-mul")]
    columns += [cell("ampfused / floor", ratio_of), cell("torch / ampfused", ratio_of)]
    check_table(DOCS / "benchmarks.md", headers, source, names, columns)
    small, gpt2 = source["3000 x 16 fp32"], source["gpt2-124m fp32"]
    sentence = (
        f"On a 2-core CPU, 3,000 small gradients take {time_of(small['ampfused'])} a step "
        f"against torch's {time_of(small['torch'])}; GPT-2 124M's shapes "
        f"{time_of(gpt2['ampfused'])} against {time_of(gpt2['torch'])}"
    )
    assert sentence in flat(README.read_text()), mismatch("README.md", sentence)


def test_watch_clip_masters_distributed_tables() -> None:
    """docs/benchmarks.md's tables of the diagnostics, clip, masters and distributed questions
    (the full CPU run)."""
    page = DOCS / "benchmarks.md"
    gpt2, mixed = "GPT-2 124M shapes", "GPT-2 124M shapes, mixed dtypes"
    source = results_rows(
        RESULTS, "Diagnostics: the pass with per-gradient statistics vs per-layer norms by hand"
    )
    watched = lambda r: f"{time_of(r['ampfused-watch'])} ({r['watch / ampfused']})"  # noqa: E731
    check_table(
        page,
        ["gradients", "ampfused", "+ `watch()`", "+ `grad_norms()` each step", "today (torch)",
         "today / watched"],
        source,
        {f"{gpt2}, fp32": "gpt2-124m fp32", "4 x 16M, fp32": "4 x 16M fp32",
         mixed: "gpt2-124m mixed", f"{gpt2}, bf16": "gpt2-124m bf16",
         f"{gpt2}, fp16": "gpt2-124m fp16", "3000 x 16, fp32": "3000 x 16 fp32"},
        [cell("ampfused"), watched, cell("ampfused-norms"), cell("torch-norms"),
         cell("torch-norms / watch", ratio_of)],
    )  # fmt: skip
    source = results_rows(
        RESULTS, "Unscale + clip: scaler.clip_grad_norm_ vs torch's unscale_ + clip_grad_norm_"
    )
    check_table(
        page,
        ["gradients", "fused clip", "torch's pair", "torch / fused", "fused / floor",
         "plain unscale step"],
        source,
        {f"{gpt2}, fp32": "gpt2-124m fp32", "4 x 16M, fp32": "4 x 16M fp32",
         "1000 x 1K, fp32": "1000 x 1K fp32", mixed: "gpt2-124m mixed"},
        [cell("ampfused-clip"), cell("torch-clip"), cell("torch-clip / ampfused-clip", ratio_of),
         cell("ampfused-clip / floor", ratio_of), cell("ampfused")],
    )  # fmt: skip
    source = results_rows(
        RESULTS, "float16 model, float32 masters: MasterWeights vs the recipe by hand"
    )
    check_table(
        page,
        ["gradients (fp16)", "MasterWeights", "by hand", "by hand / MasterWeights",
         "MasterWeights / floor"],
        source,
        {gpt2: "gpt2-124m fp16", "4 x 16M": "4 x 16M fp16", "1000 x 1K": "1000 x 1K fp16"},
        [cell("ampfused-masters"), cell("torch-masters"),
         cell("torch-masters / ampfused-masters", ratio_of),
         cell("ampfused-masters / floor", ratio_of)],
    )  # fmt: skip
    source = results_rows(
        RESULTS, "Distributed: a step with found_inf all-reduced across 2 CPU processes"
    )
    check_table(
        page,
        ["gradients (fp32)", "ampfused.ShardedGradScaler", "torch's ShardedGradScaler",
         "torch / ampfused", "FSDP2: ampfused.GradScaler", "FSDP2: torch.amp.GradScaler",
         "torch / ampfused", "one all-reduce alone"],
        source,
        {"4 x 4M": "4 x 4M fp32", "300 x 16K": "300 x 16K fp32", "1000 x 16": "1000 x 16 fp32"},
        [cell("ampfused-dist"), cell("torch-dist"), cell("torch-dist / ampfused-dist", ratio_of),
         cell("ampfused-fsdp2"), cell("torch-fsdp2"),
         cell("torch-fsdp2 / ampfused-fsdp2", ratio_of), cell("floor-allreduce")],
    )  # fmt: skip


def test_models_sentence() -> None:
    """docs/benchmarks.md's 16-bit sentence and the count of workloads none slower than
    torch: the models question and "How ampfused compares" of the full CPU run."""
    rows = results_rows(RESULTS, "Model gradient sets")
    bf16, fp16, mixed = (rows[f"gpt2-124m {d}"] for d in ("bf16", "fp16", "mixed"))
    compares = results_section(RESULTS, "How ampfused compares")
    # "... on 8 of 8 gradient sets, slower beyond noise on 0", or in later runs "... on 4 of 5
    # gradient sets, slower on 1 (0 of them beyond noise)"
    tallies = re.findall(
        r"- \w+: ampfused faster than torch on \d+ of (\d+) gradient sets?"
        r"(?:, slower beyond noise on (\d+)|, slower on \d+ \((\d+) of them beyond noise\))?",
        compares,
    )
    assert tallies and all((a or b or "0") == "0" for _, a, b in tallies), compares
    sentence = (
        f"GPT-2 124M shapes in bfloat16 take {time_of(bf16['ampfused'])} against torch's "
        f"{time_of(bf16['torch'])}, in float16 {time_of(fp16['ampfused'])} against "
        f"{time_of(fp16['torch'])}, mixed dtypes {time_of(mixed['ampfused'])} against "
        f"{time_of(mixed['torch'])}. No workload of the run's "
        f"{sum(int(n) for n, _, _ in tallies)} is slower than torch."
    )
    assert sentence in flat((DOCS / "benchmarks.md").read_text()), mismatch(
        "benchmarks.md", sentence
    )


def test_tracing_costs_in_debugging_md() -> None:
    """docs/debugging.md's tracing costs: the tracing question of the full CPU run."""
    rows = results_rows(
        RESULTS, "Activation tracing: a GPT-2 step (forward, backward, scaler) traced or not"
    )
    tiny, small = rows["gpt2-tiny fp16 autocast"], rows["gpt2-small shapes fp16 autocast"]
    sentence = (
        f"a tiny GPT-2 (2 layers, {tiny['tensors']} parameters) {time_of(tiny['traced'])} traced "
        f"against {time_of(tiny['untraced'])} untraced ({tiny['traced / untraced']}), against "
        f"{time_of(tiny['item-hooks'])} ({tiny['item-hooks / untraced']}) for hooks that call "
        f"`.item()` per module, which on a GPU is also a host sync per module; GPT-2 small's "
        f"shapes (sequence 16) {time_of(small['traced'])} against {time_of(small['untraced'])}"
    )
    assert sentence in flat((DOCS / "debugging.md").read_text()), mismatch("debugging.md", sentence)


# ------------------------------------------------------------------------------- policy
POLICY = RESULTS / "policy"
MODELS = ("gpt2-tiny", "mlp-teacher")


def policy_rows(model: str) -> list[list[str]]:
    """The per-policy table of ``model`` in the policy run's results.md."""
    text = (POLICY / "results.md").read_text()
    part = text[text.index(f"\n{model}: ") :]
    return md_tables(part)[0][1]


def test_policy_table_in_loss_scale_md() -> None:
    """docs/loss-scale.md's table is the policy run's two tables, a model column added."""
    headers, _ = md_tables((POLICY / "results.md").read_text().split(f"\n{MODELS[0]}: ")[1])[0]
    rows = doc_table(DOCS / "loss-scale.md", ["model", *headers])
    expected = [[model, *row] for model in MODELS for row in policy_rows(model)]
    text = "\n".join("| " + " | ".join(r) + " |" for r in expected)
    assert rows == expected, mismatch("loss-scale.md's policy table", text)


def test_policy_table_in_readme() -> None:
    """The README's shorter table: skips, the median scale and the final loss of the policies
    it names, from the same run."""
    headers = ["model", "policy", "skipped steps: first 50 / later / at spikes"]
    headers += ["median log2 scale", "final loss"]
    rows = doc_table(README, headers)
    named = (
        "torch default",
        "hysteresis 2",
        "growth interval 256",
        "headroom",
        "headroom, fixed 4",
    )
    expected = []
    for model in MODELS:
        by = {r[0]: r for r in policy_rows(model)}
        for policy in named:
            r = by[policy]
            expected.append([model, policy, r[1], r[2].split(" / ")[0], r[4].split()[0]])
    text = "\n".join("| " + " | ".join(r) + " |" for r in expected)
    assert rows == expected, mismatch("README.md's policy table", text)
    float32 = [by_model[-1][4].split()[0] for by_model in map(policy_rows, MODELS)]
    sentence = f"(float32 runs of the same models: final loss {float32[0]} and {float32[1]}.)"
    assert sentence in flat(README.read_text()), mismatch("README.md", sentence)


def test_policy_run_time_in_loss_scale_md() -> None:
    share = run_head(POLICY)["cpu_used_by_others"]["run"]
    sentence = (
        f"The run ({run_seconds(POLICY)} s) had {share:.0%} of the CPU taken by other processes"
    )
    assert sentence in flat((DOCS / "loss-scale.md").read_text()), mismatch(
        "loss-scale.md", sentence
    )


# ------------------------------------------------------------------------------- run times
def load(share: float) -> str:
    return "idle" if share < 0.05 else f"{share:.0%} of the CPU taken by other processes"


def test_how_long_it_takes_in_benchmarks_md() -> None:
    """docs/benchmarks.md's "How long it takes": a row per committed run, its time as its
    results.md states it and the share of the CPU others took meanwhile; the --quick run's
    slowest questions from its own durations."""
    rows = doc_table(DOCS / "benchmarks.md", ["command", "time", "when"])
    by_command = {r[0]: r for r in rows}
    for folder in (RESULTS, POLICY, RESULTS / "busy", RESULTS / "islands", RESULTS / "quick"):
        head = run_head(folder)
        command = re.sub(r" --(out \S+|no-progress)", "", head["command"])
        key = f"`{command}`" + (" (`make bench-quick`)" if command.endswith("--quick") else "")
        key += " (`make bench`)" if command == "python -m benchmarks" else ""
        assert key in by_command, mismatch("benchmarks.md's time table", f"a row for {key}")
        time, when = by_command[key][1:]
        assert time == f"{run_seconds(folder)} s", (key, time, run_seconds(folder))
        assert when.startswith(load(head["cpu_used_by_others"]["run"])), (key, when)
    quick = run_head(RESULTS / "quick")
    slow = sorted(quick["durations_s"].items(), key=lambda kv: -kv[1])[:2]
    words = ", ".join(f"{q} {s:.0f} s" for q, s in slow)
    key = "`python -m benchmarks --quick` (`make bench-quick`)"
    assert words in by_command[key][2], mismatch("benchmarks.md's --quick row", words)


@pytest.mark.parametrize("page", [README, DOCS / "benchmarks.md"])
def test_pages_name_no_figure_from_a_run_that_is_gone(page: Path) -> None:
    """The figures removed with the runs that made them stay removed."""
    text = flat(page.read_text())
    for gone in ("27 to 30 s", "269 to 310 s", "61 s idle", "| 61 s |"):
        assert gone not in text, (page.name, gone)
