"""Old path of analysis/mechanism_stats.py, kept so recorded commands still run: ``python -m analysis.mechanism
...`` is ``python -m analysis.mechanism_stats ...`` (__main__.py); an attribute of this package is the one of
analysis.mechanism_stats."""

from analysis import mechanism_stats as _real


def __getattr__(name: str):
    return getattr(_real, name)
