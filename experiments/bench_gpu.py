"""Old path of experiments/bench/gpu.py, kept so recorded commands still run: ``python -m experiments.bench_gpu ...`` is
``python -m experiments.bench.gpu ...``."""

import sys

from experiments.bench import gpu as _real

if __name__ == "__main__":
    sys.exit(_real.main())
sys.modules[__name__] = _real  # `import experiments.bench_gpu` gives the module itself, not a copy of its names
