"""The experiment harness (docs/design.md): configs, run folders, sweeps and the backends that run them.

Importing the package registers every backend (experiments/backends.py) with the config schema, so a RunConfig built
anywhere gets its backend's checks and identity.
"""

from experiments import backends as backends  # noqa: E402  registers the backends with experiments.config
