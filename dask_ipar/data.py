"""Validation of user data at the public boundary, and the bundled digits set."""

from __future__ import annotations

import numpy as np

from dask_ipar.errors import IparError

__all__ = ["as_features", "as_labels", "load_digits_split", "load_digits_images"]


def _materialize(a, what):
    if hasattr(a, "dask") and hasattr(a, "compute"):
        a = a.compute()
    try:
        return np.asarray(a)
    except Exception as exc:  # e.g. ragged lists
        raise IparError(f"{what} could not be converted to an array: {exc}") from exc


def as_features(X, n_features: int | None, dtype) -> np.ndarray:
    """Check and convert features ``(n_samples, n_features)``: numeric, finite, 2-D.

    Dask arrays are computed (the data set is held by the client and sent to the
    workers batch by batch).
    """
    X = _materialize(X, "X")
    if X.dtype.kind not in "biuf":
        raise IparError(
            f"X must be numeric, got dtype {X.dtype}. Convert it first, for example "
            "X.astype('float32'), after encoding any categorical or text columns."
        )
    if X.ndim != 2:
        raise IparError(
            f"X must be 2-D (n_samples, n_features), got shape {X.shape}. "
            "Reshape images with X.reshape(len(X), -1)."
        )
    if n_features is not None and X.shape[1] != n_features:
        raise IparError(
            f"X has {X.shape[1]} features but the model's first layer expects {n_features}. "
            f"Build the model with input_dim={X.shape[1]} or select {n_features} features."
        )
    X = X.astype(dtype, copy=False)
    if not np.isfinite(X).all():
        bad = np.argwhere(~np.isfinite(X))[0]
        raise IparError(
            f"X contains NaN or inf (first at sample {bad[0]}, feature {bad[1]}). "
            "Impute or drop those values before training."
        )
    return X


def as_labels(y, n_samples: int, n_classes: int) -> np.ndarray:
    """Check and convert integer class labels in ``[0, n_classes)``."""
    y = _materialize(y, "y")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise IparError(f"y must be 1-D class labels, got shape {y.shape}.")
    if y.shape[0] != n_samples:
        raise IparError(f"X has {n_samples} samples but y has {y.shape[0]} labels.")
    if y.dtype.kind == "f":
        if not np.isfinite(y).all() or (y != np.round(y)).any():
            raise IparError("y must hold integer class labels; got non-integer values.")
    elif y.dtype.kind not in "biu":
        raise IparError(
            f"y must hold integer class labels, got dtype {y.dtype}. "
            "Encode string labels first, e.g. with numpy.unique(y, return_inverse=True)."
        )
    y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= n_classes):
        raise IparError(
            f"labels must lie in [0, {n_classes}) for a last layer of {n_classes} units; "
            f"got labels from {y.min()} to {y.max()}. Widen the last layer to "
            f"{max(int(y.max()) + 1, n_classes)} units or remap the labels."
        )
    return y


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise IparError(
            "the digits data set needs scikit-learn: pip install 'dask-ipar[train]'"
        ) from exc
    return load_digits(return_X_y=True)


def _test_mask(y, test_fraction, seed):
    """The same share of every class held out, drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test[idx[: int(round(test_fraction * len(idx)))]] = True
    return test


def load_digits_images(test_fraction: float = 0.2, seed: int = 0, upsample: int = 1):
    """The digits of :func:`load_digits_split` (same split) as NCHW images.

    Shape ``(n, 1, 8*upsample, 8*upsample)``: each pixel repeated ``upsample`` times
    along both axes (more rows to split over ``Pr``), standardized with the training
    pixels' global mean and deviation (images keep their contrast).
    """
    X, y = _load_digits()
    test = _test_mask(y, test_fraction, seed)
    imgs = X.reshape(-1, 1, 8, 8)
    if upsample > 1:
        imgs = imgs.repeat(upsample, axis=2).repeat(upsample, axis=3)
    mean, std = imgs[~test].mean(), imgs[~test].std()
    imgs = (imgs - mean) / std
    return imgs[~test], y[~test].astype(np.int64), imgs[test], y[test].astype(np.int64)


def load_digits_split(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's bundled 8x8 digits (no download), standardized, split per class.

    Returns ``X_train, y_train, X_test, y_test`` (float64 features, int64 labels).
    """
    X, y = _load_digits()
    test = _test_mask(y, test_fraction, seed)
    Xtr, Xte = X[~test], X[test]
    mean, std = Xtr.mean(axis=0), Xtr.std(axis=0)
    std[std == 0] = 1.0
    return (Xtr - mean) / std, y[~test].astype(np.int64), (Xte - mean) / std, y[test].astype(np.int64)
