"""Callbacks of the training loop (:class:`dask_ipar.runtime.loop.TrainLoop`): the progress
bar, validation, early stopping, the metrics log, the byte meter and a per-step function.
The checkpointing callback is :class:`dask_ipar.io.checkpoint.Checkpointing`.
"""

from __future__ import annotations

import csv
import json
import math
import os

from dask_ipar.errors import IparError
from dask_ipar.runtime.loop import Callback

__all__ = ["ProgressBar", "Validation", "EarlyStopping", "MetricsLog", "Meter", "OnStep"]


class ProgressBar(Callback):
    """A tqdm bar on stderr: one tick per step, with the epoch's running loss, accuracy,
    samples/s and learning rate, and the last validation figures."""

    def __init__(self):
        self.bar = None
        self._val = {}

    def on_train_begin(self, loop):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # pragma: no cover - tqdm comes with the package
            return
        self.bar = tqdm(total=loop.total_steps, initial=loop.step, unit="step",
                        dynamic_ncols=True, leave=True)

    def on_step_end(self, loop, stats):
        if self.bar is None:
            return
        run = loop.epoch_running
        post = {"epoch": stats.epoch + 1, "loss": f"{run['loss']:.4f}",
                "acc": f"{run['accuracy']:.3f}", "samples_s": f"{run['samples_per_s']:.0f}",
                "lr": f"{stats.lr:.3g}", **self._val}
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def on_epoch_end(self, loop, record):
        if "val_loss" in record:
            self._val = {"val_loss": f"{record['val_loss']:.4f}",
                         "val_acc": f"{record['val_accuracy']:.3f}"}

    def on_train_end(self, loop):
        self.close()

    def on_interrupt(self, loop, step):
        self.close()

    def on_train_abort(self, loop, exc):
        self.close()

    def on_rewind(self, loop, step):
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Validation(Callback):
    """Loss and accuracy on ``(X, y)`` at each epoch's end, as ``val_loss`` and
    ``val_accuracy`` in the epoch's record (computed on the grid, no update). With a
    ``meter`` (a :class:`~dask_ipar.runtime.meter.CommMeter`) the validation's transfers
    are drained unrecorded: the meter compares training steps with the cost model."""

    def __init__(self, X, y, batch_size: int | None = 4096, meter=None):
        self.X, self.y, self.batch_size, self.meter = X, y, batch_size, meter

    def on_epoch_end(self, loop, record):
        r = loop.model.evaluate(self.X, self.y, batch_size=self.batch_size)
        record["val_loss"], record["val_accuracy"] = r["loss"], r["accuracy"]
        if self.meter is not None:
            self.meter.drain(record=False)


class EarlyStopping(Callback):
    """Stop when ``monitor`` (an epoch record key, default ``val_loss``; lower is better
    unless it names an accuracy) has not improved by more than ``min_delta`` for
    ``patience`` epochs. With ``restore_best`` the weights of the best epoch are put back
    at the end (a copy is held on the client). Give it after :class:`Validation`."""

    def __init__(self, patience: int = 5, *, monitor: str = "val_loss", min_delta: float = 0.0,
                 restore_best: bool = True):
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise IparError(f"patience must be a positive integer, got {patience!r}.")
        self.patience, self.monitor = patience, monitor
        self.min_delta, self.restore_best = float(min_delta), restore_best
        self.sign = -1.0 if "acc" in monitor else 1.0
        self.best = math.inf
        self.best_epoch = None
        self.wait = 0
        self._weights = None
        self._seen: list = []  # (epoch, signed value) of every epoch so far

    def on_rewind(self, loop, step):
        """Forget the epochs after ``step``; they run again and give the same figures (a
        replayed best epoch is captured again)."""
        kept = {e["epoch"] for e in loop.history.epochs}
        self._seen = [(e, v) for e, v in self._seen if e in kept]
        best_epoch = self.best_epoch
        self.best, self.best_epoch, self.wait = math.inf, None, 0
        for e, v in self._seen:
            if v < self.best - self.min_delta:
                self.best, self.best_epoch, self.wait = v, e, 0
            else:
                self.wait += 1
        if self.best_epoch != best_epoch:
            self._weights = None

    def on_epoch_end(self, loop, record):
        if self.monitor not in record:
            raise IparError(
                f"early stopping watches {self.monitor!r}, which the epoch record lacks "
                f"(it has {', '.join(sorted(record))}); give validation data (validation_data=, "
                "--val-fraction) or monitor 'loss'.")
        value = self.sign * record[self.monitor]
        self._seen.append((record["epoch"], value))
        if value < self.best - self.min_delta:
            self.best, self.best_epoch, self.wait = value, record["epoch"], 0
            if self.restore_best:
                self._weights = loop.model.get_weights()
        else:
            self.wait += 1
            if self.wait >= self.patience:
                loop.stop(f"early stopping: {self.monitor} did not improve for "
                          f"{self.patience} epochs (best {self.sign * self.best:.4f} at epoch "
                          f"{self.best_epoch})")

    def on_train_end(self, loop):
        if self.restore_best and self._weights is not None and loop.history.stopped:
            loop.model.set_weights(self._weights)
            loop.history.stopped += f"; restored the weights of epoch {self.best_epoch}"


