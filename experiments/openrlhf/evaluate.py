"""Old path of experiments/evaluation/math.py (the math evaluator over checkpoints), kept so recorded commands still
run: ``python -m experiments.openrlhf.evaluate RUN_DIR ...`` is ``python -m experiments.evaluation.math ...``."""

import sys

from experiments.evaluation import math

if __name__ == "__main__":
    sys.exit(math.main())
sys.modules[__name__] = math  # `import experiments.openrlhf.evaluate` gives the module itself, not a copy of its names
