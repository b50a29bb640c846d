"""Checkpoints of the model and optimizer state in Zarr, written in parallel by the block owners.

Layout of a checkpoint directory ``<dir>/ckpt-<step>/`` (a Zarr v3 group)::

    zarr.json              group attributes: format, version, step, grid, dtype,
                           sizes, layers (name, n_in, n_out, bias, activation),
                           has_velocity, extra (user metadata, JSON), arrays (shape,
                           chunks, SHA-256 per chunk), checksum (of all the rest)
    dense0/w               float array n_out x (n_in + bias), the last column the bias
    dense0/v               its momentum (absent before the first step)
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

:func:`train_with_checkpoints` is a training loop that saves every N steps and, when a
worker dies (its blocks are lost), says so, re-binds the model to the live workers and
resumes from the last checkpoint: the final weights equal an uninterrupted run's.

This module is the public API; the work is done in :mod:`.checkpoint_save` (writing),
:mod:`.checkpoint_load` (reading and verifying), :mod:`.checkpoint_tasks` (what runs on
the workers), :mod:`.checkpoint_dirs` (the directory: listing, publishing, cleaning up)
and :mod:`.checkpoint_faults` (:class:`WorkerLost` and waiting while watching the
workers). Here: the public names, :func:`recover` and the training loop.
"""

from __future__ import annotations

import math
import os

import numpy as np

