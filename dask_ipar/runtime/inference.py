"""Inference on a distributed model: logits, loss and accuracy, and the gradients of the
mean loss, batch by batch on the grid with the same graphs (and floats) as training."""

from __future__ import annotations

import numpy as np

from dask._task_spec import TaskRef

from dask_ipar.io.data import as_labels
from dask_ipar.nn.graph import StepGraph

__all__ = ["forward", "evaluate", "gradients"]


def _forward_batch(model, Xb, yb):
    step = model._next_step()
    g = StepGraph()
    x_keys, y_keys, data = model._place_batch(Xb, yb, step, g)
    g, logit_keys, stats = model.engine.forward(x_keys, model._w, step, y_keys, g=g,
                                               batch=Xb.shape[0])
    futs = model._submit(g, f"fwd-{model.uid}-s{step}", logit_keys + stats)
    return futs, logit_keys


def forward(model, X, batch_size: int | None = 4096):
    """Logits ``(n_samples, classes)``, computed on the grid batch by batch: a NumPy
    array, or for inputs the workers read (:mod:`dask_ipar.io.lazy`) a dask array
    chunked by samples whose blocks stay on the grid's workers."""
    from dask_ipar.io.lazy import LazyInputs

    model._require_bound()
    X = model._as_inputs(X)
    model._require(X.shape[1])
    out = []
    for Xb, _ in model._batches(X, None, batch_size):
        futs, keys = _forward_batch(model, Xb, None)
        if isinstance(X, LazyInputs):
            out.extend(_on_workers(model, Xb.shape[0], keys, futs))
        else:
            out.extend(np.asarray(o).T for o in model._fetch(keys, futs))
    if isinstance(X, LazyInputs):
        import dask.array as da

        return da.concatenate(out, axis=0)
    return np.concatenate(out, axis=0)


def _on_workers(model, n: int, keys, futs):
    """The logits blocks of a batch (column j: ``classes x b_j`` on cell (0, j)) as
    lazy ``b_j x classes`` dask arrays of their futures (in host memory)."""
    import dask.array as da

    from dask_ipar.kernels import blocks as B
    from dask_ipar.layout.partition import split_sizes

    if model.block_module:  # each owner copies its block to host memory
        g = StepGraph()
        name = f"host.fetch-{model.uid}-s{model._next_step()}"
        hkeys = []
        for j, key in enumerate(keys):
            g.add((name, j), model.binding.worker(*key[1:3]), B.to_host, TaskRef(key))
            hkeys.append((name, j))
        futs = model._store.submit(g, f"to-host-{name}", hkeys)
    return [da.from_delayed(f, shape=(model.n_classes, nb), dtype=model.dtype).T
            for f, nb in zip(futs, split_sizes(n, model.binding.grid.pc))]


def evaluate(model, X, y, batch_size: int | None = 4096):
    """Mean cross-entropy ``loss`` and ``accuracy`` on ``(X, y)``."""
    model._require_bound()
    X = model._as_inputs(X)
    y = as_labels(y, X.shape[0], model.n_classes, lazy=hasattr(X, "tag"))
    model._require(X.shape[1])
    totals = np.zeros(2)
    for Xb, yb in model._batches(X, y, batch_size):
        futs, keys = _forward_batch(model, Xb, yb)
        totals += np.sum(model._store.gather(futs[len(keys):]), axis=0)
    return {"loss": totals[0] / len(y), "accuracy": totals[1] / len(y)}


def gradients(model, X, y):
    """Loss, accuracy and gradients ``[(dW, db), ...]`` of the mean loss over all of ``X``.

    Computed on the grid exactly as a training step does, without the update.
    """
    model._require_bound()
    X = model._as_inputs(X)
    y = as_labels(y, X.shape[0], model.n_classes, lazy=hasattr(X, "tag"))
    model._require(X.shape[1])
    model._check_batch(X.shape[0], X.shape[0])
    step = model._next_step()
    g = StepGraph()
    n = X.shape[0]
    x_keys, y_keys, data = model._place_batch(X[0:n], y[0:n], step, g)
    g, names, stats = model.engine.gradient(x_keys, y_keys, X.shape[0], model._w, step, g=g)
    keys = [(n, i, j) for n in names for i, j in model.binding.grid.cells()]
    futs = model._submit(g, f"grad-{model.uid}-s{step}", keys + stats)
    blocks = dict(zip(keys, model._fetch(keys, futs[: len(keys)])))
    loss_sum, correct = np.sum(model._store.gather(futs[len(keys):]), axis=0)
    grads = [model._assemble(lay, name, blocks) for lay, name in zip(model.engine.param_layouts, names)]
    return loss_sum / len(y), correct / len(y), grads
