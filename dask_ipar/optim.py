"""Optimizer settings. The state (momentum) lives on the workers beside the weight slices."""

from __future__ import annotations

from dataclasses import dataclass

from dask_ipar.errors import IparError

__all__ = ["SGD"]


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent with momentum and weight decay (PyTorch's rule).

    ``v <- momentum * v + g + weight_decay * W`` and ``W <- W - lr * v``; weight
    decay does not apply to biases.
    """

    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0

    def __post_init__(self):
        for name, lo in (("lr", 0.0), ("momentum", 0.0), ("weight_decay", 0.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= lo or v != v:
                raise IparError(f"SGD {name} must be a number >= {lo}, got {v!r}.")
        if self.momentum >= 1:
            raise IparError(f"SGD momentum must be < 1, got {self.momentum}.")
