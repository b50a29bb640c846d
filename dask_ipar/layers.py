"""Layer descriptions used to build models.

A layer here is a small frozen value; the distributed forward and backward
graphs live in :mod:`dask_ipar.engine`, the local kernels in
:mod:`dask_ipar.kernels`, and the analytic cost in :mod:`dask_ipar.cost`.
"""

from __future__ import annotations

from dataclasses import dataclass

from dask_ipar.errors import IparError
from dask_ipar.kernels import ACTIVATIONS

__all__ = ["Dense"]


@dataclass(frozen=True)
class Dense:
    """A fully connected layer ``y = f(W x + b)`` with ``units`` outputs.

    Parameters
    ----------
    units : int
        Output width ``d_i``.
    activation : {"linear", "relu", "tanh"} or None
        Applied to the output. The last layer of a classifier stays linear: the
        softmax lives in the cross-entropy loss.
    bias : bool
        Whether the layer has a bias (stored as an extra weight column).

    Examples
    --------
    >>> Dense(10, "relu")
    Dense(units=10, activation='relu', bias=True)
    """

    units: int
    activation: str | None = "linear"
    bias: bool = True

    def __post_init__(self):
        if not isinstance(self.units, int) or isinstance(self.units, bool) or self.units < 1:
            raise IparError(f"Dense units must be a positive integer, got {self.units!r}.")
        act = "linear" if self.activation is None else self.activation
        if act not in ACTIVATIONS:
            raise IparError(
                f"unknown activation {self.activation!r}; expected one of {', '.join(ACTIVATIONS)}."
            )
        object.__setattr__(self, "activation", act)
