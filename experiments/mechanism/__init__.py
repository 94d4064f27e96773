"""Old path of experiments/mechanism_probe.py, kept so recorded commands still run: ``python -m
experiments.mechanism ...`` is ``python -m experiments.mechanism_probe ...`` (__main__.py); an attribute of this
package is the one of experiments.mechanism_probe."""

from experiments import mechanism_probe as _real


def __getattr__(name: str):
    return getattr(_real, name)
