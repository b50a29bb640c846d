"""Checkpoints of the model and optimizer state in Zarr, written in parallel by the block owners.

Layout of a checkpoint directory ``<dir>/ckpt-<step>/`` (a Zarr v3 group)::

    zarr.json              group attributes: format, version, step, grid, dtype,
                           sizes, layers (name, n_in, n_out, bias, activation),
                           has_velocity, extra (user metadata, JSON), arrays (shape,
                           chunks, SHA-256 per chunk), checksum (of all the rest)
    dense0/w               float array n_out x (n_in + bias), the last column the bias
    dense0/v               its momentum (absent before the first step); with Adam
                           ``dense0/m`` and ``dense0/s``, the two moments
    dense1/w ...

(:mod:`dask_ipar.io.checkpoint_format` defines and validates the metadata.) Arrays are
chunked by the saving grid's blocks (the largest row block by the largest column block,
so chunks equal blocks when the sizes divide evenly). Every chunk is written by exactly
one worker: the owner of the block holding the chunk's first element; when blocks are
uneven, the few neighbouring rows or columns it needs are cut from the neighbour's block
on the neighbour and travel to it under a key of their own, released after the write.
Chunks are compressed (zstd) and carry a CRC32C checksum; the writer records a SHA-256
of each chunk's values, and every reader checks the chunks it decodes.

Writes are atomic. The blocks go into ``<dir>/ckpt-<step>.tmp-<uuid>/``; every file is
fsynced (chunk files by the worker that wrote them); the directory is renamed to
``ckpt-<step>``; then the ``LATEST`` pointer file is replaced (written beside, fsynced,
renamed). A crash at any moment leaves the previous checkpoints and ``LATEST`` intact;
:func:`latest` never returns a ``.tmp`` directory, and the next save removes such
leftovers. A file system that refuses a write raises :class:`CheckpointStorageError`
at once, naming the directory.

Loading works on any grid: each worker of the new grid reads its own block straight
from the arrays (:func:`load`), weights and momentum both, so a run saved on 2x2 goes
on, with the same results, on 4x1 or 1x1. Only numeric float arrays are read (no
pickle, object arrays are rejected). A checkpoint that does not verify (damaged or
missing chunks, edited metadata) raises :class:`CheckpointCorrupt`; with
``fallback=True`` the next older one is tried. Another model's checkpoint raises
:class:`~dask_ipar.errors.IparError`.

:class:`Checkpointing` is the training loop's callback that saves every N steps and, when
a worker dies (its blocks are lost), says so, re-binds the model to the live workers and
resumes from the last checkpoint: the final weights equal an uninterrupted run's.
:func:`train_with_checkpoints` runs the loop with it for a number of steps.

This module is the public API; the work is done in :mod:`.checkpoint_save` (writing),
:mod:`.checkpoint_load` (reading and verifying), :mod:`.checkpoint_tasks` (what runs on
the workers), :mod:`.checkpoint_dirs` (the directory: listing, publishing, cleaning up)
and :mod:`.checkpoint_faults` (:class:`WorkerLost` and waiting while watching the
workers). Here: the public names, :func:`recover` and the checkpointing callback.
"""

from __future__ import annotations

import os

import numpy as np

from dask_ipar.io.checkpoint_dirs import checkpoints, latest
from dask_ipar.io.checkpoint_faults import WorkerLost, _faults_as_worker_lost, as_worker_fault
from dask_ipar.io.checkpoint_format import FORMAT, VERSION, CheckpointCorrupt, CheckpointStorageError
from dask_ipar.io.checkpoint_load import load, read_metadata
from dask_ipar.io.checkpoint_save import save
from dask_ipar.runtime.workers import scheduler_gone, wait_for_workers
from dask_ipar.errors import IparError
from dask_ipar.runtime.loop import Callback

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointCorrupt",
    "CheckpointStorageError",
    "WorkerLost",
    "save",
    "load",
    "latest",
    "checkpoints",
    "read_metadata",
    "recover",
    "batch_indices",
    "Checkpointing",
    "train_with_checkpoints",
]


