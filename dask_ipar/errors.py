"""The exception types dask-ipar raises: bad input, and a grid worker that hung."""

from __future__ import annotations

__all__ = ["IparError", "WorkerHung"]


class IparError(ValueError):
    """Bad input or an impossible configuration.

    Messages say what was given, what was expected and how to fix it.
    """


class WorkerHung(IparError):
    """A grid worker stopped answering (no heartbeat for ``dask-ipar.hung-after``) and was
    restarted or removed; the blocks it held are lost.

    Attributes
    ----------
    workers : list of str
        Addresses of the workers that stopped answering.
    silent_s : float
        Seconds the longest-silent one had sent no heartbeat.
    """

    def __init__(self, message: str, workers=(), silent_s: float = 0.0):
        super().__init__(message)
        self.workers, self.silent_s = list(workers), float(silent_s)

    def __reduce__(self):
        return type(self), (str(self), self.workers, self.silent_s)
