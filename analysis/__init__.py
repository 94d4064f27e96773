"""Run folders -> tables, figures and the claims table (docs/design.md: ``make_all`` is the only way figures are made).

load      run folders -> RunSet (one run per config hash, sweep memberships, steps, eval labels; issues listed)
summary   one number per run and metric (final / best reward, pass@k, entropy spike, clip and rescue fractions)
stats     exact unbiased pass@k, the one interval rule (Student-t), Holm, power, paired differences
tables    per-sweep tables (markdown, LaTeX) and the paper's numbers side by side
figures   training dynamics, delta sweep, judge / executor, theory (expected weight)
claims    the paper's claims (claims.yaml) -> supports / contradicts / not reproduced / untestable / inconclusive
make_all  ``python -m analysis.make_all``: all of the above, results/report.html, results/README.md's claims block
regime    the evidence plan's readouts (stages A, A2);  mechanism: the mechanism test's statistics and gate
report    the static HTML report;  dose: the dose and its matched widening;  readings: numbers the docs quote
"""