def recover(model, directory, *, grid=None, wait_timeout_s: float = 120.0, log=None) -> dict:
    """After a worker died: re-bind ``model`` to the live workers and load the last checkpoint.

    The model's blocks on the cluster are dropped (some are lost), the cluster is given
    up to ``wait_timeout_s`` to have ``Pr*Pc`` workers again (a nanny restarts a killed
    worker under a new address), the grid is bound afresh and the newest checkpoint
    that verifies is loaded (``load(..., fallback=True)``). Returns its metadata.
    """
    grid = model.grid if grid is None else grid
    client = model.client
    if grid is None or client is None:
        raise IparError("recover needs a model that was distributed before.")
    model.drop_state()
    try:
        wait_for_workers(client, grid.size, wait_timeout_s, log, revive=True)
    except IparError as exc:
        raise IparError(
            f"{exc} (after a worker fault; start workers, then resume from the last "
            "checkpoint with dask-ipar train --resume)"
        ) from None
    model.distribute(client, grid)  # binds by worker name, asking the scheduler directly
    return load(model, directory, fallback=True, log=log)


def batch_indices(n: int, batch_size: int, step: int, seed: int):
    """Sample indices of training step ``step`` (0-based): a pure function of its arguments,
    the batches every training run uses (:class:`dask_ipar.runtime.loop.BatchPlan`).

    Epoch ``e`` shuffles the samples with ``default_rng([seed, e])`` and the step takes
    the next ``batch_size`` of them; the epoch's last step also takes the ``n %
    batch_size`` left over.
    """
    from dask_ipar.runtime.loop import BatchPlan

    return BatchPlan(n, batch_size, seed).indices(step)


