"""Old path of experiments/bench/batch.py, kept so recorded commands still run:
``python -m experiments.bench_batch ...`` is ``python -m experiments.bench.batch ...``."""

import sys

from experiments.bench import batch as _real

if __name__ == "__main__":
    _real.main()
sys.modules[__name__] = _real  # `import experiments.bench_batch` gives the module itself, not a copy of its names