class MetricsLog(Callback):
    """One row per epoch in ``path``: CSV (``.csv``) or JSON lines (anything else). The
    file is rewritten at the start of a run and flushed at every epoch, so a run that
    stops early leaves the epochs it finished."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self.kind = "csv" if self.path.lower().endswith(".csv") else "jsonl"
        self._fh = None
        self._writer = None

    def on_train_begin(self, loop):
        try:
            self._fh = open(self.path, "w", encoding="utf-8", newline="")
        except OSError as exc:
            raise IparError(f"cannot write the metrics log {self.path!r}: {exc.strerror}.") from None

    def on_rewind(self, loop, step):
        """Rewrite the file with the epochs kept (the others run again)."""
        if self._fh is None:
            return
        self._fh.seek(0)
        self._fh.truncate()
        self._writer = None
        for record in loop.history.epochs:
            self._write(record)

    def on_train_abort(self, loop, exc):
        self.on_train_end(loop)

    def on_epoch_end(self, loop, record):
        self._write(record)

    def _write(self, record):
        row = {k: (float(v) if isinstance(v, float) else v) for k, v in record.items()}
        if self.kind == "csv":
            if self._writer is None:
                self._writer = csv.DictWriter(self._fh, fieldnames=list(row),
                                              extrasaction="ignore")
                self._writer.writeheader()
            self._writer.writerow(row)
        else:
            self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def on_train_end(self, loop):
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    on_interrupt = lambda self, loop, step: self.on_train_end(loop)  # noqa: E731


class Meter(Callback):
    """Feeds a :class:`~dask_ipar.runtime.meter.CommMeter`: each step's predicted bytes,
    the workers' transfer logs drained every 32 steps and at each epoch's end (once
    where both fall on one step, at the epoch's end, when every program has finished: a
    drain is a round trip to every worker while the programs idle); the
    predicted-vs-measured table goes to ``history.comm`` at the end."""

    def __init__(self, meter):
        self.meter = meter

    def on_step_end(self, loop, stats):
        self.meter.add_step(stats.batch)
        if stats.step % 32 == 0 and not loop.ends_epoch(stats.step):
            self.meter.drain()

    def on_epoch_end(self, loop, record):
        self.meter.drain()

    def on_rewind(self, loop, step):
        if loop.model.binding is not None:
            self.meter.rebind(loop.model.binding, loop.model.engine)

    def on_train_end(self, loop):
        loop.history.comm = self.meter.report()

    on_interrupt = lambda self, loop, step: self.on_train_end(loop)  # noqa: E731


class OnStep(Callback):
    """Calls ``fn(stats)`` (a :class:`~dask_ipar.runtime.loop.StepStats`) after each step."""

    def __init__(self, fn):
        self.fn = fn

    def on_step_end(self, loop, stats):
        self.fn(stats)
