"""Old path of nsr/value_checks.py, kept because nsr is a public package: ``import nsr.validate`` and
``from nsr.validate import check`` give nsr.value_checks itself."""

import sys

from nsr import value_checks as _real

sys.modules[__name__] = _real  # `import nsr.validate` gives the module itself, not a copy of its names