from dask_ipar.io.checkpoint_dirs import checkpoints, latest
from dask_ipar.io.checkpoint_faults import WorkerLost, _faults_as_worker_lost, _wait_alive
from dask_ipar.io.checkpoint_format import FORMAT, VERSION, CheckpointCorrupt, CheckpointStorageError
from dask_ipar.io.checkpoint_load import load, read_metadata
from dask_ipar.io.checkpoint_save import save
from dask_ipar.runtime.workers import wait_for_workers
from dask_ipar.errors import IparError

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
        wait_for_workers(client, grid.size, wait_timeout_s, log)
    except IparError as exc:
        raise IparError(
            f"{exc} (after a worker fault; start workers, then resume from the last "
            "checkpoint with dask-ipar train --resume)"
        ) from None
    model.distribute(client, grid)  # binds by worker name, asking the scheduler directly
    return load(model, directory, fallback=True, log=log)


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Sample indices of training step ``step`` (0-based): a pure function of its arguments.

    Epoch ``e = step // (n // batch_size)`` shuffles the samples with
    ``default_rng([seed, e])``; the step takes the next ``batch_size`` of them (a short
    last batch is dropped), so a resumed run sees exactly the batches of an
    uninterrupted one.
    """
    per_epoch = n // batch_size
    if per_epoch < 1:
        raise IparError(f"batch size {batch_size} exceeds the {n} samples.")
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[k * batch_size:(k + 1) * batch_size]


def train_with_checkpoints(model, X, y, *, steps: int, every: int, directory,
                           batch_size: int = 32, optimizer=None, seed: int = 0,
                           resume: bool = True, keep: int | None = 2, max_restarts: int = 3,
                           wait_timeout_s: float = 120.0, step_timeout_s: float | None = None,
                           log=None, on_step=None) -> dict:
    """Train ``steps`` SGD steps, saving a checkpoint every ``every`` steps and at the end.

    When a grid worker dies, the step (or save) in flight fails with :class:`WorkerLost`;
    the loop reports it through ``log``, calls :func:`recover` (re-bind to the live
    workers, load :func:`latest`) and replays the steps since that checkpoint. Batches
    come from :func:`batch_indices`, so the result equals an uninterrupted run's.

    Parameters
    ----------
    model : Sequential
        Distributed (``model.distribute(client, grid)``).
    X, y : arrays
        Features ``(n, d)`` and integer labels ``(n,)``.
    steps, every : int
        Total steps, and steps between checkpoints (``every >= 1``).
    directory : str or path-like
        Checkpoint directory.
    batch_size, optimizer, seed
        As for :meth:`Sequential.fit`; ``seed`` drives the batch order.
    resume : bool
        Start from :func:`latest` in ``directory`` when there is one (else from step 0,
        saved first as ``ckpt-0`` so a fault before the first checkpoint is recoverable).
    keep : int or None
        Checkpoints kept on disk.
    max_restarts : int
        Worker faults survived before the last one is re-raised.
    log : callable, optional
        Gets one line per checkpoint, fault and recovery.
    on_step : callable, optional
        ``on_step(step, loss)`` after each step completes (1-based step).

    Returns
    -------
    dict
        ``{"steps", "start" (the step it resumed from, 0 for a fresh run), "restarts",
        "losses" (per step, final run), "checkpoint"}``.
    """
    from dask_ipar.io.data import as_features, as_labels
    from dask_ipar.optim import SGD

    optimizer = optimizer or SGD()
    for name, v, lo in (("steps", steps, 1), ("every", every, 1), ("batch_size", batch_size, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise IparError(f"{name} must be an integer >= {lo}, got {v!r}.")
    if model.binding is None:
        raise IparError("train_with_checkpoints needs model.distribute(client, grid) first.")
    X = as_features(X, model.input_dim, model.dtype)
    y = as_labels(y, X.shape[0], model.n_classes)
    if model.input_dim is None:
        model.input_dim = X.shape[1]
    grid = model.grid
    if batch_size < grid.pc:
        raise IparError(
            f"batch size {batch_size} is smaller than the grid's Pc = {grid.pc} columns; use "
            f"a batch of at least {grid.pc}."
        )
    say = log or (lambda msg: None)
    extra = {"optimizer": {"lr": optimizer.lr, "momentum": optimizer.momentum,
                           "weight_decay": optimizer.weight_decay},
             "batch_size": batch_size, "seed": seed}
    directory = os.fspath(directory)
    start = 0
    if resume and latest(directory) is not None:
        meta = load(model, directory, fallback=True, log=say)
        start = int(meta["step"])
        last_ckpt = meta["path"]
        say(f"resumed from {last_ckpt} (step {start})")
    else:
        found = checkpoints(directory)
        if found:
            raise IparError(
                f"{directory!r} already holds checkpoints (steps {found[0][0]} to "
                f"{found[-1][0]}) and resume is off. Resume from them (resume=True, "
                "--resume), or use an empty directory."
            )
        model.state_blocks()  # builds the initial weights
        last_ckpt = save(model, directory, step=0, keep=keep, extra=extra)
    losses: dict[int, float] = {}
    restarts = 0
    step = start
    while True:
        try:
            while step < steps:
                idx = batch_indices(X.shape[0], batch_size, step, seed)
                with _faults_as_worker_lost(model, f"training step {step + 1}"):
                    futs = model.train_step(X[idx], y[idx], optimizer)
                    _wait_alive(model.client, futs, model.binding.workers,
                                f"training step {step + 1}", step_timeout_s)
                    loss_sum, correct = np.sum(model.client.gather(futs), axis=0)
                if not math.isfinite(loss_sum):
                    raise IparError(
                        f"training diverged at step {step + 1}: the loss is {loss_sum}. "
                        "Lower the learning rate or standardize the inputs."
                    )
                step += 1
                losses[step] = float(loss_sum / len(idx))
                if on_step is not None:
                    on_step(step, losses[step])
                if step % every == 0 or step == steps:
                    with _faults_as_worker_lost(model, f"checkpoint of step {step}"):
                        last_ckpt = save(model, directory, step=step, keep=keep, extra=extra,
                                         timeout_s=step_timeout_s)
                    say(f"checkpoint {last_ckpt} (step {step})")
            break
        except WorkerLost as exc:
            fault = exc
            # worker programs still waiting for the lost worker's blocks hold their threads
            model.abort_programs(str(fault))
            while True:  # a replacement worker may die too: recover again
                restarts += 1
                say(f"step {step + 1}: {fault}")
                if restarts > max_restarts:
                    raise fault
                try:
                    with _faults_as_worker_lost(model, "recovery"):
                        meta = recover(model, directory, grid=grid,
                                       wait_timeout_s=wait_timeout_s, log=say)
                    break
                except WorkerLost as again:
                    fault = again
            step = int(meta["step"])
            last_ckpt = meta["path"]
            say(f"recovered on workers {', '.join(model.binding.workers)}; resuming after "
                f"step {step} from {last_ckpt} (restart {restarts} of at most {max_restarts})")
            for s in [s for s in losses if s > step]:
                del losses[s]
    return {"steps": step, "start": start, "restarts": restarts,
            "losses": [losses[s] for s in sorted(losses)], "checkpoint": last_ckpt}

