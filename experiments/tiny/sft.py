"""Old path of experiments/sft.py (the testbed's warm start), kept so recorded commands still run:
``python -m experiments.tiny.sft CONFIG [overrides] [--eval]`` is ``python -m experiments.sft ...``."""

import sys

from experiments import sft

if __name__ == "__main__":
    sys.exit(sft.main())
sys.modules[__name__] = sft  # `import experiments.tiny.sft` gives the module itself, not a copy of its names
