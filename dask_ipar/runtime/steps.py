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
from dask_ipar.runtime.exchange import KEEP_STEPS

__all__ = ["submit_steps", "check_optimizer", "check_steps_per_program",
           "auto_steps_per_program", "MAX_STEPS_PER_PROGRAM", "AUTO_SUBMISSION_S",
           "AUTO_FLOPS_PER_S"]

#: The most steps one submission may hold (``steps_per_program``): a worker's mailbox keeps
#: blocks of :data:`~dask_ipar.runtime.exchange.KEEP_STEPS` steps, and two submissions
#: may be in flight at once.
MAX_STEPS_PER_PROGRAM = KEEP_STEPS // 2


#: ``steps_per_program="auto"`` groups steps so that a submission holds about this much
#: compute: what a submission costs beyond its steps on a small cluster, about 30-40 ms
#: (the tiny MLP on 2x2: 64 ms a step one at a time, 24 ms eight at a time;
#: ``benchmarks/tiny_step.py``), is then paid at most once per that much work.
AUTO_SUBMISSION_S = 0.05
#: The matmul rate per worker that "auto" assumes: about one core of a current CPU, on the
#: low side (this machine's NumPy sgemm: 100 GFLOP/s on one thread), so a step is grouped
#: only when it is surely short.
AUTO_FLOPS_PER_S = 5e10


def check_steps_per_program(k) -> int | str:
    """``k`` checked: steps per submission, 1 to :data:`MAX_STEPS_PER_PROGRAM`, or
    ``"auto"``."""
    if k == "auto":
        return k
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_STEPS_PER_PROGRAM:
        raise IparError(f"steps_per_program must be a whole number from 1 to "
                        f"{MAX_STEPS_PER_PROGRAM} or 'auto', got {k!r}.")
    return k


def auto_steps_per_program(model, batch: int, optimizer) -> int:
    """Steps per submission for ``"auto"``: as many as fit in :data:`AUTO_SUBMISSION_S`
    of the step's compute (its task graph simulated at :data:`AUTO_FLOPS_PER_S` per
    worker, no transfer costs), 1 to :data:`MAX_STEPS_PER_PROGRAM`: 8 for small models,
    1 where a step computes 50 ms or more (there a submission's cost is lost in the step,
    and a stop or a progress update waits for one step only)."""
    from dask_ipar.cost import Machine
    from dask_ipar.runtime.stepmodel import simulate_engine

    shape = model.input_shape if model.engine.front is not None else (model.input_dim,)
    machine = Machine(alpha_s=0.0, bandwidth_Bps=1e15, word_bytes=model.dtype.itemsize,
                      flops_per_s=AUTO_FLOPS_PER_S)
    step_s = simulate_engine(model.engine, model._w, batch, shape, model.dtype, machine,
                             None, optimizer, "graph").seconds
    return max(1, min(MAX_STEPS_PER_PROGRAM, int(AUTO_SUBMISSION_S / max(step_s, 1e-9))))


def submit_steps(model, batches):
    """Submit consecutive SGD steps of ``model``, one ``(Xb, yb, optimizer)`` each (the
    optimizer at that step), as one graph: each step's weights feed the next inside it, so
    the executor runs them all in one submission (with ``"programs"``: one program per
    worker for all of them), and the per-submission costs (the scheduler's tasks, the
    client's requests, scattering the batches: one message per worker for all of them)
    are paid once. Returns the loss-statistics futures of each step; they resolve when the
    whole submission has run. Every ``model.lineage_steps`` steps the state's task history
    is cut first (:meth:`dask_ipar.runtime.state.BlockStore.cut_lineage`)."""
    from dask_ipar.runtime.placement import scatter_each

    model._require()
    for _, _, optimizer in batches:
        check_optimizer(model, optimizer)
    if model.lineage_steps is not None and model._since_cut >= model.lineage_steps:
        model._since_cut = 0
        model._store.cut_lineage(model._step)
    model._since_cut += len(batches)
    store = model._store
    g = StepGraph()
    w, v = model._w, model._v
    _, t = store.opt
    first = model._step + 1
    stats, pending = [], {}
    for Xb, yb, optimizer in batches:
        step = model._next_step()
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
    keys = [(n, i, j) for n in fresh_w + fresh_v for i, j in model.binding.grid.cells()]
    data = scatter_each(model.client, pending) if pending else {}  # held until submitted
    flat = [k for st in stats for k in st]
    futs = model._submit(g, f"step-{model.uid}-s{first}", keys + flat, step=first,
                         first=flat if len(batches) == 1 else ())
    store.opt = (_state_kind(batches[-1][2]), t)  # once submitted (Adam's update count)
    store.keep(keys, futs[: len(keys)])
    store.release([n for n in store.w + store.v if n not in v])
    store.w, store.v = w, v
    del data  # the graph holds the batches now
    out, at = [], len(keys)
    for st in stats:
        out.append(futs[at:at + len(st)])
        at += len(st)
    return out


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
