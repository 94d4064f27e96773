"""Old path of experiments/verl_overrides.py, kept so recorded commands still run: ``python -m experiments.verl ...`` is
``python -m experiments.verl_overrides ...``."""

import sys

from experiments import verl_overrides as _real

if __name__ == "__main__":
    sys.exit(_real.main())
sys.modules[__name__] = _real  # `import experiments.verl` gives the module itself, not a copy of its names
