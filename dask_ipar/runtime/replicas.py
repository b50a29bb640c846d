"""In-memory redundancy: a lost grid worker costs no checkpoint.

:class:`Replicas` is a training callback (``fit(replicas=N)``, ``dask-ipar train
--replicas N``). Every ``N`` steps, with the steps in flight drained, each grid cell
copies its training state (every layer's weight block and optimizer state, as one flat
array: :func:`snapshot`) on its own worker, and its *buddy* cell
(:func:`dask_ipar.cost.replica.buddy`, on another worker) fetches that copy. The local
copy takes a few milliseconds and is all the next step waits for; the transfer to the
buddy overlaps the next steps. Its bytes are a phase of their own in the comm table
(layer ``state``, phase ``replica``, :func:`dask_ipar.cost.replica.replica_phase`).

When a grid worker leaves (killed, its job cancelled, restarted by its nanny, or hung:
:class:`dask_ipar.errors.WorkerHung`), :meth:`Replicas.on_error` takes the newest refresh
that reached every buddy, waits for the cluster to have the grid's workers again (a
restarted worker, a spare), binds the grid afresh and rebuilds every block on its new
owner from a surviving copy: the cell's own snapshot where its worker lived, its buddy's
otherwise. The training loop then re-runs the steps after that refresh with the same
batches, so the run ends bit-equal to one without the fault. Where a cell's worker and
its buddy's are both gone, the replicas cannot help: the error names them (a checkpoint,
if there is one, is tried next).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from dask_ipar.cost.replica import GENERATIONS, REPLICA_LAYER, buddy, replica_phase
from dask_ipar.errors import IparError
from dask_ipar.runtime.loop import Callback

__all__ = ["Replicas", "snapshot", "restore_block", "hold", "smaller_grid", "bind_for_restore"]


def smaller_grid(model, grid, workers: int):
    """The largest grid of at least 2 cells (replicas need a buddy), fewer than ``grid``'s,
    that fits on ``workers`` workers and that the model's layers can be split over
    (closest to ``grid``'s shape first), or None."""
    from dask_ipar.layout.grid import Grid
    from dask_ipar.layout.partition import grid_shapes
    from dask_ipar.nn.dense_layout import check_dense_grid

    for p in range(min(workers, grid.size - 1), 1, -1):
        shapes = sorted(grid_shapes(p), key=lambda s: abs(np.log(s[0] / s[1])
                                                          - np.log(grid.pr / grid.pc)))
        for pr, pc in shapes:
            g = Grid(pr, pc)
            try:
                check_dense_grid(model.dense_layers, model._first_dense, g, model.sizes)
                if model._n_front:  # conv layers: rows and filters over the grid too
                    from dask_ipar.nn.shapes import front_layouts

                    front_layouts(model.layers[:model._n_front], model.input_shape, pr, pc)
            except IparError:
                continue
            return g
    return None


# ------------------------------------------------------------------ kernels
def snapshot(*blocks):
    """One flat copy of ``blocks`` (None skipped), on the cell's own worker."""
    from dask_ipar.kernels.blocks import xp_of

    parts = [b for b in blocks if b is not None]
    xp = xp_of(parts[0])
    return xp.concatenate([xp.reshape(b, (-1,)) for b in parts])


def hold(flat):
    """The buddy's copy: the array dask fetched."""
    return flat


def restore_block(flat, start: int, shape: tuple, module=None):
    """Block ``shape`` at offset ``start`` of a snapshot, as a new array (the restored
    state is updated in place later; the snapshot stays intact for another recovery);
    on ``module`` ("cupy") when the model's blocks live on GPUs."""
    from dask_ipar.kernels.blocks import to_device, xp_of

    n = int(np.prod(shape))
    out = xp_of(flat).reshape(flat[start:start + n], shape).copy()
    return to_device(out, module) if module and xp_of(out).__name__ == "numpy" else out


def bind_for_restore(model, client, grid):
    """Bind ``model`` to ``grid`` with no state, which a recovery restores next block by
    block on the workers: as ``Sequential.distribute`` after ``drop_state``, without
    computing and placing initial weights (a whole model's scatter from the client)."""
    from dask_ipar.layout.grid import parse_grid
    from dask_ipar.nn.dense_layout import check_dense_grid
    from dask_ipar.runtime.state import BlockStore
    from dask_ipar.runtime.workers import bind_grid, hold_replicas

    grid = parse_grid(grid)
    binding = bind_grid(grid, client)
    model.drop_state()
    model._amm_held = hold_replicas(client)
    model.client, model.binding = client, binding
    model._store = BlockStore.of_model(model, client, binding)
    model._init_params = model._init_velocity = None
    check_dense_grid(model.dense_layers, model._first_dense, grid, model.sizes)
    model.engine = model._make_engine(binding)
    return model


def _holders(client, future) -> list:
    """Workers holding ``future``'s data, as the scheduler says (empty when it does not)."""
    try:
        return list(client.who_has([future]).get(future.key, ()))
    except Exception:  # noqa: BLE001 - the scheduler is busy or gone: no evidence
        return []


class _Generation:
    """One refresh: per cell the futures of its own snapshot and of its buddy's copy."""

    def __init__(self, step, opt, layout, own, held, where):
        self.step, self.opt, self.layout = step, opt, layout
        self.own, self.held = own, held  # cell -> future
        self.where = where  # cell -> (worker of its own copy, worker of its buddy's copy)

    def complete(self) -> bool:
        return all(f.status == "finished" for f in self.held.values())

    def futures(self):
        return list(self.own.values()) + list(self.held.values())


class Replicas(Callback):
    """Keep each cell's training state on a buddy worker every ``every`` steps, and
    rebuild the model from those copies when a grid worker is lost (see the module).

    Parameters
    ----------
    every : int
        Steps between refreshes. A fault re-runs the steps since the newest refresh that
        reached every buddy: fewer than ``every``, or up to ``2 * every - 1`` when the
        fault comes while a refresh is still on its way.
    wait_timeout_s : float
        How long a recovery waits for the cluster to have the grid's workers again.
    max_restarts : int
        Recoveries allowed in one run.
    meter : CommMeter, optional
        Counts each refresh's predicted bytes beside the measured ones.
    log : callable, optional
        Gets one line per recovery.
    """

    def __init__(self, every: int = 1, *, wait_timeout_s: float = 120.0, max_restarts: int = 3,
                 meter=None, log=None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise IparError(f"replicas must refresh every positive number of steps, got "
                            f"{every!r} (dask-ipar train --replicas N, N >= 1; 0 turns them "
                            "off).")
        self.every, self.wait_timeout_s, self.max_restarts = every, wait_timeout_s, max_restarts
        self.meter, self.log = meter, log
        self.gens: list[_Generation] = []
        self.restarts = 0
        self.refreshed_bytes = 0

    def say(self, msg):
        if self.log is not None:
            self.log(msg)

    # ------------------------------------------------------------------ refresh
    def on_train_begin(self, loop):
        grid = loop.model.grid
        if grid.size < 2:
            raise IparError(
                f"replicas need a grid of at least 2 workers (a copy of each cell's state "
                f"lives on another cell's worker); this model is on {grid.pr}x{grid.pc}. "
                "Use a larger grid, or checkpoints (--checkpoint-dir) instead.")
        self.refresh(loop.model, loop.step)

    def wants_sync(self, loop, step):
        return step % self.every == 0 and step < loop.total_steps

    def on_sync(self, loop, step):
        self.refresh(loop.model, step)

    def on_rewind(self, loop, step):
        # resumed or recovered: the copies made before it may lie on gone workers (a
        # refresh waiting on one would never end) or predate a loaded checkpoint
        self.release()
        try:
            self.refresh(loop.model, step)
        except Exception as exc:  # noqa: BLE001 - another fault: the next step meets it
            self.release()
            self.say(f"no replicas after the recovery ({type(exc).__name__}: {exc}); the "
                     "next refresh makes them")

    def on_preempt(self, loop, step, workers):
        """Refresh at ``step`` and wait for the copies to reach their buddies; whether
        every leaving cell's buddy stays (else these copies go with it)."""
        model = loop.model
        pr, pc = model.grid.pr, model.grid.pc
        if not self.gens or self.gens[-1].step != step:
            self.refresh(model, step)
        self._settle(model)
        if not self.gens or self.gens[-1].step != step:
            return False
        cells = {model.binding.worker(i, j): (i, j) for (i, j) in model.binding.grid.cells()}
        lost = [w for w in workers if w in cells
                and model.binding.worker(*buddy(pr, pc, *cells[w])) in workers]
        if lost:
            return False
        self.say(f"step {step}: grid worker(s) {', '.join(workers)} leaving "
                 f"({', '.join(sorted(set(workers.values())))}); their state is on their "
                 "buddies")
        return True

    def on_train_end(self, loop):
        self._settle(loop.model)  # every refresh's bytes are in the comm table
        self.release()  # the run is over: nothing left to recover

    def on_epoch_end(self, loop, record):
        self._settle(loop.model)  # before the comm meter's drain (a later callback)

    def on_train_abort(self, loop, exc):
        self.release()

    def release(self):
        self.gens.clear()  # their futures go with them

    def _settle(self, model):
        """Wait for the transfers of the newest refresh (the comm meter's last drain
        counts them), then keep only it. A transfer that does not end within the
        recovery wait (its worker hung) leaves no replica rather than a stuck run."""
        from dask_ipar.io.checkpoint_faults import WorkerLost, _wait_alive

        if self.gens:
            g = self.gens[-1]
            try:
                _wait_alive(model.client, list(g.held.values()), model.binding.workers,
                            f"replica of step {g.step}", timeout_s=self.wait_timeout_s)
            except WorkerLost:
                raise  # a recovery from the older complete refresh follows
            except Exception as exc:  # noqa: BLE001 - a copy lost on its way: training goes on
                self.gens.pop()
                self.say(f"the replicas of step {g.step} did not reach their buddies "
                         f"({type(exc).__name__}: {exc}); the next refresh makes new ones")
                return
            self.gens = [g]

    def refresh(self, model, step: int) -> None:
        """Snapshot every cell's state now (nothing in flight) and send it to its buddy."""
        from dask_ipar.io.checkpoint_faults import WorkerLost, _wait_alive

        client = model.client
        if len(self.gens) >= GENERATIONS:  # at most two refreshes per process: the last
            self._settle(model)            # one's copies must have arrived first
        sb = model.state_blocks()
        pr, pc = sb["grid"]
        adam = model._store.opt[0] == "adam"
        layout = []  # per layer: (w shape per cell, v shape per cell or None)
        blocks: dict = {c: [] for c in model.binding.grid.cells()}
        words: dict = dict.fromkeys(blocks, 0)
        itemsize = np.dtype(sb["dtype"]).itemsize
        for lay in sb["layers"]:
            shapes = {}
            for (i, j) in blocks:
                r = lay["rows"][i][1] - lay["rows"][i][0]
                c = lay["wcols"][j][1] - lay["wcols"][j][0]
                vshape = None if lay["v"] is None else ((2, r, c) if adam else (r, c))
                shapes[(i, j)] = ((r, c), vshape)
                blocks[(i, j)].append(lay["w"][(i, j)])
                words[(i, j)] += r * c
                if vshape is not None:
                    blocks[(i, j)].append(lay["v"][(i, j)])
                    words[(i, j)] += int(np.prod(vshape))
            layout.append(shapes)
        n = model._next_step()
        # the buddy's fetch of "rep" is the replica phase; "repheld" copies move only in a
        # recovery (unattributed in the comm table: they are not a step's traffic)
        tag = f"{REPLICA_LAYER}.rep-{model.uid}-s{n}"
        held_tag = f"{REPLICA_LAYER}.repheld-{model.uid}-s{n}"
        own, held, where = {}, {}, {}
        for (i, j), parts in blocks.items():
            owner = model.binding.worker(i, j)
            where[(i, j)] = (owner, model.binding.worker(*buddy(pr, pc, i, j)))
            own[(i, j)] = client.submit(snapshot, *parts, key=(tag, i, j), workers=[owner],
                                        allow_other_workers=False)
            b = buddy(pr, pc, i, j)
            held[(i, j)] = client.submit(hold, own[(i, j)], key=(held_tag, i, j),
                                         workers=[model.binding.worker(*b)],
                                         allow_other_workers=False)
        # the next step updates the state in place: the local copies come first
        try:
            _wait_alive(client, list(own.values()), model.binding.workers,
                        f"replica of step {step}")
        except WorkerLost:
            raise
        except Exception as exc:  # noqa: BLE001 - no copy this time: training goes on
            self.say(f"no replicas of step {step} ({type(exc).__name__}: {exc})")
            return
        if self.meter is not None:
            from dask_ipar.cost import Machine

            m = self.meter.machine
            self.meter.add_phase(replica_phase(words, pr, pc, Machine(
                alpha_s=m.alpha_s, bandwidth_Bps=m.bandwidth_Bps, word_bytes=itemsize)))
        self.refreshed_bytes += sum(words.values()) * itemsize
        self.gens.append(_Generation(step, tuple(model._store.opt), layout, own, held, where))
        # keep the newest complete refresh and any newer one
        done = [k for k, g in enumerate(self.gens) if g.complete()]
        if done:
            self.gens = self.gens[done[-1]:]

    # ------------------------------------------------------------------ recovery
    def on_error(self, loop, exc):
        from dask_ipar.io.checkpoint_faults import WorkerLost, as_worker_fault
        from dask_ipar.runtime.workers import scheduler_gone

        model = loop.model
        if not self.gens or scheduler_gone(model.client):
            return None
        fault = as_worker_fault(model, exc, f"training step {loop._submitted}")
        if fault is None:
            return None  # the run's own error
        gone = list(fault.workers)
        model.abort_programs(f"worker(s) {', '.join(gone)} left the cluster")
        has_checkpoints = any(type(cb).__name__ == "Checkpointing" for cb in loop.callbacks)
        try:
            self._sources(model, gone)
        except WorkerLost:
            if has_checkpoints:
                self.say("the replicas cannot rebuild the lost cells: trying the checkpoints")
                return None  # the checkpoints (a later callback) may
            raise
        while True:
            self.restarts += 1
            self.say(f"step {loop.step + 1}: worker(s) {', '.join(gone)} left the cluster")
            if self.restarts > self.max_restarts:
                if has_checkpoints:
                    return None
                raise WorkerLost(gone, f"training step {loop._submitted} (after "
                                 f"{self.max_restarts} recoveries from replicas)")
            try:
                step = self._recover(model, gone)
                break
            except WorkerLost as again:
                gone = sorted(set(gone) | set(again.workers))
            except IparError as exc:  # no grid fits, or the wait ended: the checkpoints may
                if has_checkpoints:
                    self.say(f"the replicas cannot recover ({exc}): trying the checkpoints")
                    return None
                raise
        self.say(f"recovered from the replicas of step {step} on workers "
                 f"{', '.join(model.binding.workers)} (restart {self.restarts} of at most "
                 f"{self.max_restarts}); re-running the steps after it")
        return step

    def _sources(self, model, gone):
        """The newest complete refresh and, per cell, a surviving copy of it."""
        from dask_ipar.io.checkpoint_faults import WorkerLost

        gone = set(gone)
        grid = model.grid
        for g in reversed(self.gens):
            src = {}
            for (i, j) in grid.cells():
                owner, holder = g.where[(i, j)]  # where the copies were made
                if owner not in gone and g.own[(i, j)].status == "finished":
                    src[(i, j)] = g.own[(i, j)]
                elif holder not in gone and g.held[(i, j)].status == "finished":
                    src[(i, j)] = g.held[(i, j)]
            if len(src) == grid.size:
                return g, src
        lost = sorted(c for c, (owner, _) in self.gens[-1].where.items() if owner in gone) \
            if self.gens else []
        raise WorkerLost(sorted(gone), "training: the replicas of grid cell(s) "
                         f"{', '.join(map(str, lost))} were on lost workers too (a cell and its "
                         "buddy, the next cell down its column, lost together)")

    def _recover(self, model, gone) -> int:
        from dask_ipar.io.checkpoint_faults import _wait_alive
        from dask_ipar.runtime.workers import scheduler_workers, wait_for_workers

        gen, src = self._sources(model, gone)
        grid = model.grid
        client = model.client
        old_engine = model.engine  # the blocks' layout, for a regrid
        model.drop_state()
        try:
            wait_for_workers(client, grid.size, self.wait_timeout_s, self.say, revive=True)
        except IparError:
            have = len(scheduler_workers(client))
            new = smaller_grid(model, grid, have)
            if new is None:
                raise IparError(
                    f"after a worker fault the cluster has {have} worker(s) left after waiting "
                    f"{self.wait_timeout_s:.0f} s, and no grid of 2 or more of them fits the "
                    "model; start workers and train again (from a checkpoint with --resume "
                    "where the run had --checkpoint-dir)") from None
            self.say(f"no replacement worker within {self.wait_timeout_s:.0f} s: going on on "
                     f"grid {new.pr}x{new.pc}, the largest the {have} worker(s) left can hold")
            with self._faults(model, src, gen):
                self._regrid(model, gen, src, old_engine, grid, new)
            return gen.step
        with self._faults(model, src, gen):
            bind_for_restore(model, client, grid)
            has_v = any(v is not None for shapes in gen.layout for _, v in shapes.values())
            w_names, v_names = model.reserve_state_keys(has_v)
            futures = {}
            offsets = dict.fromkeys(src, 0)
            for k, shapes in enumerate(gen.layout):
                for cell, (wshape, vshape) in shapes.items():
                    owner = model.binding.worker(*cell)
                    for name, shape in ((w_names[k], wshape), (v_names[k], vshape)):
                        if shape is None:
                            continue
                        key = (name, *cell)
                        futures[key] = client.submit(
                            restore_block, src[cell], offsets[cell], shape,
                            model.block_module or None, key=key, workers=[owner],
                            allow_other_workers=False)
                        offsets[cell] += int(np.prod(shape))
            _wait_alive(client, list(futures.values()), model.binding.workers,
                        "recovery from replicas")
            v_kept = [n if any(v is not None for _, v in gen.layout[k].values()) else None
                      for k, n in enumerate(v_names)]
            model.adopt_state(w_names, v_kept, futures)
            model._store.opt = gen.opt
        return gen.step

    @contextlib.contextmanager
    def _faults(self, model, src, gen):
        """A recovery's errors: :class:`WorkerLost` where a worker it uses (the new grid's,
        or one holding a copy it restores from) left meanwhile; its own errors as they are
        (not retried as faults)."""
        from dask_ipar.io.checkpoint_faults import WorkerLost
        from dask_ipar.runtime.workers import scheduler_workers

        try:
            yield
        except WorkerLost:
            raise
        except Exception:
            time.sleep(1.0)  # the scheduler may learn of a death a moment late
            alive = set(scheduler_workers(model.client))
            used = set(model.binding.workers if model.binding is not None else ())
            used |= {w for f in src.values() for w in _holders(model.client, f)}
            # where the copies were made: a dead holder's copy is forgotten by the
            # scheduler (no holder to ask), its restore cancelled for lost dependencies
            used |= {gen.where[c][0] if f is gen.own[c] else gen.where[c][1]
                     for c, f in src.items()}
            gone = sorted(w for w in used if w not in alive)
            if gone:
                raise WorkerLost(gone, "recovery from replicas") from None
            raise

    def _regrid(self, model, gen, src, old_engine, old_grid, new_grid) -> None:
        """Rebuild the state of refresh ``gen`` on ``new_grid``: the copies are gathered to
        the client, joined into whole matrices and placed afresh (as ``distribute`` moves a
        model between grids)."""
        from dask_ipar.kernels.blocks import to_host
        from dask_ipar.runtime.weights import assemble, join_blocks, weight_shape

        client = model.client
        cells = list(src)
        flats = client.gather([client.submit(to_host, src[c], pure=False) for c in cells])
        flat = dict(zip(cells, (np.asarray(f) for f in flats)))
        offsets = dict.fromkeys(cells, 0)
        params, velocity = [], []
        for lay, shapes in zip(old_engine.param_layouts, gen.layout):
            wblocks, vblocks = {}, {}
            for cell, (wshape, vshape) in shapes.items():
                for box, shape in ((wblocks, wshape), (vblocks, vshape)):
                    if shape is None:
                        continue
                    n = int(np.prod(shape))
                    box[("x", *cell)] = flat[cell][offsets[cell]:offsets[cell] + n].reshape(shape)
                    offsets[cell] += n
            params.append(assemble(lay, "x", wblocks, old_grid, weight_shape(old_engine, lay)))
            velocity.append(join_blocks(vblocks, "x", old_grid) if vblocks else None)
        bind_for_restore(model, client, new_grid)
        model._scatter_weights(params, velocity if any(v is not None for v in velocity)
                               else None)
        model._store.opt = gen.opt