class Checkpointing(Callback):
    """The training loop's checkpoints (:class:`dask_ipar.runtime.loop.TrainLoop`).

    Saves every ``every`` steps, at the end, and at an interrupt; with ``resume`` it
    starts from :func:`latest` in ``directory`` (else from step 0, saved first as
    ``ckpt-0`` so that a fault before the first checkpoint is recoverable). When a grid
    worker dies, the step (or save) in flight fails; the callback says so through
    ``log``, calls :func:`recover` (re-bind to the live workers, load the newest
    checkpoint) and the loop replays the steps since that checkpoint, up to
    ``max_restarts`` times. ``settings`` (JSON) is stored in every checkpoint's
    ``extra``. Resuming a run on other data (another number of samples), with another
    batch size or seed (so other batches), or with another kind of optimizer than the
    checkpoint's state (SGD momentum, Adam moments) is refused, unless ``allow_changes``
    (then another optimizer kind keeps the weights and starts a fresh state).
    """

    def __init__(self, directory, *, every: int | None = None, resume: bool = True,
                 keep: int | None = 2, max_restarts: int = 3, wait_timeout_s: float = 120.0,
                 save_timeout_s: float | None = None, settings: dict | None = None, log=None,
                 allow_changes: bool = False):
        if every is not None and (not isinstance(every, int) or isinstance(every, bool)
                                  or every < 1):
            raise IparError(f"every must be an integer >= 1, got {every!r}.")
        self.directory = os.fspath(directory)
        self.every, self.resume, self.keep = every, resume, keep
        self.max_restarts, self.wait_timeout_s = max_restarts, wait_timeout_s
        self.save_timeout_s = save_timeout_s
        self.settings = dict(settings or {})
        self.say = log or (lambda msg: None)
        self.allow_changes = allow_changes
        self.restarts = 0
        self.start = 0
        self.last = None
        self._saved_step = None

    def on_train_begin(self, loop):
        model = loop.model
        self.grid = model.grid
        self.settings.setdefault("optimizer", loop.optimizer.settings())
        self.settings.setdefault("batch_size", loop.plan.batch)
        self.settings.setdefault("seed", loop.plan.seed)
        self.settings.setdefault("samples", loop.plan.n)
        # a local shuffle draws other batches than a full one (0: full or none)
        self.settings.setdefault("shuffle_window", [loop.plan.window, loop.plan.chunk]
                                 if loop.plan.window else 0)
        if self.resume and latest(self.directory) is not None:
            meta = load(model, self.directory, fallback=True, log=self.say)
            self._check_plan(meta, loop.plan)
            self.start = int(meta["step"])
            self.last = meta["path"]
            self.say(f"resumed from {self.last} (step {self.start})")
            self._check_state(model, loop.optimizer)
            loop._rewind(self.start)
            loop.start_step = self.start
            self._saved_step = self.start
            return
        found = checkpoints(self.directory)
        if found:
            raise IparError(
                f"{self.directory!r} already holds checkpoints (steps {found[0][0]} to "
                f"{found[-1][0]}) and resume is off. Resume from them (resume=True, "
                "--resume), or use an empty directory."
            )
        from dask_ipar.runtime.steps import check_optimizer

        check_optimizer(model, loop.optimizer)
        model.state_blocks()  # builds the initial weights
        self._save(loop, loop.step)

    def _check_plan(self, meta, plan):
        """The resumed run draws the batches the saved one did: same samples, batch, seed."""
        saved = meta.get("extra") or {}
        now = {"samples": plan.n, "batch_size": plan.batch, "seed": plan.seed,
               "shuffle_window": [plan.window, plan.chunk] if plan.window else 0}
        what = {"samples": "training samples", "batch_size": "batch size", "seed": "seed",
                "shuffle_window": "shuffle window (chunks, samples per chunk)"}
        changed = [f"{what[k]} {now[k]} (the checkpoint's run: {saved[k]})" for k in now
                   if saved.get(k) is not None and list(np.atleast_1d(saved[k])) !=
                   list(np.atleast_1d(now[k]))]
        if changed and not self.allow_changes:
            raise IparError(
                f"the run to resume from {meta['path']} drew other batches: "
                f"{'; '.join(changed)}. Resume with the same data, --val-fraction, --batch and "
                "--seed to continue it exactly, or allow the change (--resume-changed, "
                "Checkpointing(allow_changes=True)).")

    def _check_state(self, model, optimizer):
        from dask_ipar.runtime.steps import check_optimizer

        try:
            check_optimizer(model, optimizer)
        except IparError:
            held = {"sgd": "SGD momentum", "adam": "Adam moments"}[model._store.opt[0]]
            if not self.allow_changes:
                raise IparError(
                    f"the checkpoint {self.last} holds {held}, which "
                    f"{type(optimizer).__name__} cannot continue. Resume with the "
                    "checkpoint's optimizer, or allow a fresh optimizer state on the "
                    "checkpoint's weights (Checkpointing(allow_changes=True), "
                    "dask-ipar train --resume-changed).") from None
            model.set_weights(model.get_weights())
            self.say(f"the checkpoint holds {held}: {type(optimizer).__name__} starts with a "
                     "fresh state on its weights")

    def _save(self, loop, step):
        with _faults_as_worker_lost(loop.model, f"checkpoint of step {step}"):
            self.last = save(loop.model, self.directory, step=step, keep=self.keep,
                             extra=self.settings, timeout_s=self.save_timeout_s)
        self._saved_step = step
        if step:
            self.say(f"checkpoint {self.last} (step {step})")

    def wants_sync(self, loop, step):
        return step == loop.total_steps or (self.every is not None and step % self.every == 0)

    def on_sync(self, loop, step):
        self._save(loop, step)

    def on_interrupt(self, loop, step):
        if step != self._saved_step:
            self._save(loop, step)

    def on_preempt(self, loop, step, workers):
        if step != self._saved_step:
            self._save(loop, step)
        self.say(f"step {step}: grid worker(s) {', '.join(workers)} leaving "
                 f"({', '.join(sorted(set(workers.values())))}); their state is in "
                 f"{self.last}")
        return True

    def on_train_end(self, loop):
        if loop.step != self._saved_step:  # stopped early (early stopping)
            self._save(loop, loop.step)

    def on_error(self, loop, exc):
        if isinstance(exc, (CheckpointStorageError, CheckpointCorrupt)):
            return None  # storage and data faults end the run at once: no worker to wait for
        model = loop.model
        if scheduler_gone(model.client):
            return None  # no cluster to recover on: the error ends the run
        fault = as_worker_fault(model, exc, f"training step {loop._submitted}")
        if fault is None:
            return None  # the run's own error (a callback's, a bad setting): at once
        # worker programs still waiting for the lost worker's blocks hold their threads
        model.abort_programs(str(fault))
        while True:  # a replacement worker may die too: recover again
            self.restarts += 1
            self.say(f"step {loop.step + 1}: {fault}")
            if self.restarts > self.max_restarts:
                raise fault
            try:
                with _faults_as_worker_lost(model, "recovery"):
                    meta = recover(model, self.directory, grid=self.grid,
                                   wait_timeout_s=self.wait_timeout_s, log=self.say)
                break
            except WorkerLost as again:
                fault = again
        self.last = meta["path"]
        self._saved_step = step = int(meta["step"])
        self.say(f"recovered on workers {', '.join(model.binding.workers)}; resuming after "
                 f"step {step} from {self.last} (restart {self.restarts} of at most "
                 f"{self.max_restarts})")
        return step


