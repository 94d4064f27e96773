"""The paired per-update test (docs/mechanism.md): from states of a hard-clip baseline run, one RL update of every rule
on the same rollout, minibatches and noise, each scored against the baseline's own (hard) update.

    plan       the rules, seeds and states of a test, a sweep's baselines, the file (header + one line per state)
    exact      the toy's score: exact expected pass@1 of a task whose answers can be enumerated
    toy        the walk on the tiny backend (replay: experiments.tiny.train.rl_step); python -m experiments.mechanism
    probe_set  the trl walk's score: teacher-forced log-prob of verified-correct held-out completions
    trl        the walk on the trl backend (replay: experiments.trl.replay); python -m experiments.mechanism.trl

Its statistics are analysis.mechanism (``python -m analysis.mechanism FILES``). Nothing in experiments/ imports this
package: it drives the backends (experiments.run, their replay parts)."""
