"""``python -m experiments.mechanism``: the walk on the toy (experiments.mechanism.toy)."""

import sys

from experiments.mechanism.toy import main

sys.exit(main())
