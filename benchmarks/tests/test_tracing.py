"""The tracing question: three methods timed on a model, their table with the ratios."""

from __future__ import annotations

import pytest
import torch

from benchmarks import tracing
from benchmarks.suite import Context
from benchmarks.timing import QUICK_TIMING

pytest.importorskip("transformers")


def test_tracing_question_times_each_method(monkeypatch):
    monkeypatch.setattr(tracing, "MODELS", tracing.MODELS[:1])  # (the tiny GPT-2 only)
    ctx = Context(device=torch.device("cpu"), timing=QUICK_TIMING, methods=[], quick=True)
    records = tracing.run(ctx)
    assert [r.method for r in records] == list(tracing.METHODS)
    assert all(r.median_s > 0 and r.q1_s <= r.median_s <= r.q3_s for r in records)
    assert {r.workload for r in records} == {"gpt2-tiny"}
    text = tracing.table(records, "github")  # (the console wraps headers)
    assert "traced / untraced" in text and "item-hooks / untraced" in text and "gpt2-tiny" in text
