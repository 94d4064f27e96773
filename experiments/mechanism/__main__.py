"""``python -m experiments.mechanism``: runs ``python -m experiments.mechanism_probe``."""

import sys

from experiments.mechanism_probe import main

sys.exit(main())
