"""Old path of experiments/bench/loss.py, kept so recorded commands still run:
``python -m experiments.bench_loss ...`` is ``python -m experiments.bench.loss ...``."""

import sys

from experiments.bench import loss as _real

if __name__ == "__main__":
    _real.main()
sys.modules[__name__] = _real  # `import experiments.bench_loss` gives the module itself, not a copy of its names
