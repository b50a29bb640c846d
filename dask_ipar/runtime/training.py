"""One training step (:func:`submit_step`) and :func:`fit`, what
:meth:`dask_ipar.model.Sequential.fit` runs: the training loop
(:class:`dask_ipar.runtime.loop.TrainLoop`) with the callbacks its arguments ask for.
"""

from __future__ import annotations

from dask_ipar.errors import IparError
from dask_ipar.nn.graph import StepGraph

__all__ = ["fit", "prepare", "submit_step", "check_optimizer"]



def _state_kind(optimizer) -> str:
    return "adam" if optimizer.name in ("adam", "adamw") else "sgd"


def check_optimizer(model, optimizer):
    """Refuse to train with an optimizer whose state is not the one the model holds."""
    from dask_ipar.optim import SGD, Adam

    if not isinstance(optimizer, (SGD, Adam)):
        raise IparError(f"optimizer must be dask_ipar.SGD, Adam or AdamW, got {optimizer!r}.")
    held, _ = model._store.opt
    if held is not None and held != _state_kind(optimizer):
        what = {"sgd": "SGD momentum", "adam": "Adam moments"}
        raise IparError(
            f"the model holds {what[held]} from its earlier training; {type(optimizer).__name__} "
            f"needs {what[_state_kind(optimizer)]}. Train on with the same kind of optimizer, "
            "or start its state afresh with model.set_weights(model.get_weights())."
        )


def submit_step(model, Xb, yb, optimizer):
    """Submit one SGD step of ``model`` on a prepared batch; returns the loss-statistics
    futures. Every ``model.lineage_steps`` steps the state's task history is cut first
    (:meth:`dask_ipar.runtime.state.BlockStore.cut_lineage`)."""
    check_optimizer(model, optimizer)
    if model.lineage_steps is not None and model._since_cut >= model.lineage_steps:
        model._since_cut = 0
        model._store.cut_lineage(model._step)
    model._since_cut += 1
    step = model._next_step()
    g = StepGraph()
    x_keys, y_keys, data = model._place_batch(Xb, yb, step, g)
    store = model._store
    kind, t = store.opt
    g, new_w, new_v, stats = model.engine.train_step(
        x_keys, y_keys, Xb.shape[0], model._w, model._v, step, optimizer.lr,
        getattr(optimizer, "momentum", 0.0), optimizer.weight_decay, g=g,
        optimizer=optimizer, t=t + 1,
    )
    store.opt = (_state_kind(optimizer), t + 1)
    # momentum blocks updated in place keep their names (and futures)
    fresh = [n for n in new_w + new_v if n not in model._v]
    keys = [(n, i, j) for n in fresh for i, j in model.binding.grid.cells()]
    futs = model._submit(g, f"step-{model.uid}-s{step}", keys + stats, step=step,
                        first=stats)
    store.keep(keys, futs[: len(keys)])
    store.release([n for n in store.w + store.v if n not in new_v])
    store.w, store.v = new_w, new_v
    del data  # the graph holds the batch now
    return futs[len(keys):]


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
        diverge_factor=2.0, shuffle_window=None, replicas=None):
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
    loop = TrainLoop(model, X, y, plan, optimizer, total_steps=epochs * plan.steps_per_epoch,
                     callbacks=pre + post, max_inflight=max_inflight,
                     diverge_factor=diverge_factor)
    return loop.run()
