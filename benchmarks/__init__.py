"""The ampfused benchmark suite: ``python -m benchmarks --help``.

Modules: :mod:`~benchmarks.workloads` (shape lists and gradient sets), :mod:`~benchmarks.methods`
(what is compared), :mod:`~benchmarks.timing` (interleaved synchronized timing),
:mod:`~benchmarks.profiling` (op counts), :mod:`~benchmarks.suite` (records), one ``bench_*``
module per question plus :mod:`~benchmarks.step_cost`, :mod:`~benchmarks.targets`,
:mod:`~benchmarks.report`, :mod:`~benchmarks.results_io` (the results files) and
:mod:`~benchmarks.compare` (two runs side by side).  Results live in
``benchmarks/results/<device>/``.
"""
