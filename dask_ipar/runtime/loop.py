"""The one training loop: :meth:`Sequential.fit`, :func:`dask_ipar.io.checkpoint.
train_with_checkpoints` and ``dask-ipar train`` all run :class:`TrainLoop`.

What a run does beyond stepping comes from callbacks (:mod:`dask_ipar.runtime.callbacks`
and the checkpointing one, :class:`dask_ipar.io.checkpoint.Checkpointing`): progress,
validation, early stopping, the metrics log, the byte meter, checkpoints and recovery
from a lost worker. The loop itself owns three things only:

- **Which samples step ``s`` trains on**: :class:`BatchPlan`, a pure function of
  ``(n, batch, seed, s)``, whatever the grid. Epoch ``e`` shuffles the samples with
  ``default_rng([seed, e])`` and cuts them into ``n // batch`` batches in order; the
  ``n % batch`` samples left over join the epoch's last batch (so every sample is seen
  once per epoch and no batch is too small for any grid). A run resumed at step ``k``,
  on this grid or another, therefore sees the batches an uninterrupted run does, with or
  without checkpoints.
- **The learning rate of step ``s``**: the optimizer's schedule
  (:mod:`dask_ipar.optim`), also a pure function of ``s``.
- **When the state may be read**: steps are submitted ``max_inflight`` submissions ahead
  of the one waited for, ``steps_per_program`` consecutive steps per submission (one
  graph, one program per worker: :func:`dask_ipar.runtime.steps.submit_steps`); a
  submission ends at every step a callback reads the weights after (a checkpoint, a
  replica refresh: :meth:`Callback.wants_sync`, asked ahead, so a pure function of the
  step) and at every epoch's end, and there the loop waits for every submitted step.

A stop requested with :meth:`TrainLoop.request_stop` (what the CLI's SIGINT/SIGTERM
handlers do) ends the run after the step in flight: the loop waits for it, gives the
callbacks :meth:`Callback.on_interrupt` (a checkpoint is written there) and raises
:class:`Interrupted`.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from dask_ipar.errors import IparError
from dask_ipar.runtime.steps import (auto_steps_per_program, check_steps_per_program,
                                     gather_losses, submit_steps)

_log = logging.getLogger("dask_ipar")

__all__ = ["BatchPlan", "Callback", "History", "Interrupted", "StepStats", "TrainLoop",
           "Diverged"]


@dataclass
class StepStats:
    """What one training step reports: its batch, loss and the time it completed."""

    step: int
    batch: int
    loss: float
    accuracy: float
    done_s: float
    lr: float = float("nan")
    epoch: int = 0


@dataclass
class History:
    """Per-epoch training record returned by :meth:`Sequential.fit`.

    ``epochs`` holds one dict per epoch: ``epoch``, ``loss``, ``accuracy`` (over the
    epoch's training batches), ``lr`` (of its last step), ``seconds``, ``samples_per_s``,
    ``steps`` and, with validation data, ``val_loss`` and ``val_accuracy``.
    """

    epochs: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    #: Predicted beside measured communication (:class:`~dask_ipar.runtime.meter.CommReport`),
    #: when ``fit(measure=True)``.
    comm: object = None
    #: Why training ended before its last epoch (early stopping), else None.
    stopped: str | None = None
    #: The run's id on the dashboard's ``/ipar`` page (:mod:`dask_ipar.dashboard`), if fed.
    dashboard_uid: str | None = None

    @property
    def last(self) -> dict:
        return self.epochs[-1] if self.epochs else {}


class Diverged(IparError):
    """Training stopped: the loss became non-finite or rose far above its start."""


class Interrupted(Exception):
    """The run stopped after step ``step`` because :meth:`TrainLoop.request_stop` was
    called (by a signal handler: ``signum``). The state of that step is intact, and
    saved when the run checkpoints, unless ``saved`` is False (the cluster failed while
    stopping: the last checkpoint written before is what there is)."""

    def __init__(self, step: int, reason: str, signum: int | None = None, saved: bool = True):
        self.step, self.reason, self.signum, self.saved = step, reason, signum, saved
        super().__init__(f"stopped after step {step}: {reason}")


@dataclass(frozen=True)
class BatchPlan:
    """The samples of every training step: a pure function of the step (see the module).

    ``n // batch`` steps per epoch, the last one taking the ``n % batch`` samples left
    over as well; ``shuffle=False`` keeps the sample order in every epoch.

    ``window`` (chunks, for data read from storage in chunks of ``chunk`` samples) makes
    the shuffle local: each epoch permutes the chunks, groups them ``window`` at a time in
    that order, and permutes the samples within each group. A batch then draws from
    ``window`` chunks (about ``window * chunk`` samples) instead of the whole data set, so
    the cells read each chunk once per epoch; ``window`` = number of chunks is a full
    shuffle again. 0: full shuffle.
    """

    n: int
    batch: int
    seed: int = 0
    shuffle: bool = True
    window: int = 0
    chunk: int = 0
    #: start of every chunk but the first, in samples (chunks of uneven size, such as a
    #: split's share of each stored chunk); empty: every ``chunk`` samples
    bounds: tuple = ()

    def __post_init__(self):
        if self.batch < 1:
            raise IparError(f"batch size must be >= 1, got {self.batch}.")
        if self.batch > self.n:
            raise IparError(f"batch size {self.batch} exceeds the {self.n} samples.")
        if self.window < 0 or (self.window and self.chunk < 1 and not self.bounds):
            raise IparError(f"shuffle window must be >= 0 chunks (of >= 1 samples), got "
                            f"{self.window} chunks of {self.chunk}.")

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.batch

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of ``epoch`` (0-based)."""
        if not self.shuffle:
            return np.arange(self.n)
        rng = np.random.default_rng([self.seed, epoch])
        if not self.window:
            return rng.permutation(self.n)
        if self.bounds:
            edges = np.array((0,) + tuple(self.bounds) + (self.n,))
        else:
            edges = np.append(np.arange(0, self.n, self.chunk), self.n)
        ids = rng.permutation(len(edges) - 1)
        out = []
        for w in range(0, len(ids), self.window):
            group = np.concatenate([np.arange(edges[c], edges[c + 1])
                                    for c in ids[w:w + self.window]])
            out.append(rng.permutation(group))
        return np.concatenate(out)

    def span(self, step: int) -> tuple[int, int]:
        """``(start, stop)`` of training step ``step``'s batch in its epoch's order (the
        epoch's last batch takes the leftover samples too)."""
        k = step % self.steps_per_epoch
        stop = self.n if k == self.steps_per_epoch - 1 else (k + 1) * self.batch
        return k * self.batch, stop

    def indices(self, step: int) -> np.ndarray:
        """Sample indices of training step ``step`` (0-based)."""
        start, stop = self.span(step)
        return self.order(step // self.steps_per_epoch)[start:stop]


class Callback:
    """Hooks of :class:`TrainLoop`; every method is optional. ``loop.history`` and
    ``loop.step`` (steps done) are there to read; ``loop.stop(reason)`` ends the run at
    the end of the current epoch (early stopping)."""

    def on_train_begin(self, loop): ...

    def on_step_end(self, loop, stats: StepStats): ...

    def wants_sync(self, loop, step: int) -> bool:
        """Whether the callback reads the state right after step ``step`` (1-based) was
        submitted; the loop then waits for every step and calls :meth:`on_sync`. Asked
        before the steps up to ``step`` are submitted: a function of ``step`` alone."""
        return False

    def on_sync(self, loop, step: int): ...

    def on_epoch_end(self, loop, record: dict): ...

    def on_interrupt(self, loop, step: int): ...

    def on_rewind(self, loop, step: int):
        """The run goes back to step ``step`` (a checkpoint, after a worker fault): the
        epochs after it are gone from ``loop.history`` and will be run again."""

    def on_train_abort(self, loop, exc: BaseException):
        """The run ends with ``exc`` (close what :meth:`on_train_begin` opened)."""

    def on_error(self, loop, exc: BaseException) -> int | None:
        """A step or callback failed with ``exc``: return the step to go on from (after
        restoring the state of that step), or None to let the error end the run."""
        return None

    def on_preempt(self, loop, step: int, workers: dict) -> bool | None:
        """Grid workers ``workers`` (``{address: why}``) are about to leave (a batch system's
        SIGTERM: :mod:`dask_ipar.runtime.preempt`); every step up to ``step`` is done.
        Make the state of ``step`` recoverable now; return True if this callback did."""
        return None

    def on_train_end(self, loop): ...


class TrainLoop:
    """Run ``total_steps`` steps of ``optimizer`` on ``(X, y)`` (checked arrays), from
    ``start_step`` (0 for a fresh run). See the module for what it guarantees.

    A non-finite loss always stops the run (:class:`Diverged`). With ``diverge_factor``
    (0 turns these off) so does a step's loss above ``diverge_factor`` times the first
    step's (and above 3 ln(classes)), and a fresh run's first epoch of 8 steps or more
    whose mean loss is no better than chance (ln(classes)) after a first step's loss
    above 3 ln(classes): the signature of inputs far from unit scale.
    """

    def __init__(self, model, X, y, plan: BatchPlan, optimizer, *, total_steps: int,
                 start_step: int = 0, callbacks=(), max_inflight: int = 2,
                 diverge_factor: float = 2.0, steps_per_program: int = 1):
        if not isinstance(max_inflight, int) or max_inflight < 0:
            raise IparError(f"max_inflight must be an integer >= 0, got {max_inflight!r}.")
        self.steps_per_program = check_steps_per_program(steps_per_program)
        if self.steps_per_program == "auto":
            self.steps_per_program = auto_steps_per_program(model, plan.batch, optimizer)
        self.model, self.X, self.y, self.plan = model, X, y, plan
        self._gang = None  # the run's lock on its grid workers (:meth:`run`)
        self._preempt = None  # notices of grid workers about to leave (:meth:`run`)
        self.optimizer = optimizer
        self.total_steps, self.step = total_steps, start_step
        self.start_step = start_step
        self.callbacks = list(callbacks)
        self.max_inflight = max_inflight
        self.diverge_factor = diverge_factor
        self.history = History()
        self._stop_request: tuple[str, int | None] | None = None
        self._stop_at_epoch: str | None = None
        self._first_loss: float | None = None
        self._pending: deque = deque()
        self._sizes: deque = deque()  # steps of each submission in _pending, oldest first
        self._submitted = start_step
        self._epoch_totals = np.zeros(3)
        self._epoch_t0 = time.perf_counter()

    # ------------------------------------------------------------ control
    def request_stop(self, reason: str, signum: int | None = None) -> None:
        """Stop after the step in flight (safe to call from a signal handler)."""
        self._stop_request = (reason, signum)

    def stop(self, reason: str) -> None:
        """End the run at the end of the current epoch (early stopping)."""
        self._stop_at_epoch = reason

    def _each(self, hook, *args):
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    # ---------------------------------------------------------------- run
    def run(self) -> History:
        import uuid

        from dask_ipar.runtime.gang import GangLock
        from dask_ipar.runtime.preempt import PreemptWatch

        self._gang = GangLock(self.model.client, self.model.binding.workers,
                              f"model {self.model.uid}", log=_log.warning)
        self._preempt = PreemptWatch(self.model.client, self.model.binding.workers,
                                     f"{self.model.uid}-{uuid.uuid4().hex[:8]}")
        try:
            self._gang.acquire()  # one run at a time on these workers (dask-ipar.gang)
            self._preempt.start()
            return self._run()
        except BaseException as exc:
            for cb in self.callbacks:
                try:
                    cb.on_train_abort(self, exc)
                except Exception:  # noqa: S110 - the run's own error is the one to see
                    pass
            raise
        finally:
            self._preempt.close()
            if self._gang is not None:
                self._gang.release()

    def _run(self) -> History:
        self._each("on_train_begin")
        while True:
            try:
                self._steps()
                break
            except Interrupted:
                raise
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, Diverged)):
                    raise
                if self._stop_request is not None:  # e.g. the workers got the signal too
                    reason, signum = self._stop_request
                    raise Interrupted(self.step, f"{reason} ({type(exc).__name__} while "
                                      "stopping)", signum, saved=False) from exc
                again = None
                for cb in self.callbacks:
                    again = cb.on_error(self, exc)
                    if again is not None:
                        break
                if again is None:
                    raise
                self._rewind(int(again))
        self._each("on_train_end")
        return self.history

    def _rewind(self, step: int):
        """Go on from ``step`` (its state restored by the callback that handled a fault, or
        loaded to resume): the records after it are dropped, the current epoch's running
        totals rebuilt from the steps kept, and the callbacks told (:meth:`Callback.
        on_rewind`)."""
        self._pending.clear()
        self._sizes.clear()
        h = self.history
        h.steps = [s for s in h.steps if s.step <= step]
        h.epochs = [e for e in h.epochs if e["steps"] <= step]
        self.step = self._submitted = step
        epoch = step // self.plan.steps_per_epoch
        self._epoch_totals = np.zeros(3)
        for s in h.steps:
            if s.epoch == epoch:
                self._epoch_totals += (s.loss * s.batch, s.accuracy * s.batch, s.batch)
        self._epoch_t0 = time.perf_counter()
        self._stop_at_epoch = None
        h.stopped = None
        if self._gang is not None:  # recovered on other workers: hold those
            self._gang.rebind(self.model.binding.workers)
        if self._preempt is not None:
            self._preempt.rebind(self.model.binding.workers)
        for cb in self.callbacks:
            cb.on_rewind(self, step)

    def _steps(self):
        spe = self.plan.steps_per_epoch
        while self._submitted < self.total_steps:
            leaving = self._preempt.pending() if self._preempt is not None else None
            if leaving:
                self._preempted(leaving)
            if self._stop_request is not None:
                self.drain()
                self._each("on_interrupt", self._submitted)
                reason, signum = self._stop_request
                raise Interrupted(self._submitted, reason, signum)
            first = self._submitted
            s = self._chunk_end(first)  # the submission's last step, 1-based
            batches = [(*self.batch(k), self.optimizer.at_step(k)) for k in range(first, s)]
            # the next submission reads the new weights where they were pushed ahead:
            # within the epoch (an epoch's end may stop the run) and the run
            more = s < self.total_steps and s % spe != 0
            for k, futs in enumerate(submit_steps(self.model, batches, ahead=more)):
                self._pending.append((first + k + 1, batches[k][0].shape[0], futs,
                                      batches[k][2].lr))
            self._sizes.append(len(batches))
            self._submitted = s
            if any(cb.wants_sync(self, s) for cb in self.callbacks):
                self.drain()
                self._each("on_sync", s)
            while len(self._sizes) > self.max_inflight:
                for _ in range(self._sizes.popleft()):
                    self._finish(self._pending.popleft())
            if self.ends_epoch(s):
                self._end_epoch((s - 1) // spe)
                if self._stop_at_epoch is not None:
                    self.history.stopped = self._stop_at_epoch
                    return

    def ends_epoch(self, step: int) -> bool:
        """Whether step ``step`` (1-based) ends an epoch (the run's last step does)."""
        return step % self.plan.steps_per_epoch == 0 or step == self.total_steps

    def _chunk_end(self, first: int) -> int:
        """The last step (1-based) of the submission starting after step ``first``: at most
        ``steps_per_program`` steps, ending at the epoch's end, the run's end and every
        step a callback reads the state after."""
        spe, end = self.plan.steps_per_epoch, first + 1
        while end - first < self.steps_per_program and end % spe and end < self.total_steps \
                and not any(cb.wants_sync(self, end) for cb in self.callbacks):
            end += 1
        return end

    def _preempted(self, leaving: dict):
        """Grid workers announced their leave: finish the steps in flight, let the
        callbacks save that step (:meth:`Callback.on_preempt`), let the workers go, then
        stop (``dask-ipar.preempt: stop``) or recover from the step saved (the default)."""
        from dask_ipar.io.checkpoint_faults import WorkerLost, _gone_soon

        self.drain()
        step = self._submitted
        saved = [cb for cb in self.callbacks if cb.on_preempt(self, step, leaving)]
        names = ", ".join(f"{w} ({why})" for w, why in leaving.items())
        self._preempt.ack(leaving, step)
        if not saved:
            _log.warning("grid worker(s) %s leaving at step %d; nothing saves this run's "
                         "state (no checkpoint directory, no replicas)", names, step)
        if self._preempt.mode == "stop":
            self.request_stop(f"grid worker(s) {', '.join(leaving)} got SIGTERM",
                              signal.SIGTERM)
            return
        gone = _gone_soon(self.model.client, list(leaving), self._preempt.grace_s + 10.0)
        if gone:
            raise WorkerLost(gone, f"training step {step + 1} (preempted: {names})")

    def batch(self, step: int):
        """Inputs and labels of training step ``step``: arrays, or for data the cells
        read themselves (:mod:`dask_ipar.io.lazy`) descriptions of their blocks."""
        X, y = self.X, self.y
        idx = None
        if hasattr(X, "batch"):
            Xb = X.batch(self.plan, step)
        else:
            idx = self.plan.indices(step)
            Xb = X[idx]
        if hasattr(y, "batch"):
            return Xb, y.batch(self.plan, step)
        return Xb, y[self.plan.indices(step) if idx is None else idx]

    def drain(self):
        """Wait for every submitted step (losses gathered, callbacks told) and its update."""
        while self._pending:
            self._finish(self._pending.popleft())
        self._sizes.clear()
        store = self.model._store  # a worker that died fails the wait within seconds
        store.wait_alive(store.state(store.w + store.v), self._submitted)

    def _finish(self, item):
        step, nb, futs, lr = item
        loss_sum, correct = np.sum(gather_losses(self.model._store, futs, step), axis=0)
        loss = loss_sum / nb
        if self._first_loss is None:
            self._first_loss = loss
        # chance level is ln(classes); a rise to twice the first step's loss (and well
        # above chance) is divergence, as is a non-finite loss
        limit = max(3 * math.log(max(self.model.n_classes, 2)),
                    self.diverge_factor * self._first_loss)
        if not math.isfinite(loss) or (self.diverge_factor and loss > limit):
            what = ("is " + str(loss)) if not math.isfinite(loss) else (
                f"rose to {loss:.4g}, over {self.diverge_factor:g}x its first step's "
                f"({self._first_loss:.4g})")
            raise Diverged(
                f"training diverged at step {step}: the loss {what} with learning rate "
                f"{lr:g}. Lower the learning rate, or standardize the inputs (features of "
                "very different scales need it)."
            )
        self.step = step
        self._epoch_totals += (loss_sum, correct, nb)
        st = StepStats(step, nb, loss, correct / nb, time.perf_counter(), lr,
                       (step - 1) // self.plan.steps_per_epoch)
        self.history.steps.append(st)
        self._each("on_step_end", st)

    def _end_epoch(self, epoch: int):
        self.drain()
        secs = time.perf_counter() - self._epoch_t0
        loss_sum, correct, n = self._epoch_totals
        record = {
            "epoch": epoch + 1,
            "loss": loss_sum / n if n else float("nan"),
            "accuracy": correct / n if n else float("nan"),
            "lr": self.history.steps[-1].lr if self.history.steps else float("nan"),
            "seconds": secs,
            "samples_per_s": n / secs if secs > 0 else float("nan"),
            "steps": self.step,
        }
        chance = math.log(max(self.model.n_classes, 2))
        if (self.diverge_factor and self.start_step == 0 and epoch == 0
                and self.step >= 8 and self._first_loss is not None
                and self._first_loss > 3 * chance and record["loss"] > 0.95 * chance):
            raise Diverged(
                f"training is not learning: the first epoch's mean loss is "
                f"{record['loss']:.4f}, no better than uniform guessing (ln "
                f"{self.model.n_classes} = {chance:.4f}), after a first step's loss of "
                f"{self._first_loss:.4g}, with learning "
                f"rate {record['lr']:g}. The inputs are far from unit scale: standardize them "
                "(drop --no-standardize, or fit(standardize=True)), or lower the learning rate.")
        self._each("on_epoch_end", record)
        self.history.epochs.append(record)
        self._epoch_totals = np.zeros(3)
        self._epoch_t0 = time.perf_counter()

    @property
    def epoch_running(self) -> dict:
        """Loss, accuracy and samples/s so far in the current epoch."""
        loss_sum, correct, n = self._epoch_totals
        el = max(time.perf_counter() - self._epoch_t0, 1e-9)
        return {"loss": loss_sum / max(n, 1), "accuracy": correct / max(n, 1),
                "samples_per_s": n / el}
