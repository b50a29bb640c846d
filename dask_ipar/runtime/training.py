"""One training step (:func:`submit_step`) and :func:`fit`, what
:meth:`dask_ipar.model.Sequential.fit` runs: the training loop
(:class:`dask_ipar.runtime.loop.TrainLoop`) with the callbacks its arguments ask for.
"""

from __future__ import annotations

from dask_ipar.errors import IparError
from dask_ipar.runtime.steps import check_optimizer, resolve_steps_per_program, submit_steps

__all__ = ["fit", "prepare", "submit_step"]



def submit_step(model, Xb, yb, optimizer, more: bool = False):
    """Submit one SGD step of ``model`` on a prepared batch; returns the loss-statistics
    futures (:func:`submit_steps` of one step; ``more``: another step follows, its
    ``ahead``)."""
    return submit_steps(model, [(Xb, yb, optimizer)], ahead=more)[0]


def prepare(model, X, y, batch_size):
    """Checked (and scaled) training data and the batch size a step of the model's grid
    takes: ``(X, y, batch)``; builds the engine on first use."""
    from dask_ipar.io.data import as_labels

    X = model._as_inputs(X)
    y = as_labels(y, X.shape[0], model.n_classes, lazy=hasattr(X, "tag"))
    model._require(X.shape[1])
    return X, y, model._check_batch(batch_size, X.shape[0])


#: Chunks per shuffle window of data the cells read from storage, unless fit says otherwise.
DEFAULT_WINDOW = 8


def _window(X, y, window):
    """The local shuffle of data read from storage (:class:`~dask_ipar.runtime.loop.
    BatchPlan` ``window``): its plan arguments, and the chunk cache of the cells' copies."""
    from dask_ipar.io.lazy import LazyInputs

    if not isinstance(X, LazyInputs) or window is False or window == 0:
        return {}
    import numpy as np

    chunk, bounds = X.data.chunk_rows, ()
    rows = X.data.rows
    if rows is not None and len(rows) > 1 and np.all(rows[1:] > rows[:-1]):
        # a sorted subset (a split): its positions in each stored chunk are contiguous
        first = np.flatnonzero(np.diff(rows // X.data.src.chunk_rows)) + 1
        bounds = tuple(int(b) for b in first)
    w = DEFAULT_WINDOW if window in (None, True) else int(window)
    if w < 1:
        raise IparError(f"shuffle_window must be a number of chunks >= 1 (or 0: the order "
                        f"as stored), got {window!r}.")
    w = min(w, len(bounds) + 1 if bounds else -(-X.shape[0] // chunk))
    X.window = w
    if hasattr(y, "window"):
        y.window = w
    return {"window": w, "chunk": chunk, "bounds": bounds}


def fit(model, X, y, *, epochs=1, batch_size=32, optimizer=None, shuffle=True, seed=None,
        progress=False, max_inflight=2, measure=True, machine=None, validation_data=None,
        standardize=False, callbacks=(), checkpoint=None, log_file=None,
        diverge_factor=2.0, shuffle_window=None, replicas=None, steps_per_program=1):
    """:meth:`dask_ipar.model.Sequential.fit` (its docstring says what each argument does)."""
    from dask_ipar.optim import SGD
    from dask_ipar.runtime import callbacks as cbs
    from dask_ipar.runtime.loop import BatchPlan, TrainLoop

    optimizer = optimizer or SGD()
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise IparError(f"epochs must be a positive integer, got {epochs!r}.")
    model._require_bound()
    if checkpoint is None:  # a checkpoint to resume from replaces the state: it checks
        check_optimizer(model, optimizer)
    if standardize and model.scaling is None:
        from dask_ipar.io.scaling import Standardizer

        raw = model._as_inputs(X, scaled=False)
        model.scaling = Standardizer.fit(raw, client=model.client)
    X, y, batch = prepare(model, X, y, batch_size)
    plan = BatchPlan(X.shape[0], batch, model.seed if seed is None else seed, shuffle,
                     **_window(X, y, shuffle and shuffle_window))
    pre = []
    rep = None
    if replicas:  # before the checkpoints: a recovery from replicas loses fewer steps
        from dask_ipar.runtime.replicas import Replicas

        rep = replicas if isinstance(replicas, Replicas) else Replicas(replicas)
        pre.append(rep)
    if checkpoint is not None:
        pre.append(checkpoint)  # resuming sets the step the others start from
    post = []
    meter = None
    if measure:  # before validation: the epoch's training traffic is drained first
        from dask_ipar.runtime.meter import CommMeter

        meter = CommMeter(model.client, model.binding, model.engine, model.dtype.itemsize,
                          machine, grad_clip=getattr(optimizer, "clip_norm", None) is not None,
                          inputs=X if hasattr(X, "tag") else None,
                          labels=y if hasattr(y, "tag") else None)
        post.append(cbs.Meter(meter))
        if rep is not None:
            rep.meter = meter
    if validation_data is not None:
        try:
            Xv, yv = validation_data
        except (TypeError, ValueError):
            raise IparError("validation_data must be a pair (X_val, y_val).") from None
        post.append(cbs.Validation(Xv, yv, meter=meter))  # evaluate() checks and scales it
    post.extend(callbacks)  # the user's see the validation figures in the epoch record
    if log_file is not None:
        post.append(cbs.MetricsLog(log_file))
    from dask_ipar.dashboard.feed import DashboardFeed, install_dashboard

    if install_dashboard(model.client):  # the /ipar page: after the validation figures
        post.append(DashboardFeed(meter, machine))
    if progress is True:
        post.append(cbs.ProgressBar())
    elif callable(progress):
        post.append(cbs.OnStep(progress))
    for data in (X, y):
        if hasattr(data, "until"):  # read by the cells: no block prefetched past the end
            data.until = epochs * plan.steps_per_epoch
    steps_per_program = resolve_steps_per_program(model, plan.batch, optimizer,
                                                  steps_per_program, machine)
    loop = TrainLoop(model, X, y, plan, optimizer, total_steps=epochs * plan.steps_per_epoch,
                     callbacks=pre + post, max_inflight=max_inflight,
                     diverge_factor=diverge_factor, steps_per_program=steps_per_program)
    return loop.run()
