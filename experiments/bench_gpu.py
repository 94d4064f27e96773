"""Old path of experiments/bench/gpu.py, kept because a record names it: results/bench_gpu/2026-12-04-nvidia-h200.json
was made by ``python -m experiments.bench_gpu``, which is ``python -m experiments.bench.gpu``."""

import sys

from experiments.bench import gpu as _real

if __name__ == "__main__":
    sys.exit(_real.main())
sys.modules[__name__] = _real  # `import experiments.bench_gpu` gives the module itself, not a copy of its names
