"""A model's training state on the cluster: the weight and momentum blocks, where they are,
and whether they are still there.

:class:`BlockStore` holds the futures of every block a model keeps (weight and momentum
slice ``(i, j)`` of each layer lives on the worker of grid cell ``(i, j)``), scatters
initial weights onto their owners, fetches blocks back to the client (through host memory
on GPUs), cuts the task history behind them (:mod:`dask_ipar.runtime.lineage`), and turns a
lost block or a departed grid worker into one clear error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import numpy as np
from dask._task_spec import TaskRef

from dask_ipar.errors import IparError, WorkerHung
from dask_ipar.kernels import blocks as B
from dask_ipar.nn.graph import StepGraph
from dask_ipar.runtime.departures import departures
from dask_ipar.runtime.lineage import fold_finished_groups, missing_blocks, rekey_blocks
from dask_ipar.runtime.placement import scatter_each
from dask_ipar.runtime.weights import join_blocks
from dask_ipar.runtime.workers import (hung_after_s, hung_workers, release_hung_workers,
                                       scheduler_workers)

__all__ = ["BlockStore", "WAKE_S"]

#: Seconds between looks at the scheduler's worker-removal events while a step runs.
WAKE_S = 0.2


class BlockStore:
    """The blocks of one model on one grid binding.

    ``w`` and ``v`` are the key names of the current weight and momentum blocks, one per
    layer with weights (``v[l]`` is None before the layer's first update); block ``(i, j)``
    of name ``n`` is ``futures[(n, i, j)]``; blocks that a training step's worker programs
    left in their results (:meth:`hold`: the next step's programs take them from there)
    get a task of their own only when something else reads ``futures``
    (:meth:`materialize`). ``submit(graph, name, keys)`` runs a graph
    (the model's executor); ``abort(reason)`` stops its waiting worker programs;
    ``liveness_s()`` is the current seconds between liveness checks. ``opt`` is
    ``(kind, t)``: what the ``v`` blocks hold (``"sgd"``: momentum, ``"adam"``: the two
    moments, ``(2, rows, cols)`` per block; None before any update) and how many updates
    made them (Adam's bias correction).
    """

    def __init__(self, client, binding, uid: str, block_module, *, submit, abort,
                 liveness_s=lambda: 5.0, cuts: int = 0, opt=(None, 0)):
        self.client = client
        self.binding = binding
        self.uid = uid
        self.block_module = block_module
        self.submit = submit
        self.abort = abort
        self._futures: dict = {}  # (name, i, j) -> future of the block
        self._held: dict = {}  # (name, i, j) -> future of the program whose result holds it
        #: (name, i, j) -> the workers its program pushed it to for the next step's programs
        #: (in their mailboxes: not sent again, :meth:`sent_to`)
        self._sent: dict = {}
        self.w: list[str] | None = None
        self.v: list[str | None] | None = None
        self._liveness_s = liveness_s
        #: lineage cuts so far in the model's life (new names end in -c<cut>): carried over
        #: from the model's previous store, so a name never comes back
        self.cuts = cuts
        self.opt = tuple(opt)

    @classmethod
    def of_model(cls, model, client, binding, opt=(None, 0)) -> "BlockStore":
        """The store of ``model`` on ``binding``; it calls back through the model (its
        executor and settings may change)."""
        return cls(client, binding, model.uid, model.block_module,
                   submit=lambda *a, **k: model._submit(*a, **k),
                   abort=lambda reason: model.abort_programs(reason),
                   liveness_s=lambda: model.liveness_check_s, cuts=model._cuts, opt=opt)

    @property
    def liveness_check_s(self) -> float:
        """Seconds between checks that every grid worker is alive while waiting."""
        return self._liveness_s()

    # ---------------------------------------------------------------- keys
    @property
    def futures(self) -> dict:
        """``{(name, i, j): future}`` of every block (held ones get their tasks first)."""
        self.materialize()
        return self._futures

    def keep(self, keys, futures):
        for k, f in zip(keys, futures):
            self._futures[k] = f
            self._held.pop(k, None)
            self._sent.pop(k, None)

    def hold(self, programs: dict, sent=None):
        """Keep blocks ``{(name, i, j): future of the program holding it in its result}``
        without a task of their own: a later training step's programs read them there
        (:meth:`held_key`), anything else gets their tasks first (:meth:`materialize`).
        Saves the scheduler one task per block and step. ``sent``: ``{(name, i, j):
        workers}`` the programs push those blocks to for the next step (:meth:`sent_to`)."""
        for k, f in programs.items():
            self._held[k] = f
            self._futures.pop(k, None)
            self._sent.pop(k, None)
        self._sent.update(sent or {})

    def sent_to(self, key) -> tuple:
        """The workers whose mailboxes block ``key`` was pushed to ahead, for the next
        step's programs (:func:`~dask_ipar.runtime.compiler.compile_programs` ``ahead``):
        they read it there; empty when none."""
        return self._sent.get(key, ())

    def forget_sent(self) -> None:
        """The blocks pushed ahead are gone (an abort of the model's programs empties its
        mailboxes): the next programs send them again."""
        self._sent.clear()

    def held_key(self, key):
        """The key of the program whose result holds block ``key``, or None."""
        f = self._held.get(key)
        return None if f is None else f.key

    def holds_any(self) -> bool:
        return bool(self._futures or self._held)

    def materialize(self) -> None:
        """Give every block held in a program's result a task of its own (picking it out of
        the result, on its worker): one graph for all of them."""
        if not self._held:
            return
        from dask_ipar.runtime.programs import pick

        held, self._held = self._held, {}
        g = StepGraph()
        for k, f in held.items():
            g.add(k, self.locate(k), pick, TaskRef(f.key), k)
        self._futures.update(zip(held, self.submit(g, f"held-{self.uid}", list(held))))

    def release(self, names):
        if not names:
            return
        names = set(n for n in names if n is not None)
        for store in (self._futures, self._held, self._sent):
            for k in [k for k in store if k[0] in names]:
                del store[k]

    def locate(self, key):
        """The worker of an existing block ``(name, i, j, ...)``: that of cell (i, j)."""
        try:
            return self.binding.worker(key[1], key[2])
        except (TypeError, IndexError, KeyError) as exc:
            raise IparError(f"no grid cell for key {key!r}; keys of existing blocks are "
                            "(name, i, j, ...).") from exc

    def state(self, names):
        """Futures of every block of the layers named ``names`` (None names skipped)."""
        cells = self.binding.grid.cells()
        return [self.futures[(n, *c)] for n in names if n is not None for c in cells]

    def settled(self) -> bool:
        """Whether every block of the state (``w``, ``v``) exists now (its task, or the
        program whose result holds it, finished) and none was pushed ahead to the next
        step's programs: nothing in flight still makes or moves it (a lineage cut then
        waits for nothing). Gives held blocks no task."""
        if self.w is None or self._sent:
            return False
        for n in (*self.w, *(self.v or ())):
            for c in () if n is None else self.binding.grid.cells():
                f = self._held.get((n, *c)) or self._futures.get((n, *c))
                if f is None or not f.done():
                    return False
        return True

    def clear(self):
        self._futures.clear()
        self._held.clear()
        self._sent.clear()
        self.w = self.v = None

    # ------------------------------------------------------------- placing
    def scatter(self, layouts, params, dtype, names, step, velocity=None, v_names=None):
        """Place weight block (i, j) of every layer on cell (i, j) under ``names``.
        ``params`` are ``[(W, b), ...]`` with ``W`` of ``n_out x n_in`` values. Momentum
        starts afresh, or from ``velocity``: per layer a whole ``n_out x (n_in + bias)``
        matrix (or None), placed the same way under ``v_names``."""
        per_worker: dict[str, dict] = {}

        def place(name, lay, M):
            for i, (r0, r1) in enumerate(lay.rows):
                for j, (c0, c1) in enumerate(lay.wcols):
                    per_worker.setdefault(self.binding.worker(i, j), {})[(name, i, j)] = (
                        np.ascontiguousarray(M[..., r0:r1, c0:c1]))  # Adam: (2, r, c)

        velocity = velocity or [None] * len(names)
        new_v = []
        for k, (lay, (W, b), name) in enumerate(zip(layouts, params, names)):
            Wa = np.asarray(W, dtype=dtype).reshape(lay.n_out, lay.n_in)
            if b is not None:
                Wa = np.concatenate([Wa, np.asarray(b, dtype=dtype)[:, None]], axis=1)
            place(name, lay, Wa)
            if velocity[k] is None:
                new_v.append(None)
            else:
                place(v_names[k], lay, np.asarray(velocity[k], dtype=dtype))
                new_v.append(v_names[k])
        old = (self.w or []) + (self.v or [])
        if self.block_module:  # host blocks go up, then each owner copies its own to the GPU
            per_worker = {w: {(f"{k[0]}-host", *k[1:]): v for k, v in blocks.items()}
                          for w, blocks in per_worker.items()}
        scattered = scatter_each(self.client, per_worker)
        if self.block_module:
            g = StepGraph()
            keys = []
            for hkey in scattered:
                key = (hkey[0][: -len("-host")], *hkey[1:])
                g.add(key, self.binding.worker(*hkey[1:]), B.to_device, TaskRef(hkey),
                      self.block_module)
                keys.append(key)
            futs = self.submit(g, f"to-device-{self.uid}-s{step}", keys)
            scattered = dict(zip(keys, futs))
        self._futures.update(scattered)
        self.release(old)
        self.w = list(names)
        self.v = new_v
        if not any(n is not None for n in new_v):
            self.opt = (None, 0)  # the state starts afresh

    def whole(self, layouts, names, name: str) -> list:
        """Per layer the whole ``n_out x (n_in + bias)`` matrix of the blocks named
        ``names`` (None where a name is None), gathered to the client."""
        cells = self.binding.grid.cells()
        keys = [(n, *c) for n in names if n is not None for c in cells]
        blocks = dict(zip(keys, self.fetch(keys, [self.futures[k] for k in keys], name)))
        return [None if n is None else join_blocks(blocks, n, self.binding.grid)
                for n in names]

    def adopt(self, w_names, v_names, futures: dict):
        """Make the blocks in ``futures`` (keyed ``(name, i, j)``) the state."""
        cells = self.binding.grid.cells()
        need = {(n, *c) for n in list(w_names) + list(v_names) if n is not None for c in cells}
        missing = need - set(futures)
        if missing:
            raise IparError(f"state blocks missing for {len(missing)} keys, e.g. {min(missing)}.")
        old = (self.w or []) + (self.v or [])
        self.keep(list(need), [futures[k] for k in need])
        self.release([n for n in old if n not in set(w_names) | set(v_names)])
        self.w, self.v = list(w_names), list(v_names)

    def state_blocks(self, layouts, step: int, dtype) -> dict:
        """Where the training state lives, block by block (for checkpoints).

        Returns ``{"step", "grid": (pr, pc), "dtype", "layers": [...]}`` where each
        layer is ``{"name", "n_in", "n_out", "bias", "activation", "rows", "wcols",
        "w": {(i, j): Future}, "v": {(i, j): Future} or None, "workers": {(i, j): addr}}``.
        Weight block ``(i, j)`` holds rows ``rows[i]`` and columns ``wcols[j]`` of the
        ``n_out x (n_in + bias)`` matrix whose last column is the bias; ``v`` is the
        momentum buffer of the same shape (None before the first step). A step's
        update rewrites the weight and momentum blocks in place: they hold that step's
        values once the weight futures have finished, so wait for those before reading
        the momentum, and read both before submitting another step.
        """
        cells = self.binding.grid.cells()
        layers = []
        for lay, wn, vn in zip(layouts, self.w, self.v):
            layers.append({
                "name": lay.name, "n_in": lay.n_in, "n_out": lay.n_out, "bias": lay.bias,
                "activation": lay.activation, "rows": lay.rows, "wcols": lay.wcols,
                "w": {c: self.futures[(wn, *c)] for c in cells},
                "v": None if vn is None else {c: self.futures[(vn, *c)] for c in cells},
                "workers": {c: self.binding.worker(*c) for c in cells},
            })
        return {"step": step, "grid": (self.binding.grid.pr, self.binding.grid.pc),
                "dtype": str(dtype), "layers": layers}

    # ------------------------------------------------------------- reading
    def fetch(self, keys, futures, name: str) -> list:
        """Results of ``futures`` (keys ``(name, i, j, ...)`` on cell (i, j)) as NumPy arrays.

        On GPUs each owner first copies its block to host memory (graph ``name``), so the
        client never needs CuPy or a GPU to receive results.
        """
        if not self.block_module:
            return self.gather(list(futures))
        g = StepGraph()
        out = []
        for n, key in enumerate(keys):
            hkey = (f"host.fetch-{name}", n)
            g.add(hkey, self.binding.worker(*key[1:3]), B.to_host, TaskRef(key))
            out.append(hkey)
        return self.gather(self.submit(g, f"to-host-{name}", out))

    def gather(self, futures):
        """The results of ``futures`` (:meth:`fetch_watched`), with blocks cancelled under
        it (a worker died, the workers were restarted) turned into the one clear error of
        a lost state."""
        from distributed.client import FutureCancelledError

        try:
            return self.fetch_watched(futures, "while its blocks were fetched")
        except (FutureCancelledError, asyncio.CancelledError, concurrent.futures.CancelledError):
            self.raise_lost("its blocks were cancelled on the cluster", grace_s=10.0)

    def fetch_watched(self, futures, during: str):
        """``client.gather(futures)`` that checks the grid every ``liveness_check_s`` while
        it runs (:meth:`check_alive`, the error saying ``during`` what): a worker that
        stops answering with results still to send (stopped, swapping) would hold a
        plain ``client.gather`` forever, as its connection stays open. One batched
        gather, through dask's public asynchronous call on the client's event loop."""
        pending = asyncio.run_coroutine_threadsafe(
            self.client.gather(list(futures), asynchronous=True),
            self.client.loop.asyncio_loop)
        try:
            while not concurrent.futures.wait([pending], timeout=self.liveness_check_s).done:
                self.check_alive(during=during)
            return pending.result()  # the results, or a task's own error
        finally:
            pending.cancel()  # after a failed check: the gather stops (no dask future is)

    # ------------------------------------------------------------ liveness
    def _gone(self):
        alive = set(scheduler_workers(self.client))
        return [(c, w) for c in self.binding.grid.cells()
                if (w := self.binding.worker(*c)) not in alive]

    def check_alive(self, step=None, during=None):
        """Raise a clear error if a worker of the grid has left the cluster or stopped
        answering (no heartbeat for ``dask-ipar.hung-after``; it is then restarted by its
        nanny, or removed, so that a recovery finds it gone); the error says it happened
        ``during`` what (default: during step ``step``)."""
        during = during or f"during step {step}"
        info = scheduler_workers(self.client)
        cells = {self.binding.worker(*c): c for c in self.binding.grid.cells()}
        gone = [(c, w) for w, c in cells.items() if w not in info]
        if not gone:
            hung = hung_workers(info, cells, hung_after_s())
            if not hung:
                return
            w, silent = hung[0]
            still = release_hung_workers(self.client, [h for h, _ in hung])
            self.abort(f"worker {w} of grid cell {cells[w]} stopped answering")
            raise WorkerHung(
                f"worker {w} of grid cell {cells[w]} stopped answering {during} "
                f"(no heartbeat for {silent:.0f} s: stopped, hung or swapping; "
                f"dask-ipar.hung-after); {'it is still listed: its nanny could not restart it' if w in still else 'it was restarted or removed'}, "
                "the blocks it held are lost, so training stops here. Save checkpoints (dask_ipar.io.checkpoint or "
                "`dask-ipar train --checkpoint-dir DIR`): a run with them recovers by itself.",
                [h for h, _ in hung], silent)
        cell, w = gone[0]
        self.abort(f"worker {w} of grid cell {cell} left the cluster")
        raise IparError(
            f"worker {w} of grid cell {cell} left the cluster {during}; the blocks "
            "it held are lost, so training stops here. Save checkpoints "
            "(dask_ipar.io.checkpoint or `dask-ipar train --checkpoint-dir DIR`) and resume "
            "from the last one (`--resume`) on the restarted cluster."
        )

    def wait_alive(self, futs, step):
        """Wait for ``futs``, checking that the grid is intact every ``liveness_check_s``
        and at once when the scheduler says it removed a grid worker (its event: the
        step's programs would wait for the dead worker's blocks until the next check)."""
        from distributed import wait

        workers = self.binding.workers
        heard = departures(self.client)
        heard.watch(workers)
        check = time.monotonic() + self.liveness_check_s
        while True:
            try:
                with self.client.as_current():  # not a client the caller made current
                    wait(futs, timeout=min(WAKE_S, max(0.0, check - time.monotonic())))
                return
            except TimeoutError:
                if heard.gone(workers) or time.monotonic() >= check:
                    self.check_alive(step)
                    check = time.monotonic() + self.liveness_check_s

    def gather_step(self, futs, step):
        """Wait for a step's results, checking every few seconds that the grid is intact,
        then fetch them with the same checks (:meth:`fetch_watched`).

        Tasks are pinned to their cells, so a step whose worker died would otherwise wait
        forever; one whose data was lost fails with dask's cancellation error.
        """
        try:
            self.wait_alive(futs, step)
            return self.fetch_watched(futs, f"during step {step}")
        except IparError:
            raise
        except Exception:  # e.g. futures cancelled because their inputs were lost
            self.check_alive(step)
            raise

    def require_intact(self):
        """Raise the lost-state error unless every block is pending or finished."""
        if self.w is None:
            return
        cells = self.binding.grid.cells()
        for name in self.w + self.v:
            if name is None:
                continue
            for c in cells:
                key = (name, *c)
                f = self._futures.get(key, self._held.get(key))  # held: its program's
                status = "missing" if f is None else f.status
                if status not in ("pending", "finished"):
                    self.raise_lost(f"its block {name} of grid cell {c} is {status}", f)

    def raise_lost(self, what: str, future=None, grace_s: float = 0.0):
        """Raise the error of a model whose blocks are gone: the grid worker that left,
        if one did (waiting up to ``grace_s`` for the scheduler to notice), else the
        failed task's own error, else ``what``."""
        deadline = time.monotonic() + grace_s
        while True:
            gone = self._gone()
            if gone or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if gone:
            c, w = gone[0]
            self.abort(f"worker {w} of grid cell {c} left the cluster")
            what = f"worker {w} of grid cell {c} left the cluster (restarted or died)"
        elif future is not None and future.status == "error":
            raise future.exception()  # a failed step: its own error, not a guess
        raise IparError(f"the model's state on the cluster is lost: {what}. Restore it from a "
                        "checkpoint: checkpoint.recover(model, directory) or "
                        "`dask-ipar train --resume`.")

    # ------------------------------------------------------------- lineage
    def cut_lineage(self, step):
        """Give the weight and momentum blocks new keys that have no task history.

        Waits until the current blocks exist (the steps before have finished), then each
        worker stores its blocks under new keys as scattered data
        (:func:`~dask_ipar.runtime.lineage.rekey_blocks`: the same arrays, no copy, no
        transfer, no task), the scheduler learns of them as it does of scattered data, and
        the old keys are released. With no finished task feeding any data they still hold,
        the workers and the scheduler forget the records of all past steps; the model's
        finished task groups are folded
        (:func:`~dask_ipar.runtime.lineage.fold_finished_groups`).
        """
        from distributed import Future, wait

        cells = self.binding.grid.cells()
        old = [n for n in self.w + self.v if n is not None]
        self.wait_alive(self.state(old), step)
        self.cuts += 1  # new names end in -c<cut>: step numbers stay those of the steps
        rename, renames = {}, {}
        for n in old:
            owner, task = n.split("-", 1)[0].split(".", 1)
            rename[n] = new = f"{owner}.{task}-{self.uid}-c{self.cuts}"
            for i, j in cells:
                renames.setdefault(self.binding.worker(i, j), []).append(((n, i, j), (new, i, j)))
        # every worker must hold its blocks before any stores a new key: a worker that
        # stored some while another failed would keep keys the scheduler never frees
        missing = self.client.run(missing_blocks, renames, workers=list(renames))
        gone = [k for keys in missing.values() for k in keys]
        if gone:
            self.check_alive(step)
            raise IparError(f"weight blocks {gone[:3]} are no longer on their workers; "
                            "the model's state is lost (restore from a checkpoint).")
        # futures first: the scheduler reports the keys to the client as soon as it knows them
        futures = {new: Future(new, self.client) for pairs in renames.values() for _, new in pairs}
        nbytes = self.client.run(rekey_blocks, renames, workers=list(renames))
        self.client.sync(
            self.client.scheduler.update_data,
            who_has={k: [w] for w, blocks in nbytes.items() for k in blocks},
            nbytes={k: b for blocks in nbytes.values() for k, b in blocks.items()},
            client=self.client.id,
        )
        try:
            with self.client.as_current():
                wait(list(futures.values()), timeout=120)
        except TimeoutError:
            raise IparError(
                "the scheduler did not confirm the re-keyed weight blocks within 120 s; "
                "check that every grid worker is alive (the dashboard's Workers page)."
            ) from None
        self.keep(list(futures), list(futures.values()))
        self.release(old)
        self.w = [rename[n] for n in self.w]
        self.v = [None if n is None else rename[n] for n in self.v]
        self.client.run_on_scheduler(fold_finished_groups, self.uid)
