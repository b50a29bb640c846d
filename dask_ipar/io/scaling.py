"""Input standardization, fitted on the training split and stored with the model.

Features of very different scales (raw pixels 0..16 beside ones near 0) make SGD at a
rate fit for unit-scale inputs diverge or stall at chance. :class:`Standardizer` holds
``mean`` and ``scale`` per feature (a dense model's input) or per channel (a CNN's
images); :meth:`dask_ipar.model.Sequential.fit` with ``standardize=True`` fits one on
its training data, and every later ``fit``, ``predict``, ``evaluate`` and ``gradients``
applies it, as does a saved model (:mod:`dask_ipar.io.modelfile`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dask_ipar.errors import IparError

__all__ = ["Standardizer"]


@dataclass(frozen=True)
class Standardizer:
    """``(x - mean) / scale`` along the feature axis (axis 1) of a batch.

    ``mean`` and ``scale`` have one value per feature of ``(n, d)`` inputs, or per
    channel of ``(n, C, H, W)`` images. A constant feature gets scale 1 (it becomes 0).
    """

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, X, client=None) -> "Standardizer":
        """Fitted on ``X``; data the cells read (:class:`dask_ipar.io.lazy.LazyInputs`)
        is reduced on ``client``'s workers (only the moments come back)."""
        if hasattr(X, "to_dask"):
            return cls._fit_lazy(X, client)
        X = np.asarray(X)
        if X.ndim not in (2, 4) or X.shape[0] == 0:
            raise IparError(f"standardization needs (n, d) features or (n, C, H, W) images "
                            f"with n >= 1, got shape {X.shape}.")
        axes = (0,) if X.ndim == 2 else (0, 2, 3)
        Xd = X.astype(np.float64, copy=False)
        mean = Xd.mean(axis=axes)
        scale = Xd.std(axis=axes)
        scale[~(scale > 1e-12 * np.maximum(1.0, np.abs(mean)))] = 1.0
        return cls(mean, scale)

    @classmethod
    def _fit_lazy(cls, X, client):
        D = X.to_dask()
        axes = (0,) if D.ndim == 2 else (0, 2, 3)
        D = D.astype(np.float64)
        moments = [D.mean(axis=axes), D.std(axis=axes)]
        if client is not None:
            mean, scale = client.gather(client.compute(moments))
        else:
            import dask

            mean, scale = dask.compute(*moments)
        mean, scale = np.asarray(mean), np.array(scale)
        scale[~(scale > 1e-12 * np.maximum(1.0, np.abs(mean)))] = 1.0
        return cls(mean, scale)

    def apply(self, X: np.ndarray) -> np.ndarray:
        """Standardized ``X`` in its own dtype (a new array)."""
        if X.shape[1] != self.mean.shape[0]:
            raise IparError(
                f"the model standardizes {self.mean.shape[0]} "
                f"{'features' if X.ndim == 2 else 'channels'}, the data has {X.shape[1]}.")
        shape = (1, -1) + (1,) * (X.ndim - 2)
        mean = self.mean.reshape(shape).astype(X.dtype)
        scale = self.scale.reshape(shape).astype(X.dtype)
        return (X - mean) / scale

    def arrays(self) -> dict:
        return {"scaling/mean": self.mean, "scaling/scale": self.scale}
