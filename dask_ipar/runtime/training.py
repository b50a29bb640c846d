"""The minibatch training loop of :meth:`dask_ipar.model.Sequential.fit`: steps submitted
ahead of the one waited for, per-step statistics, progress, the byte meter, and the
per-epoch record.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dask_ipar.errors import IparError
from dask_ipar.nn.graph import StepGraph

__all__ = ["StepStats", "History", "run_epochs", "submit_step"]



@dataclass
class StepStats:
    """What one training step reports: its batch, loss and the time it completed."""

    step: int
    batch: int
    loss: float
    accuracy: float
    done_s: float



@dataclass
class History:
    """Per-epoch training record returned by :meth:`Sequential.fit`."""

    epochs: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    #: Predicted beside measured communication (:class:`~dask_ipar.runtime.meter.CommReport`),
    #: when ``fit(measure=True)``.
    comm: object = None

    @property
    def last(self) -> dict:
        return self.epochs[-1] if self.epochs else {}



def _make_bar(progress, total):
    if progress is not True:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with the train extra
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)



def submit_step(model, Xb, yb, optimizer):
    """Submit one SGD step of ``model`` on a prepared batch; returns the loss-statistics
    futures. Every ``model.lineage_steps`` steps the state's task history is cut first
    (:meth:`dask_ipar.runtime.state.BlockStore.cut_lineage`)."""
    if model.lineage_steps is not None and model._since_cut >= model.lineage_steps:
        model._since_cut = 0
        model._store.cut_lineage(model._step)
    model._since_cut += 1
    step = model._next_step()
    g = StepGraph()
    x_keys, y_keys, data = model._place_batch(Xb, yb, step, g)
    g, new_w, new_v, stats = model.engine.train_step(
        x_keys, y_keys, Xb.shape[0], model._w, model._v, step,
        optimizer.lr, optimizer.momentum, optimizer.weight_decay, g=g,
    )
    # momentum blocks updated in place keep their names (and futures)
    fresh = [n for n in new_w + new_v if n not in model._v]
    keys = [(n, i, j) for n in fresh for i, j in model.binding.grid.cells()]
    futs = model._submit(g, f"step-{model.uid}-s{step}", keys + stats, step=step,
                        first=stats)
    store = model._store
    store.keep(keys, futs[: len(keys)])
    store.release([n for n in store.w + store.v if n not in new_v])
    store.w, store.v = new_w, new_v
    del data  # the graph holds the batch now
    return futs[len(keys):]


def run_epochs(model, X, y, *, epochs, batch, optimizer, shuffle, rng, progress, max_inflight,
               meter) -> History:
    """Train ``model`` (distributed, checked inputs) for ``epochs`` over ``(X, y)``.

    Batches with fewer samples than the grid takes are skipped; each epoch ends when its
    last step's update has, and ``meter`` (a :class:`~dask_ipar.runtime.meter.CommMeter`
    or None) is drained every 32 steps and at each epoch's end.
    """
    n = X.shape[0]
    least = model._min_samples()
    history = History()
    bar = _make_bar(progress, epochs * (n // batch + (n % batch >= least)))
    callback = progress if callable(progress) else None
    try:
        for epoch in range(epochs):
            t0 = time.perf_counter()
            order = rng.permutation(n) if shuffle else np.arange(n)
            pending: deque = deque()
            totals = np.zeros(3)
            for start in range(0, n, batch):
                idx = order[start:start + batch]
                if len(idx) < least:
                    continue
                stats = model.train_step(X[idx], y[idx], optimizer)
                pending.append((model._step, len(idx), stats))
                while len(pending) > max_inflight:
                    _finish(model, pending.popleft(), totals, history, bar, callback, t0, meter)
            while pending:
                _finish(model, pending.popleft(), totals, history, bar, callback, t0, meter)
            secs = time.perf_counter() - t0
            # The loss statistics arrive after the forward pass: wait for the last
            # step's update too, so an epoch (and fit) ends when training has.
            from distributed import wait

            wait(model._store.state(model._w + model._v))
            if meter is not None:
                meter.drain()
            history.epochs.append({
                "epoch": epoch + 1,
                "loss": totals[0] / totals[2],
                "accuracy": totals[1] / totals[2],
                "seconds": secs,
                "samples_per_s": totals[2] / secs,
            })
    finally:
        if bar is not None:
            bar.close()
    if meter is not None:
        history.comm = meter.report()
    return history


def _finish(model, item, totals, history, bar, callback, t0, meter):
    step, nb, futs = item
    loss_sum, correct = np.sum(model._store.gather_step(futs, step), axis=0)
    if not np.isfinite(loss_sum):
        raise IparError(
            f"training diverged at step {step}: the loss is {loss_sum}. "
            "Lower the learning rate or standardize the inputs."
        )
    totals += (loss_sum, correct, nb)
    if meter is not None:
        meter.add_step(nb)
        if step % 32 == 0:  # the logs hold far more; fit drains them at each epoch end
            meter.drain()
    st = StepStats(step, nb, loss_sum / nb, correct / nb, time.perf_counter())
    history.steps.append(st)
    if bar is not None:
        el = time.perf_counter() - t0
        bar.set_postfix(loss=f"{totals[0] / totals[2]:.4f}",
                        acc=f"{totals[1] / totals[2]:.3f}",
                        samples_s=f"{totals[2] / max(el, 1e-9):.0f}", refresh=False)
        bar.update(1)
    if callback is not None:
        callback(st)
