"""Developer support, not part of the installed kit (pyproject installs nsr, experiments, analysis, slurm only):
tools that serve the tests and the benchmarks, run from a checkout of the repo.

synthetic_runs   synthetic run folders in the exact run-folder contract (the analysis tests, the make_all benchmark)
bench_make_all   ``python -m devtools.bench_make_all``: times ``python -m analysis.make_all`` on a synthetic grid

Layer: above analysis/ (docs/design.md, "Dependencies"): it may import analysis/, experiments/ and nsr/; nothing of
the kit imports it (tests/test_layers.py).
"""
