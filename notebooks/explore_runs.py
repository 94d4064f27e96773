# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Explore NSR runs
#
# Loads run folders and looks at them through `analysis` only (the tables and figures of record are made by
# `python -m analysis.make_all`; nothing here feeds them). Open it as a notebook with
# `jupytext --to ipynb notebooks/explore_runs.py` (or the jupytext Jupyter extension), or run it as a script:
# `python notebooks/explore_runs.py`.
#
# `NSR_RUNS` picks the results folder (default: the repo's `results/runs`), `NSR_SWEEP` the sweep to look at
# (default: the one with the most finished runs). Needs the repo installed (`make venv`, or `pip install -e .`).

# %%
import os
import warnings

import pandas as pd
from IPython.display import display

# `analysis` is the installed package (`pip install -e .`), so this works from any working directory
from analysis import claims, figures, tables
from analysis.load import RUNS_ROOT, RunWarning, load_runs, status_report
from analysis.summary import eval_curves, summarize

# %matplotlib inline

RUNS = os.environ.get("NSR_RUNS") or str(RUNS_ROOT)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", RunWarning)  # every problem is kept in rs.issues, shown below
    rs = load_runs(RUNS)
print(f"{len(rs.runs)} run folders under {RUNS}, {int(rs.runs['included'].sum()) if len(rs.runs) else 0} finished")
for issue in rs.issues:
    print(" ", issue)

# %% [markdown]
# ## Run status per sweep

# %%
pd.DataFrame({sweep: {state: len(ids) for state, ids in states.items()} for sweep, states in status_report(rs).items()})

# %% [markdown]
# ## One number per run
# `summarize` gives every summary metric of every finished run (definitions: `analysis.summary.STEP_METRICS`).

# %%
summary = summarize(rs)
curves = eval_curves(rs.eval_counts())
counts = summary["sweep"].value_counts()
SWEEP = os.environ.get("NSR_SWEEP") or (counts.index[0] if len(counts) else None)
print("sweep:", SWEEP)
cols = ["label", "seed", "final_reward", "pass@1", "final_entropy", "entropy_spike", "clip_frac", "rescue_frac"]
summary.loc[summary["sweep"] == SWEEP, [c for c in cols if c in summary.columns]]

# %% [markdown]
# ## Arms: mean and 95% bootstrap CI over seeds, and paired differences vs the baseline arm

# %%
s = summary[summary["sweep"] == SWEEP]
if len(s):
    stats = tables.arm_stats(s, ["final_reward", "pass@1", "final_entropy"])
    display(stats.pivot(index="label", columns="metric", values="mean"))
    display(tables.paired_vs_baseline(s, ["pass@1", "final_entropy"]))

# %% [markdown]
# ## Training dynamics (the same figure make_all saves)

# %%
fig = figures.dynamics_figure(rs, summary, curves, SWEEP) if SWEEP else None
if fig is not None:
    display(fig)

# %% [markdown]
# ## Does final entropy track pass@1 across runs?
# An exploration only: one point per run, coloured by arm.

# %%
if len(s) and "pass@1" in s:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    for arm, g in s.groupby("arm"):
        ax.scatter(g["final_entropy"], g["pass@1"], label=arm)
    ax.set_xlabel("final entropy")
    ax.set_ylabel("pass@1")
    ax.legend(fontsize=8)
    display(fig)

# %% [markdown]
# ## The paper's claims on these runs

# %%
claim_list, min_pairs = claims.load_claims()
print(claims.render(claims.evaluate(summary, claim_list, min_pairs)))
