"""Submitting training steps: one or several consecutive steps of a model as one graph.

Its one job: :func:`submit_steps` builds the graph of consecutive SGD steps (each step's
new weights feed the next inside the graph), places their batches and hands the graph to
the model's executor once. With the ``"programs"`` executor each worker then runs all of
them in one program, so what a submission costs (the scheduler's tasks, the client's
requests, the scatter of the batches: one message per worker for all of them) is paid
once for ``steps_per_program`` steps, and the floats are those of one step at a time
(the same kernels on the same blocks in the same order per worker).
"""

from __future__ import annotations

from dask_ipar.errors import IparError
from dask_ipar.nn.graph import StepGraph
from dask_ipar.runtime.collector import collector_paused
from dask_ipar.runtime.compiler import ahead_pairs
from dask_ipar.runtime.exchange import KEEP_STEPS

__all__ = ["submit_steps", "SubmissionLosses", "StepLosses",
           "gather_losses", "check_optimizer", "check_steps_per_program",
           "auto_steps_per_program", "auto_steps_of_engine", "prices_submissions",
           "resolve_steps_per_program",
           "MAX_STEPS_PER_PROGRAM", "AUTO_SUBMISSION_S",
           "AUTO_FLOPS_PER_S", "AUTO_OVERHEAD", "AUTO_LONGEST_S"]

#: The most steps one submission may hold (``steps_per_program``): a worker's mailbox keeps
#: blocks of :data:`~dask_ipar.runtime.exchange.KEEP_STEPS` steps, and two submissions
#: may be in flight at once.
MAX_STEPS_PER_PROGRAM = KEEP_STEPS // 2


#: ``steps_per_program="auto"`` groups steps so that a submission holds about this much
#: compute: what a submission costs beyond its steps on a small cluster, about 20-25 ms
#: (the tiny MLP on 2x2: 31-41 ms a step one at a time, 9-13 ms sixteen at a time;
#: ``benchmarks/tiny_step.py``), is then paid at most once per that much work.
AUTO_SUBMISSION_S = 0.05
#: The matmul rate per worker that "auto" assumes: about one core of a current CPU, on the
#: low side (this machine's NumPy sgemm: 100 GFLOP/s on one thread), so a step is grouped
#: only when it is surely short.
AUTO_FLOPS_PER_S = 5e10
#: With a calibrated machine, "auto" also groups steps until what a submission costs beyond
#: its steps, by the step model, is at most this share of a step (8 emulated hosts on 2
#: cores, 10 Gbit/s: 40-80 ms a submission; the CNN's 8x1 step, 0.36 s, then takes 13 a
#: submission, and 4 a submission stepped 13-17% faster than 1 there) ...
AUTO_OVERHEAD = 0.02
#: ... but a submission of several steps lasts at most this many seconds by the model (a
#: stop, a checkpoint's turn and the progress bar wait for a whole submission; a preempted
#: worker's grace, :data:`~dask_ipar.runtime.preempt.GRACE_S`, is 20 s).
AUTO_LONGEST_S = 8.0


def check_steps_per_program(k) -> int | str:
    """``k`` checked: steps per submission, 1 to :data:`MAX_STEPS_PER_PROGRAM`, or
    ``"auto"``."""
    if k == "auto":
        return k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_STEPS_PER_PROGRAM:
        raise IparError(f"steps_per_program must be a whole number from 1 to "
                        f"{MAX_STEPS_PER_PROGRAM} or 'auto', got {k!r}.")
    return k


def auto_steps_per_program(model, batch: int, optimizer, machine=None,
                           cores: int | None = None) -> int:
    """Steps per submission for ``"auto"``, 1 to :data:`MAX_STEPS_PER_PROGRAM`: as many as
    fit in :data:`AUTO_SUBMISSION_S` of the step's compute (its task graph simulated at
    :data:`AUTO_FLOPS_PER_S` per worker, no transfer costs): 16 for small models, 1 where
    a step computes 50 ms or more. With ``machine`` (``dask-ipar calibrate``'s, with flop
    rates) and worker programs, at least as many as bring what a submission costs beyond
    its steps to :data:`AUTO_OVERHEAD` of a step by the step model
    (:func:`~dask_ipar.runtime.stepmodel.submission_steps`; ``cores``: the cores the
    workers share, as for :meth:`~dask_ipar.model.Sequential.predict_step_s`), as long as
    a submission lasts at most :data:`AUTO_LONGEST_S`. A machine the step model cannot
    simulate (e.g. its ``background_cores`` at least ``cores``) leaves the first rule's."""
    shape = model.input_shape if model.engine.front is not None else (model.input_dim,)
    return auto_steps_of_engine(model.engine, model._w, batch, shape, model.dtype, optimizer,
                                model.executor, machine, cores)


