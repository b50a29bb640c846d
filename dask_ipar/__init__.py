"""dask-ipar: integrated model, batch and domain parallel training on dask.distributed.

The P worker processes form a ``Pr x Pc`` grid (:class:`Grid`). Weights are
dask arrays whose blocks live on the grid cells that own them, each layer's
forward and backward pass is a task graph of local matmuls joined by
collectives along one grid axis (the "1.5D" scheme of Gholami et al.,
SPAA 2018, Eq. 8), and an analytic cost model (:mod:`dask_ipar.cost`,
free of dask imports) predicts every collective.

Submodules are imported lazily so that ``import dask_ipar.cost`` never pulls
in dask.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Grid": "dask_ipar.layout.grid",
    "GridBinding": "dask_ipar.layout.grid",
    "bind_grid": "dask_ipar.runtime.workers",
    "parse_grid": "dask_ipar.layout.grid",
    "factorizations": "dask_ipar.layout.grid",
    "Dense": "dask_ipar.nn.layers",
    "Conv2d": "dask_ipar.nn.layers",
    "MaxPool2d": "dask_ipar.nn.layers",
    "AvgPool2d": "dask_ipar.nn.layers",
    "Flatten": "dask_ipar.nn.layers",
    "Sequential": "dask_ipar.model",
    "SGD": "dask_ipar.optim",
    "Adam": "dask_ipar.optim",
    "AdamW": "dask_ipar.optim",
    "IparError": "dask_ipar.errors",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dask_ipar' has no attribute {name!r}")


def __dir__():
    return __all__
