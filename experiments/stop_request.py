"""A request, made by a signal, that a run save a checkpoint at the end of the step under way and then stop.

``experiments.run`` listens for the backend's save signal (``save_signal`` in experiments/backends.py; trl: USR1)
from before it records the attempt as ``running`` until after it records how the attempt ended (in between the
signal is ignored), so the signal never finds the run's process without a handler, which would kill it without a
word. The backend reads :func:`current` at each step's end (experiments/trl/train.py). ``python -m slurm.stop``
sends the signal.
"""

from __future__ import annotations

import signal


class SaveRequest:
    """Set by the signal's handler; read by the backend at the end of each step."""

    def __init__(self, signum: int | None = None):
        self.requested = False
        self.signal = signal.Signals(signum).name if signum else None  # what it listens for, e.g. SIGUSR1

    def request(self, signum=None, frame=None) -> None:
        self.requested = True


_current: SaveRequest | None = None


def current() -> SaveRequest | None:
    """The request of the attempt listening now in this process (None: nobody listens)."""
    return _current


def listen(signum: int):
    """From now on ``signum`` sets a fresh :func:`current` request (main thread only); returns the previous handler.
    Interrupted system calls restart (``siginterrupt(False)``), so the signal never fails a read or a write."""
    global _current
    _current = SaveRequest(signum)
    previous = signal.signal(signum, _current.request)
    signal.siginterrupt(signum, False)
    return previous


def ignore(signum: int) -> None:
    """The attempt is ending: a late signal is ignored until :func:`restore`."""
    signal.signal(signum, signal.SIG_IGN)


def restore(signum: int, previous) -> None:
    """Nobody listens any more; ``previous`` (from :func:`listen`) handles ``signum`` again."""
    global _current
    _current = None
    if previous is not None:  # None: a handler installed from C, which Python cannot reinstate
        signal.signal(signum, previous)
