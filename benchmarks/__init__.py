"""The ampfused benchmark suite: ``python -m benchmarks --help``.

- ``__main__``      the command: runs the questions, prints and writes what they measured
- ``questions``     the single-process questions: their gradient sets, methods and tables
- ``distributed``   the 2-process question (gloo); ``e2e`` a small GPT trained under each scaler
- ``instructions``  host cost in instructions (``--only instructions``, or on its own)
- ``policy``        loss-scale policies trained side by side in float16 autocast (CPU)
- ``islands``       the same training, per layer: activation gradients left subnormal, step time
- ``methods``       what is compared: one runner per method, the registry
- ``workloads``     shape lists (GPT-2, Llama, ResNet-50, BERT, ViT) and gradient sets
- ``timing``        interleaved timing: per step (CPU) and batched (GPU)
- ``suite``         one workload's methods timed into records; profiler and bytecode counts
- ``report``        number formats, tables, plots
- ``targets``       our own performance targets: checked on a run's records, their table
- ``compare``       results.jsonl, and ``python -m benchmarks.compare OLD NEW``
- ``env``           the environment header and device helpers

A run writes to a new folder of its own, ``benchmarks/runs/<date>-<time>-<device>/``
(git-ignored), or to ``--out DIR``; the committed results are in
``benchmarks/results/<device>/``, written with ``--out``.
"""
