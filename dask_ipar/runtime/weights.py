"""A model's weights as users see them: initial values, checks of user-given ``(W, b)``
pairs, the whole matrices assembled from their grid blocks, and the blocks as dask arrays.

Weight block ``(i, j)`` of a layer holds rows ``rows[i]`` and columns ``wcols[j]`` of its
``n_out x (n_in + bias)`` matrix, whose last column is the bias; a conv's ``W`` is its
filters ``(O, C/g, kh, kw)``.
"""

from __future__ import annotations

import importlib
import math

import numpy as np

from dask_ipar.errors import IparError

__all__ = ["initial_params", "check_params", "join_blocks", "assemble", "weight_shape",
           "weight_arrays"]


def _glorot(rng, n_out, n_in, dtype):
    lim = math.sqrt(6.0 / (n_in + n_out))
    return rng.uniform(-lim, lim, size=(n_out, n_in)).astype(dtype)


def _glorot_conv(rng, wshape, dtype):
    o, cg, kh, kw = wshape
    lim = math.sqrt(6.0 / (cg * kh * kw + o * kh * kw))
    return rng.uniform(-lim, lim, size=wshape).astype(dtype)


def initial_params(model, engine):
    """Glorot-uniform weights and zero biases of every layer with weights, seeded by
    ``model.seed``: ``[(W, b), ...]``, convs first."""
    sizes = model.sizes
    first = len(model.layers) - len(model.dense_layers)
    rng = np.random.default_rng(model.seed)
    front = engine.front
    return [
        (_glorot_conv(rng, f.wshape, model.dtype),
         np.zeros(f.wshape[0], model.dtype) if f.weights.bias else None)
        for f in ([] if front is None else front.convs)
    ] + [
        (_glorot(rng, lay.units, sizes[k], model.dtype),
         np.zeros(lay.units, model.dtype) if lay.bias else None)
        for k, lay in enumerate(model.dense_layers, start=first)
    ]


def weight_shape(engine, lay):
    """Shape of a layer's ``W`` as users see it (filters for a conv)."""
    if engine is not None and engine.front is not None:
        for f in engine.front.convs:
            if f.weights.name == lay.name:
                return f.wshape
    return (lay.n_out, lay.n_in)


def join_blocks(blocks, name, grid):
    """The whole ``n_out x (n_in + bias)`` matrix from its blocks ``blocks[(name, i, j)]``
    (joined along the last two axes: Adam's state blocks are ``(2, rows, cols)``)."""
    return np.concatenate([
        np.concatenate([np.asarray(blocks[(name, i, j)]) for j in range(grid.pc)], axis=-1)
        for i in range(grid.pr)
    ], axis=-2)


def assemble(lay, name, blocks, grid, wshape):
    """``(W, b)`` of a layer from its blocks ``blocks[(name, i, j)]``."""
    full = join_blocks(blocks, name, grid)
    W = full[:, : lay.n_in]
    if lay.name.startswith("conv"):
        W = W.reshape(wshape)
    return (W, full[:, lay.n_in] if lay.bias else None)


def check_params(engine, params):
    """User-given ``[(W, b), ...]`` checked against the layers: the list, or a clear error."""
    params = list(params)
    layouts = engine.param_layouts
    if len(params) != len(layouts):
        raise IparError(f"expected {len(layouts)} (W, b) pairs (one per layer with weights), "
                        f"got {len(params)}.")
    checked = []
    for k, (lay, (W, b)) in enumerate(zip(layouts, params)):
        W = np.asarray(W)
        if W.shape != weight_shape(engine, lay):
            raise IparError(
                f"layer {lay.index} ({lay.name}): W has shape {W.shape}, expected "
                f"{weight_shape(engine, lay)} "
                + ("(filters, channels / groups, kh, kw)." if lay.name.startswith("conv")
                   else "(d_out x d_in).")
            )
        if lay.bias:
            if b is None or np.shape(b) != (lay.n_out,):
                raise IparError(
                    f"layer {k}: bias has shape {np.shape(b)}, expected ({lay.n_out},)."
                )
        checked.append((W, b))
    return checked



def weight_arrays(engine, w_names, futures, dtype, block_module=None):
    """The master weights as dask arrays (``d_out x (d_in + bias)``), block (i, j) on cell
    (i, j), from the futures of the current weight blocks."""
    import dask.array as da

    out = []
    cells = engine.grid.cells()
    for lay, name in zip(engine.param_layouts, w_names):
        dsk = {(name, i, j): futures[(name, i, j)] for i, j in cells}
        chunks = (tuple(b - a for a, b in lay.rows), tuple(b - a for a, b in lay.wcols))
        meta = np.empty((0, 0), dtype=dtype)
        if block_module:
            xp = importlib.import_module(block_module)
            meta = xp.empty((0, 0), dtype=getattr(xp, dtype.name))
        out.append(da.Array(dsk, name, chunks, meta=meta))
    return out
