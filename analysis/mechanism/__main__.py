"""``python -m analysis.mechanism``: runs ``python -m analysis.mechanism_stats``."""

import sys

from analysis.mechanism_stats import main

sys.exit(main())