def resolve_steps_per_program(model, batch: int, optimizer, value, machine=None) -> int:
    """``value`` checked, ``"auto"`` resolved (:func:`auto_steps_per_program`; the cores
    the workers share read from the cluster only where ``machine`` is consulted)."""
    value = check_steps_per_program(value)
    if value != "auto":
        return value
    cores = None
    if prices_submissions(machine, model.executor):
        from dask_ipar.runtime.workers import shared_cores

        cores = shared_cores(model.client, model.binding.workers)
    return auto_steps_per_program(model, batch, optimizer, machine, cores)


def prices_submissions(machine, executor: str) -> bool:
    """Whether ``"auto"`` consults the step model on ``machine`` (calibrated flop rates,
    worker programs): where not, what the cores are is not needed either."""
    return bool(machine is not None and getattr(machine, "flops_per_s", None)
                and executor == "programs")


def auto_steps_of_engine(engine, w_names, batch, input_shape, dtype, optimizer, executor,
                         machine=None, cores=None) -> int:
    """:func:`auto_steps_per_program` of a model's ``engine`` (its weights ``w_names``),
    run by ``executor``: what the grid ranking of the benchmarks' planner takes too."""
    import numpy as np

    from dask_ipar.cost import Machine
    from dask_ipar.runtime.stepmodel import simulate_engine, submission_steps

    rough = Machine(alpha_s=0.0, bandwidth_Bps=1e15, word_bytes=np.dtype(dtype).itemsize,
                    flops_per_s=AUTO_FLOPS_PER_S)
    step_s = simulate_engine(engine, w_names, batch, input_shape, dtype, rough, None,
                             optimizer, "graph").seconds
    k = max(1, min(MAX_STEPS_PER_PROGRAM, int(AUTO_SUBMISSION_S / max(step_s, 1e-9))))
    if not prices_submissions(machine, executor) or k >= MAX_STEPS_PER_PROGRAM:
        return k
    try:
        return max(k, submission_steps(engine, w_names, batch, input_shape, dtype, machine,
                                       cores, optimizer, share=AUTO_OVERHEAD,
                                       longest_s=AUTO_LONGEST_S,
                                       most=MAX_STEPS_PER_PROGRAM))
    except (IparError, ValueError):  # the step model refuses this machine: the first rule
        return k


def submit_steps(model, batches, ahead: bool = False):
    """Submit consecutive SGD steps of ``model``, one ``(Xb, yb, optimizer)`` each (the
    optimizer at that step), as one graph: each step's weights feed the next inside it, so
    the executor runs them all in one submission (with ``"programs"``: one program per
    worker for all of them), and the per-submission costs (the scheduler's tasks, the
    client's requests, scattering the batches: one message per worker for all of them)
    are paid once. Returns per step its loss statistics: of one step its futures (one
    per worker of grid row 0), of several a :class:`StepLosses` each (their workers'
    statistics of all the steps come as one block each, when the whole submission has
    run; :func:`gather_losses` reads either). The state's task history is cut first
    (:meth:`dask_ipar.runtime.state.BlockStore.cut_lineage`) once ``model.lineage_steps``
    steps have run since the last cut and the state is settled (the caller waited for its
    steps and nothing was pushed ahead: an epoch's end; the cut then waits for nothing), or
    once twice as many have (it waits for the steps in flight then).

    ``ahead``: another training step follows this submission (the caller knows), so with
    worker programs each new weight block goes to the workers that read its layer as soon
    as it exists, and the next step's all-gather overlaps this step's backward instead of
    starting with the next program (:func:`~dask_ipar.runtime.compiler.compile_programs`
    ``ahead``; not before a lineage cut, which renames the blocks: a cut waits for a
    submission that pushed nothing ahead). A block pushed ahead
    that no step reads is moved for nothing: the bytes stay those of the cost model only
    when a step does follow.

    Python's cycle collector is paused while the graph is built, its batches scattered
    and the graph submitted (:func:`~dask_ipar.runtime.collector.collector_paused`)."""
    model._require()
    for _, _, optimizer in batches:
        check_optimizer(model, optimizer)
    every = model.lineage_steps
    if every is not None and model._since_cut >= every and (
            model._since_cut >= 2 * every or model._store.settled()):
        model._since_cut = 0
        model._store.cut_lineage(model._step)
    model._since_cut += len(batches)
    if every is not None and model._since_cut >= 2 * every:
        ahead = False  # the next submission renames the blocks first
    with collector_paused():
        return _build_and_submit(model, batches, ahead)


