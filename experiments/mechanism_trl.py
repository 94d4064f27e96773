"""Old path of experiments/mechanism/trl.py, kept because a record names it: results/mechanism/r1/probe_set.jsonl was
made by ``python -m experiments.mechanism_trl make-set ...``, which is ``python -m experiments.mechanism.trl ...``."""

import sys

from experiments.mechanism import trl as _real

if __name__ == "__main__":
    sys.exit(_real.main())
sys.modules[__name__] = _real  # `import experiments.mechanism_trl` gives the module itself, not a copy of its names
