"""Run folders -> tables, figures and the claims table (design.md: ``make_all`` is the only way figures are made).

load      run folders -> RunSet (runs, steps, eval labels; issues listed, never fatal)
summary   one number per run and metric (final / best reward, pass@k, entropy spike, clip and rescue fractions)
stats     unbiased pass@k, seeded bootstrap and Student-t intervals, paired differences
tables    per-sweep tables (markdown, LaTeX) and the paper's numbers side by side
figures   training dynamics, delta sweep, judge / executor, theory (expected weight)
claims    the paper's claims (claims.yaml) -> supports / contradicts / inconclusive
make_all  ``python -m analysis.make_all``: all of the above, and the README claims block
synth     synthetic run folders (tests, benchmark);  bench: ``python -m analysis.bench``
"""