def _build_and_submit(model, batches, ahead=False):
    from dask_ipar.runtime.placement import scatter_each
    from dask_ipar.runtime.templates import submit_template

    done = submit_template(model, batches, _bundle_stats, ahead)
    if done is not None:  # an earlier submission's programs, replayed
        return _submitted(model, batches, done.futures, done.left, done.state, done.w, done.v,
                          done.pushed)
    store = model._store
    g = StepGraph()
    w, v = model._w, model._v
    _, t = store.opt
    first = model._step + 1
    stats, pending = [], {}
    w_last = w
    for Xb, yb, optimizer in batches:
        step = model._next_step()
        w_last = w  # the weights the last step reads
        x_keys, y_keys, _ = model._place_batch(Xb, yb, step, g, pending)
        g, w_new, v_new, st = model.engine.train_step(
            x_keys, y_keys, Xb.shape[0], w, v, step, optimizer.lr,
            getattr(optimizer, "momentum", 0.0), optimizer.weight_decay, g=g,
            optimizer=optimizer, t=t + 1,
        )
        t += 1
        stats.append(st)
        # momentum blocks updated in place keep their names (and futures)
        fresh_w, fresh_v = w_new, [n for n in v_new if n not in model._v]
        w, v = w_new, v_new
    cells = model.binding.grid.cells()
    # the new weights (new names every step) stay in the programs' results (no task of
    # their own); new momentum names (the first step's: kept for the run) get tasks
    w_keys = [(n, i, j) for n in fresh_w for i, j in cells]
    keys = [(n, i, j) for n in fresh_v for i, j in cells]
    data = scatter_each(model.client, pending) if pending else {}  # held until submitted
    flat = _bundle_stats(g, model.engine, stats, step) if len(batches) > 1 else stats[0]
    pairs = ahead_pairs(w_last, fresh_w, cells) if ahead else None
    futs, left, pushed = model._submit(g, f"step-{model.uid}-s{first}", keys + flat,
                                       step=first, first=flat if len(batches) == 1 else (),
                                       leave=w_keys, ahead=pairs or {})
    out = _submitted(model, batches, futs, left, keys, w, v, pushed)
    del data  # the graph holds the batches now
    return out


def _submitted(model, batches, futs, left, keys, w, v, pushed=None):
    """The model's state after a submission of ``batches``: momentum blocks ``keys`` (the
    first futures), new weights ``left`` (held in programs, or futures; ``pushed``: the
    workers each was pushed to ahead), names ``w`` and ``v``; returns per step its loss
    statistics (see :func:`submit_steps`)."""
    store = model._store
    _, t = store.opt
    store.opt = (_state_kind(batches[-1][2]), t + len(batches))  # Adam's update count
    store.keep(keys, futs[: len(keys)])
    if model._executor.leaves_in_programs:
        store.hold(left, pushed)
    else:
        store.keep(list(left), list(left.values()))
    store.release([n for n in store.w + store.v if n not in v])
    store.w, store.v = w, v
    if len(batches) == 1:
        return [futs[len(keys):]]
    losses = SubmissionLosses(futs[len(keys):])
    return [StepLosses(losses, i) for i in range(len(batches))]


def _bundle_stats(g, engine, stats, last: int) -> list:
    """Per worker one task (in ``g``) stacking the loss statistics of every step of the
    submission, ``stats`` (per step its keys, the same workers in the same order); its
    keys. One output per worker instead of one per worker and step: with the programs
    executor one task per worker instead of k for the scheduler, and with either one
    request per worker for all the steps' losses."""
    from dask._task_spec import TaskRef

    from dask_ipar.kernels.loss import stack_stats

    name = engine.name("loss", "stepstats", last)
    out = []
    for j, key in enumerate(stats[0]):
        worker = g.place[key]
        if any(g.place[st[j]] != worker for st in stats):  # the engines place them alike
            raise IparError(f"the loss statistics {key} of a submission's steps are on "
                            "different workers; submit one step at a time.")
        g.add((name, j), worker, stack_stats, *[TaskRef(st[j]) for st in stats])
        out.append((name, j))
    return out


class SubmissionLosses:
    """The loss statistics of a submission's steps: per worker that holds them one future
    of an array ``(steps, 2)`` (each step's ``[loss sum, correct]``), gathered once for
    all the steps."""

    def __init__(self, futures: list):
        self.futures = futures
        self._values = None

    def of_step(self, store, i: int, step: int) -> list:
        """Step ``i``'s (0-based in the submission) statistics per worker; the first
        call waits for the submission (``step``: the step named in a lost worker's
        error)."""
        if self._values is None:
            self._values = store.gather_step(self.futures, step)
        return [v[i] for v in self._values]


class StepLosses:
    """One step's share of a :class:`SubmissionLosses`."""

    def __init__(self, losses: SubmissionLosses, i: int):
        self.losses, self.i = losses, i

    def gather(self, store, step: int) -> list:
        """The step's ``[loss sum, correct]`` per worker."""
        return self.losses.of_step(store, self.i, step)


def gather_losses(store, losses, step: int) -> list:
    """Step ``step``'s ``[loss sum, correct]`` per worker, from what :func:`submit_steps`
    returned for it (its futures, or its :class:`StepLosses`)."""
    if isinstance(losses, StepLosses):
        return losses.gather(store, step)
    return store.gather_step(losses, step)


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