def train_with_checkpoints(model, X, y, *, steps: int, every: int, directory,
                           batch_size: int = 32, optimizer=None, seed: int = 0,
                           resume: bool = True, keep: int | None = 2, max_restarts: int = 3,
                           wait_timeout_s: float = 120.0, step_timeout_s: float | None = None,
                           log=None, on_step=None) -> dict:
    """Train ``steps`` steps with :class:`Checkpointing` (a checkpoint every ``every``
    steps and at the end, resume, recovery from a lost worker) in the training loop of
    :meth:`Sequential.fit`: the same batches, so the same weights as ``fit`` with the
    same seed.

    ``on_step(step, loss)`` is called after each step (1-based); ``step_timeout_s``
    bounds each save. Returns ``{"steps", "start" (the step it resumed from, 0 for a
    fresh run), "restarts", "losses" (per step of the final run), "checkpoint"}``.
    """
    from dask_ipar.optim import SGD
    from dask_ipar.runtime.callbacks import OnStep
    from dask_ipar.runtime.training import prepare
    from dask_ipar.runtime.loop import BatchPlan, TrainLoop

    optimizer = optimizer or SGD()
    for name, v, lo in (("steps", steps, 1), ("every", every, 1), ("batch_size", batch_size, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise IparError(f"{name} must be an integer >= {lo}, got {v!r}.")
    if model.binding is None:
        raise IparError("train_with_checkpoints needs model.distribute(client, grid) first.")
    X, y, batch = prepare(model, X, y, batch_size)
    ck = Checkpointing(directory, every=every, resume=resume, keep=keep,
                       max_restarts=max_restarts, wait_timeout_s=wait_timeout_s,
                       save_timeout_s=step_timeout_s, log=log)
    cbs = [ck]
    if on_step is not None:
        cbs.append(OnStep(lambda st: on_step(st.step, st.loss)))
    loop = TrainLoop(model, X, y, BatchPlan(X.shape[0], batch, seed),
                     optimizer, total_steps=steps, callbacks=cbs)
    history = loop.run()
    return {"steps": loop.step, "start": ck.start, "restarts": ck.restarts,
            "losses": [s.loss for s in history.steps], "checkpoint": ck.last}
